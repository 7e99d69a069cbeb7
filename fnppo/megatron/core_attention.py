"""Megatron's core attention for packed (THD) micro-batches on the local layer spec.

Megatron-core's local ``DotProductAttention`` refuses packed sequences (``packed_seq_params``);
only Transformer Engine's attention reads the THD layout. :class:`PackedDotProductAttention` is a
drop-in ``core_attention`` for the local spec that does: without ``packed_seq_params`` it runs
Megatron's ``DotProductAttention`` unchanged (it calls it); with ``packed_seq_params.qkv_format == "thd"``
it computes document-causal attention over the packed tokens with
:func:`fnppo.megatron.packed_attention.packed_causal_attention` (the formula and kernels are there).

Dropout: attention dropout with ``p > 0`` in training mode is applied by SDPA (``dropout_p``) inside
Megatron's tensor-parallel RNG tracker fork, exactly where Megatron's own module draws it. The
dropout pattern is a different random draw from Megatron's (same distribution, not the same bits).

RoPE with THD: Megatron 0.16 (unfused path, used on CPU and without TE) rotates each packed
sequence with positions restarting at 0, from ``cu_seqlens`` (tested against a closed-form
rotation), as long as the rotary table is shorter than the pack, i.e. ``max_seqlen_q`` /
``max_seqlen_kv`` below the pack length ``T`` (true whenever there are two non-empty sequences and
the maxima are exact). With ``max_seqlen == T`` Megatron switches to an "absolute offset" mode
(sequence ``k`` starts at position ``cu[k]``); since RoPE scores depend only on position
differences, attention is the same up to rounding. :func:`thd_packed_seq_params` builds the
parameters with the exact maxima. Position ids passed to ``GPTModel.forward`` are not used by
RoPE models.

Not supported in the packed path (a clear error, never a silent wrong answer): attention bias, an
explicit ``attention_mask`` (segments come from ``cu_seqlens``), ``softmax_type`` other than
``"vanilla"``, sliding-window attention, mask types other than causal, and different query and
key/value segmentations. Context parallelism (``context_parallel_size > 1``, packed micro-batches
sharded by :func:`fnppo.core.batching.context_parallel.shard_microbatch`): exact attention over the CP group by
an all-gather of K/V (:func:`fnppo.core.batching.context_parallel.context_parallel_attention`). The
batch-invariant mode's attention is a subclass (:class:`fnppo.megatron.numerics.InvariantAttention`).

Reference: packed sequences without cross-contamination, arXiv:2107.02027 (Krell et al.).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from fnppo.core.batching.context_parallel import context_parallel_attention
from fnppo.core.errors import describe, input_error
from fnppo.core.typing import CuSeqlens, Tensor, typechecked
from fnppo.megatron.packed_attention import check_cu_seqlens, packed_causal_attention
from fnppo.megatron.shared_prefix import SharedPackedSeqParams, shared_core_attention

__all__ = ["PackedDotProductAttention", "thd_packed_seq_params"]


@typechecked
def thd_packed_seq_params(cu_seqlens: CuSeqlens) -> PackedSeqParams:
    """Megatron ``PackedSeqParams`` for self-attention over a packed batch (``qkv_format="thd"``).

    ``cu_seqlens_q = cu_seqlens_kv = cu_seqlens`` and ``max_seqlen_q = max_seqlen_kv = max_k l_k``
    (exact: Megatron sizes its rotary table from it, and RoPE positions restart in every sequence;
    see the module docstring).
    """
    fn = "fnppo.megatron.core_attention.thd_packed_seq_params"
    values = cu_seqlens.tolist()
    check_cu_seqlens(fn, "cu_seqlens", cu_seqlens, values[-1] if values else 0)
    max_len = max(b - a for a, b in zip(values, values[1:]))
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=int(max_len),
        max_seqlen_kv=int(max_len),
    )


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention`` that also accepts packed (THD) micro-batches.

    Same constructor as ``megatron.core.transformer.dot_product_attention.DotProductAttention``
    (megatron-core 0.16.1). ``forward(query, key, value, attention_mask, attn_mask_type=None,
    attention_bias=None, packed_seq_params=None)``:

    * ``packed_seq_params is None``: Megatron's ``DotProductAttention.forward`` unchanged
      (``[sq, b, np, hn]`` in, ``[sq, b, np * hn]`` out).
    * ``packed_seq_params.qkv_format == "thd"``: query ``[T, np, hn]`` (as Megatron's ``Attention``
      passes it, batch dimension squeezed) or ``[T, 1, np, hn]``; key/value with
      ``num_query_groups`` per partition. Returns ``[T, np * hn]`` (resp. ``[T, 1, np * hn]``):
      :func:`packed_causal_attention` over the segments of ``cu_seqlens_q_padded`` if given, else
      ``cu_seqlens_q`` (the key/value segmentation must be the same). Scale, including
      ``apply_query_key_layer_scaling``, is the one Megatron uses; attention dropout is drawn inside
      Megatron's RNG tracker fork (see the module docstring).
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        # Megatron's local attention refuses context parallelism; the packed path does it itself
        # (fnppo.core.batching.context_parallel), so the parent is built with a CP-free copy of the config.
        cp = getattr(config, "context_parallel_size", 1)
        if cp > 1:
            config_without_cp = copy.copy(config)
            config_without_cp.context_parallel_size = 1
        super().__init__(config_without_cp if cp > 1 else config, *args, **kwargs)
        self.config = config

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if isinstance(packed_seq_params, SharedPackedSeqParams):  # shared prefixes (fnppo.megatron.shared_prefix)
            return shared_core_attention(
                self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        if packed_seq_params is None:
            return super().forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=None,
            )
        return self._forward_thd(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)

    def _forward_thd(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None,
        attention_bias: Tensor | None,
        params: PackedSeqParams,
    ) -> Tensor:
        fn = "fnppo.megatron.core_attention.PackedDotProductAttention.forward"
        if params.qkv_format != "thd":
            raise input_error(fn, "packed_seq_params.qkv_format", "'thd'", repr(params.qkv_format))
        if attention_bias is not None:
            raise input_error(fn, "attention_bias", "None (not supported)", describe(attention_bias))
        if attention_mask is not None:
            raise input_error(
                fn,
                "attention_mask",
                "None with packed sequences (segments come from cu_seqlens)",
                describe(attention_mask),
            )
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise input_error(fn, "attn_mask_type", "causal or padding_causal with packed sequences", str(mask_type))
        if self.softmax_offset is not None:
            raise input_error(
                fn, "config.softmax_type", "'vanilla' with packed sequences", repr(self.config.softmax_type)
            )
        if self.scale_mask_softmax.window_size is not None:
            raise input_error(
                fn, "config.window_size", "None with packed sequences", repr(self.scale_mask_softmax.window_size)
            )
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        if cu_q is None:
            raise input_error(fn, "packed_seq_params.cu_seqlens_q", "an int32 tensor", "None")
        if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_kv, cu_q):
            raise input_error(
                fn,
                "packed_seq_params.cu_seqlens_kv",
                "the same segmentation as cu_seqlens_q (self-attention)",
                describe(cu_kv),
            )

        squeeze = query.dim() == 4
        if squeeze:
            if query.shape[1] != 1 or key.shape[1] != 1 or value.shape[1] != 1:
                raise input_error(fn, "query", "[T, 1, heads, dim] in THD format (batch 1)", describe(query))
            query, key, value = query[:, 0], key[:, 0], value[:, 0]

        # Megatron divides the scale by the layer number and multiplies the scores back inside the
        # softmax (apply_query_key_layer_scaling); the net scale is the product.
        coeff = self.scale_mask_softmax.scale
        scale = self.softmax_scale * (coeff if coeff is not None else 1.0)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        if getattr(self.config, "context_parallel_size", 1) > 1:
            out = context_parallel_attention(
                query,
                key,
                value,
                cu_q,
                self.pg_collection.cp,  # Megatron's attention passes its groups in (tp, cp)
                softmax_scale=scale,
                dropout_p=dropout_p,
            )
        elif dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = packed_causal_attention(query, key, value, cu_q, softmax_scale=scale, dropout_p=dropout_p)
        else:
            out = packed_causal_attention(query, key, value, cu_q, softmax_scale=scale, dropout_p=dropout_p)
        total = out.shape[0]
        return out.reshape(total, 1, -1) if squeeze else out.reshape(total, -1)
