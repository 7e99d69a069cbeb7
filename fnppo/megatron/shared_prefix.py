"""Shared-prefix micro-batches in Megatron's forward: their packed-sequence parameters, RoPE at
each token's own position, and the core attention of the local layer spec.

A micro-batch packed with shared prefixes (:mod:`fnppo.core.batching.prefix`) reaches Megatron as a
:class:`SharedPackedSeqParams` (THD): the pack is one sequence to everything in Megatron that reads
``cu_seqlens`` (``[0, T]``), and carries what fnppo's attention needs: every token's run
(``branch_ids``), the run whose keys it also sees (``root_ids``) and its position.

RoPE: Megatron rotates a packed token by its offset in its ``cu_seqlens`` sequence (restarting at
0), which is not a segment's position (it continues from the prompt). :func:`shared_rope` makes the
decoder's rotary table one row per token, ``table[position_ids]`` (a forward pre-hook on the
decoder for one forward call); with one sequence of ``T`` tokens every RoPE path of Megatron
(unfused THD, fnppo's fused adapter, Transformer Engine's fused THD kernel) then rotates token
``i`` by row ``i``: its own position. Learned absolute position embeddings read ``position_ids``
directly.

:func:`shared_core_attention` is what :class:`~fnppo.megatron.core_attention.PackedDotProductAttention`
runs for such parameters (:func:`~fnppo.megatron.packed_attention.shared_prefix_attention`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from torch import nn

from fnppo.core.batching.sample import Microbatch
from fnppo.core.errors import describe, input_error
from fnppo.core.typing import Tensor
from fnppo.megatron.packed_attention import shared_prefix_attention

__all__ = ["SharedPackedSeqParams", "shared_packed_seq_params", "shared_rope", "shared_core_attention"]


@dataclasses.dataclass
class SharedPackedSeqParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` (THD, the pack as one sequence ``[0, T]``) of a micro-batch
    with shared prefixes, and its runs: ``branch_ids``, ``root_ids``, ``position_ids`` (int64 ``[T]``)."""

    branch_ids: Tensor | None = None
    root_ids: Tensor | None = None
    position_ids: Tensor | None = None


def shared_packed_seq_params(mb: Microbatch) -> SharedPackedSeqParams:
    """The :class:`SharedPackedSeqParams` of a shared micro-batch (``mb.is_shared``)."""
    device = mb.input_ids.device
    total = int(mb.input_ids.shape[1])
    whole = torch.tensor([0, total], dtype=torch.int32, device=device)
    assert mb.branch_ids is not None and mb.root_ids is not None  # set with spans by collate
    return SharedPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=whole,
        cu_seqlens_kv=whole,
        max_seqlen_q=total,
        max_seqlen_kv=total,
        branch_ids=mb.branch_ids[0].to(device),
        root_ids=mb.root_ids[0].to(device),
        position_ids=mb.position_ids[0].to(device),
    )


def _decoder(model: nn.Module) -> nn.Module | None:
    """The transformer block of the GPTModel inside ``model`` (None where it has none)."""
    for m in model.modules():
        decoder = getattr(m, "decoder", None)
        if isinstance(decoder, nn.Module) and hasattr(m, "rotary_pos_emb"):
            return decoder
    return None


@contextlib.contextmanager
def shared_rope(model: nn.Module, params: Any) -> Iterator[None]:
    """While the block runs, a micro-batch of :class:`SharedPackedSeqParams` gets the decoder's
    rotary table indexed by its tokens' positions (one row per token); anything else is left alone."""
    decoder = _decoder(model) if isinstance(params, SharedPackedSeqParams) else None
    if decoder is None:
        yield
        return

    def per_token(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        table = kwargs.get("rotary_pos_emb")
        if isinstance(table, torch.Tensor):
            kwargs = {**kwargs, "rotary_pos_emb": table[params.position_ids]}
        return args, kwargs

    handle = decoder.register_forward_pre_hook(per_token, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def shared_core_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    attn_mask_type: AttnMaskType | None,
    attention_bias: Tensor | None,
    params: SharedPackedSeqParams,
) -> Tensor:
    """The core attention of ``module`` (a ``PackedDotProductAttention``) for a shared micro-batch:
    query ``[T, heads, dim]`` or ``[T, 1, heads, dim]`` in, ``[T, heads * dim]`` (resp.
    ``[T, 1, heads * dim]``) out; the scale and dropout of Megatron's module.

    Raises:
        InputError: an attention mask or bias, a mask type other than causal, softmax offsets or a
            window, context parallelism, the batch-invariant mode (fnppo's steps refuse these
            before anything runs).
    """
    fn = "fnppo.megatron.core_attention.PackedDotProductAttention.forward"
    config = module.config
    mask_type = module.attn_mask_type if attn_mask_type is None else attn_mask_type
    if attention_mask is not None or attention_bias is not None:
        raise input_error(fn, "attention_mask", "None with shared-prefix packing", describe(attention_mask))
    if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
        raise input_error(fn, "attn_mask_type", "causal with shared-prefix packing", str(mask_type))
    if module.softmax_offset is not None or module.scale_mask_softmax.window_size is not None:
        raise input_error(fn, "config", "vanilla softmax without a window with shared-prefix packing", "other")
    if getattr(config, "context_parallel_size", 1) > 1:
        raise input_error(fn, "packed_seq_params", "no shared prefixes with context parallelism", "shared")
    squeeze = query.dim() == 4
    q, k, v = (t[:, 0] for t in (query, key, value)) if squeeze else (query, key, value)
    coeff = module.scale_mask_softmax.scale
    scale = module.softmax_scale * (coeff if coeff is not None else 1.0)
    dropout_p = module.attention_dropout.p if module.training else 0.0
    args = (q, k, v, params.branch_ids, params.root_ids)
    if dropout_p > 0.0 and not config.sequence_parallel:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            out = shared_prefix_attention(*args, softmax_scale=scale, dropout_p=dropout_p)
    else:
        out = shared_prefix_attention(*args, softmax_scale=scale, dropout_p=dropout_p)
    total = out.shape[0]
    return out.reshape(total, 1, -1) if squeeze else out.reshape(total, -1)
