"""Packed (THD) causal attention for Megatron's local layer spec, with PyTorch's own kernels.

Megatron-core's local ``DotProductAttention`` refuses packed sequences (``packed_seq_params``);
only Transformer Engine's attention reads the THD layout. :class:`PackedDotProductAttention` is a
drop-in ``core_attention`` for the local spec that does: without ``packed_seq_params`` it runs
Megatron's ``DotProductAttention`` unchanged (it calls it); with ``packed_seq_params.qkv_format == "thd"``
it computes document-causal attention over the packed tokens,

    out_i = sum_j softmax_j(scale * q_i . k_j + M_ij) v_j,
    M_ij = 0 if seg(i) == seg(j) and j <= i else -inf,

where ``seg(i)`` is the index of the sequence that holds packed token ``i`` (from
``cu_seqlens``). No token attends across a sample boundary, so the outputs of the real tokens
equal those of the padded layout ``[b, s]`` with a causal mask (Megatron's default).

Kernels (:func:`packed_causal_attention`):

* CUDA: ``torch.nn.attention.flex_attention.flex_attention`` compiled with ``torch.compile``
  and a document-causal ``BlockMask``: fully masked blocks are skipped, so the cost grows with
  ``sum_i len_i^2``, not ``T^2``. Compiled once for the first pack length and once more, with a
  dynamic length, for the second; :func:`flex_compile_count` counts the compilations (on one H200
  with torch 2.11, 50 packs of 49 different lengths compiled the kernel twice,
  ``benchmarks/flex_compiles.py``). ``FNPPO_FLEX_BUCKETS=1`` pads every pack to one of a few bucket
  lengths (:func:`flex_bucket_length`: multiples of 128 up to 1,024 tokens, then 8 lengths per
  octave, at most 12.5 % padding), bounding the kernel shapes for torch versions that specialize
  on the length; the padding tokens form a segment of their own, so real tokens never see them, and
  their outputs are dropped. Off by default: it measured no fewer compilations with torch 2.11 and
  costs up to 12.5 % more attention work. Measured on one H200,
  bf16, 32 heads / 8 groups of 128, forward + backward: 6.7 ms for 32k tokens in 32 sequences
  (SDPA with a dense mask: 207 ms); 2.1 ms vs 3.4 ms for 4k tokens in 4 sequences.
* CPU, and any device when attention dropout is active: ``scaled_dot_product_attention`` with an
  explicit ``[T, T]`` boolean mask. On CPU it is the fastest of the exact options (measured for
  1k-4k tokens, 8 heads of 64, forward: 4-8x faster than flex_attention in eager mode, which also
  has no CPU backward, and 1.6-6x faster than a plain matmul-softmax-matmul).

GQA (``num_query_groups < num_attention_heads``) is passed to the kernels (``enable_gqa``), not
expanded. Softmax statistics are kept in fp32 by both kernels whatever the input dtype (as
Megatron's ``attention_softmax_in_fp32``); inputs and outputs keep their dtype.

Dropout: attention dropout with ``p > 0`` in training mode is applied by SDPA (``dropout_p``) inside
Megatron's tensor-parallel RNG tracker fork, exactly where Megatron's own module draws it; flex
attention has no dropout, so that case uses the SDPA path (it materializes the ``[T, T]`` mask).
The dropout pattern is a different random draw from Megatron's (same distribution, not the same
bits).

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
sharded by :func:`fnppo.core.context_parallel.shard_microbatch`): exact attention over the CP group by
an all-gather of K/V (:func:`fnppo.core.context_parallel.context_parallel_attention`).

Reference: packed sequences without cross-contamination, arXiv:2107.02027 (Krell et al.); flex
attention, arXiv:2412.05496 (Dong et al.).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from fnppo.core.typing import (
    Bool,
    CuSeqlens,
    Float,
    Int32,
    Tensor,
    describe,
    input_error,
    typechecked,
    typechecking_enabled,
)

__all__ = [
    "PackedDotProductAttention",
    "packed_causal_attention",
    "segment_ids",
    "document_causal_mask",
    "thd_packed_seq_params",
    "local_layer_spec",
    "default_layer_spec",
    "te_available",
    "flex_bucket_length",
    "flex_compile_count",
]

Backend = Literal["auto", "flex", "sdpa"]


# ---------------------------------------------------------------------------------------------
# Segments and masks
# ---------------------------------------------------------------------------------------------
def _check_cu_seqlens(fn: str, arg: str, cu_seqlens: Tensor, total: int) -> None:
    """Values of ``cu_seqlens``: starts at 0, non-decreasing, ends at ``total`` (one host sync)."""
    if cu_seqlens.numel() < 2:
        raise input_error(fn, arg, "at least 2 entries [0, l0, ...]", describe(cu_seqlens))
    values = cu_seqlens.tolist()
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        shown = values if len(values) <= 12 else values[:6] + ["..."] + values[-3:]
        raise input_error(
            fn, arg, f"non-decreasing cumulative lengths from 0 to the token count {total}", f"{shown}"
        )


@typechecked
def segment_ids(cu_seqlens: CuSeqlens, total: int) -> Int32[Tensor, "{total}"]:
    """Index of the sequence that holds each packed token: ``seg(i) = k`` iff ``cu[k] <= i < cu[k+1]``.

    Computed as ``#{k >= 1 : cu[k] <= i}`` (a sorted search), so empty sequences are skipped.
    ``cu_seqlens`` must start at 0, be non-decreasing and end at ``total`` (checked).
    Reference: the THD layout of Transformer Engine / flash-attention varlen (arXiv:2205.14135).
    """
    _check_cu_seqlens("fnppo.megatron.attention.segment_ids", "cu_seqlens", cu_seqlens, total)
    return _segment_ids(cu_seqlens, total)


def _segment_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True).to(torch.int32)


@typechecked
def document_causal_mask(cu_seqlens: CuSeqlens, total: int) -> Bool[Tensor, "{total} {total}"]:
    """Boolean ``[T, T]`` mask, True where query ``i`` may attend to key ``j``.

    ``allowed[i, j] = (seg(i) == seg(j)) and (j <= i)``: causal attention restricted to each packed
    sequence (arXiv:2107.02027). Note the convention is PyTorch's (True = attend), the opposite of
    Megatron's masks (True = masked out).
    """
    _check_cu_seqlens("fnppo.megatron.attention.document_causal_mask", "cu_seqlens", cu_seqlens, total)
    return _dense_mask(_segment_ids(cu_seqlens, total))


def _dense_mask(seg: Tensor) -> Tensor:
    idx = torch.arange(seg.numel(), device=seg.device)
    return (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])


def _block_mask(seg: Tensor) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (seg[q_idx] == seg[kv_idx]) & (q_idx >= kv_idx)

    total = seg.numel()
    return create_block_mask(
        document_causal, None, None, total, total, device=seg.device, _compile=seg.is_cuda
    )


# Memoized masks, keyed weakly on the cu_seqlens tensor itself: all layers of one forward pass use
# the same tensor, so the mask is built (and cu_seqlens validated, one host sync) once per
# micro-batch. An entry disappears with its tensor; a tensor modified in place is rebuilt.
_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _cached_mask(fn: str, arg: str, cu_seqlens: Tensor, total: int, kind: str, padded: int | None = None) -> Any:
    """The memoized mask of ``cu_seqlens``; ``padded`` (flex): the pack is padded to this length,
    the padding tokens forming one more segment."""
    key = (kind, total, padded, cu_seqlens._version, str(cu_seqlens.device))
    per_tensor = _MASKS.get(cu_seqlens)
    if per_tensor is not None and key in per_tensor:
        return per_tensor[key]
    if typechecking_enabled():  # a host sync; with checking off, cu_seqlens is trusted (built by collate)
        _check_cu_seqlens(fn, arg, cu_seqlens, total)
    seg = _segment_ids(cu_seqlens, total)
    if padded is not None and padded > total:
        seg = torch.cat([seg, seg.new_full((padded - total,), cu_seqlens.numel())])
    mask = _block_mask(seg) if kind == "flex" else _dense_mask(seg)
    _MASKS[cu_seqlens] = {key: mask}
    return mask


_FLEX_COMPILES = [0]  # compilations of the packed flex-attention kernel in this process (diagnostics)


def flex_compile_count() -> int:
    """How many graphs ``torch.compile`` has produced inside :func:`packed_causal_attention`'s
    flex-attention calls in this process (each a compilation of the kernel; 0 on CPU, where flex
    runs eagerly)."""
    return _FLEX_COMPILES[0]


@functools.lru_cache(maxsize=None)
def _flex_fn(device_type: str) -> Any:
    """flex_attention, compiled on CUDA (once per process), eager elsewhere (slow; for tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    from torch._dynamo.utils import counters

    compiled = torch.compile(flex_attention)

    def counted(*args: Any, **kwargs: Any) -> Any:
        before = counters["stats"]["unique_graphs"]
        out = compiled(*args, **kwargs)
        _FLEX_COMPILES[0] += counters["stats"]["unique_graphs"] - before
        return out

    return counted


def flex_bucket_length(total: int) -> int:
    """The padded pack length the flex kernel runs at: the smallest bucket ``>= total``.

    Buckets: multiples of 128 up to 1,024; above, multiples of ``2^(e - 3)`` for
    ``2^e <= total < 2^(e + 1)`` (8 buckets per octave, all multiples of 128, padding < 12.5 %).
    """
    if total <= 1024:
        return max(128, -(-total // 128) * 128)
    step = 1 << (total.bit_length() - 4)
    return -(-total // step) * step


def _buckets_on() -> bool:
    import os

    return os.environ.get("FNPPO_FLEX_BUCKETS", "0").strip().lower() in ("1", "true", "on", "yes")


# ---------------------------------------------------------------------------------------------
# The kernel entry point
# ---------------------------------------------------------------------------------------------
@typechecked
def packed_causal_attention(
    query: Float[Tensor, "tokens heads head_dim"],
    key: Float[Tensor, "tokens groups head_dim"],
    value: Float[Tensor, "tokens groups v_dim"],
    cu_seqlens: CuSeqlens,
    *,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    backend: Backend = "auto",
) -> Float[Tensor, "tokens heads v_dim"]:
    """Causal attention restricted to each sequence of a packed (THD) batch.

    ``out_i = sum_j softmax_j(scale * q_i . k_j + M_ij) v_j`` with ``M_ij = 0`` if token ``j`` is in
    the same sequence as ``i`` (from ``cu_seqlens``) and ``j <= i``, else ``-inf``
    (arXiv:2107.02027). ``scale`` defaults to ``1/sqrt(head_dim)``. Grouped-query attention: query
    head ``h`` uses key/value group ``h // (heads // groups)`` (arXiv:2305.13245), as Megatron's
    ``repeat_interleave``.

    ``backend``: ``"flex"`` (flex_attention with a document-causal BlockMask; compiled on CUDA;
    on CPU eager and forward-only, PyTorch has no CPU backward for it),
    ``"sdpa"`` (scaled_dot_product_attention with a dense ``[T, T]`` mask) or ``"auto"`` (flex on
    CUDA without dropout, sdpa otherwise). ``dropout_p > 0`` needs sdpa; the draw uses the current
    default generator of the device (fork Megatron's RNG tracker around the call for TP-consistent
    dropout, as :class:`PackedDotProductAttention` does).

    ``cu_seqlens`` (int32 ``[0, l0, l0+l1, ..., T]``) is validated once per tensor (a host sync;
    skipped with call-time checking off) and the mask is memoized for that tensor.
    """
    fn = "fnppo.megatron.attention.packed_causal_attention"
    heads, groups = query.shape[1], key.shape[1]
    if groups == 0 or heads % groups != 0:
        raise input_error(fn, "key", f"a number of key/value groups dividing the {heads} query heads", describe(key))
    if not (query.dtype == key.dtype == value.dtype):
        raise input_error(fn, "key/value", f"the query dtype {query.dtype}", f"{key.dtype} / {value.dtype}")
    if not (0.0 <= dropout_p < 1.0):
        raise input_error(fn, "dropout_p", "a probability in [0, 1)", repr(dropout_p))
    if backend not in ("auto", "flex", "sdpa"):
        raise input_error(fn, "backend", "'auto', 'flex' or 'sdpa'", repr(backend))
    if backend == "flex" and dropout_p > 0:
        raise input_error(fn, "backend", "'sdpa' or 'auto' when dropout_p > 0 (flex has no dropout)", "'flex'")
    scale = 1.0 / math.sqrt(query.shape[-1]) if softmax_scale is None else float(softmax_scale)
    total = query.shape[0]
    use_flex = total > 0 and (backend == "flex" or (backend == "auto" and query.is_cuda and dropout_p == 0.0))

    # [T, H, D] -> [1, H, T, D] (views)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    gqa = groups != heads
    if use_flex:
        padded = flex_bucket_length(total) if _buckets_on() else total
        block_mask = _cached_mask(fn, "cu_seqlens", cu_seqlens, total, "flex", padded)
        if padded > total:  # the padding tokens attend among themselves only; their outputs are dropped
            q, k, v = (F.pad(t, (0, 0, 0, padded - total)) for t in (q, k, v))
        out = _flex_fn(query.device.type)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
        out = out[:, :, :total]
    else:
        mask = _cached_mask(fn, "cu_seqlens", cu_seqlens, total, "dense")
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    return out.squeeze(0).transpose(0, 1)


@typechecked
def thd_packed_seq_params(cu_seqlens: CuSeqlens) -> PackedSeqParams:
    """Megatron ``PackedSeqParams`` for self-attention over a packed batch (``qkv_format="thd"``).

    ``cu_seqlens_q = cu_seqlens_kv = cu_seqlens`` and ``max_seqlen_q = max_seqlen_kv = max_k l_k``
    (exact: Megatron sizes its rotary table from it, and RoPE positions restart in every sequence;
    see the module docstring).
    """
    fn = "fnppo.megatron.attention.thd_packed_seq_params"
    values = cu_seqlens.tolist()
    _check_cu_seqlens(fn, "cu_seqlens", cu_seqlens, values[-1] if values else 0)
    max_len = max(b - a for a, b in zip(values, values[1:]))
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=int(max_len),
        max_seqlen_kv=int(max_len),
    )


# ---------------------------------------------------------------------------------------------
# The Megatron module
# ---------------------------------------------------------------------------------------------
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
        # (fnppo.core.context_parallel), so the parent is built with a CP-free copy of the config.
        cp = getattr(config, "context_parallel_size", 1)
        if cp > 1:
            import copy

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
        fn = "fnppo.megatron.attention.PackedDotProductAttention.forward"
        if params.qkv_format != "thd":
            raise input_error(fn, "packed_seq_params.qkv_format", "'thd'", repr(params.qkv_format))
        if attention_bias is not None:
            raise input_error(fn, "attention_bias", "None (not supported)", describe(attention_bias))
        if attention_mask is not None:
            raise input_error(
                fn, "attention_mask", "None with packed sequences (segments come from cu_seqlens)", describe(attention_mask)
            )
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise input_error(fn, "attn_mask_type", "causal or padding_causal with packed sequences", str(mask_type))
        if self.softmax_offset is not None:
            raise input_error(fn, "config.softmax_type", "'vanilla' with packed sequences", repr(self.config.softmax_type))
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
                fn, "packed_seq_params.cu_seqlens_kv", "the same segmentation as cu_seqlens_q (self-attention)",
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
            from megatron.core import parallel_state

            from fnppo.core.context_parallel import context_parallel_attention

            out = context_parallel_attention(query, key, value, cu_q, parallel_state.get_context_parallel_group(),
                                             softmax_scale=scale, dropout_p=dropout_p)
        elif dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = packed_causal_attention(query, key, value, cu_q, softmax_scale=scale, dropout_p=dropout_p)
        else:
            out = packed_causal_attention(query, key, value, cu_q, softmax_scale=scale, dropout_p=dropout_p)
        total = out.shape[0]
        return out.reshape(total, 1, -1) if squeeze else out.reshape(total, -1)


# ---------------------------------------------------------------------------------------------
# Layer specs
# ---------------------------------------------------------------------------------------------
def te_available() -> bool:
    """Whether Megatron found Transformer Engine (its own import check in the GPT layer specs)."""
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(getattr(gpt_layer_specs, "HAVE_TE", False))


Normalization = Literal["LayerNorm", "RMSNorm"]

_SPEC_DEFAULTS: dict[str, Any] = {
    "qk_layernorm": False,
    "normalization": "LayerNorm",
    "num_experts": None,
    "moe_grouped_gemm": False,
    "qk_l2_norm": False,
}


def _spec_options(config: Any, **explicit: Any) -> dict[str, Any]:
    """Explicit keyword > attribute of ``config`` (a model config) > default, per option."""
    out = {}
    for name, default in _SPEC_DEFAULTS.items():
        value = explicit.get(name)
        if value is None and config is not None:
            # TransformerConfig calls the expert count num_moe_experts.
            for attr in (name, "num_moe_experts") if name == "num_experts" else (name,):
                value = getattr(config, attr, None)
                if value is not None:
                    break
        out[name] = default if value is None else value
    return out


def local_layer_spec(
    config: Any = None,
    *,
    packed_attention: bool = True,
    qk_layernorm: bool | None = None,
    normalization: Normalization | None = None,
    num_experts: int | None = None,
    moe_grouped_gemm: bool | None = None,
    qk_l2_norm: bool | None = None,
) -> ModuleSpec:
    """Megatron's ``get_gpt_layer_local_spec(...)`` with :class:`PackedDotProductAttention` as core attention.

    Options left ``None`` are read from ``config`` (any object with attributes of those names, e.g.
    a ``TransformerConfig`` or :class:`fnppo.megatron.model.ModelConfig`), else Megatron's defaults
    (``normalization="LayerNorm"``, no qk norm, dense MLP). ``normalization`` must match the model
    config's. A new spec is built (Megatron's is not modified); its norms are
    :class:`fnppo.megatron.norms.SequenceParallelNorm` (Megatron's torch norms, usable with sequence
    parallelism). ``packed_attention=False`` keeps Megatron's local core attention. Multi-latent attention is not offered.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    fn = "fnppo.megatron.attention.local_layer_spec"
    opts = _spec_options(
        config, qk_layernorm=qk_layernorm, normalization=normalization, num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm, qk_l2_norm=qk_l2_norm,
    )
    if opts["normalization"] not in ("LayerNorm", "RMSNorm"):
        raise input_error(fn, "normalization", "'LayerNorm' or 'RMSNorm'", repr(opts["normalization"]))
    spec = get_gpt_layer_local_spec(
        num_experts=opts["num_experts"],
        moe_grouped_gemm=bool(opts["moe_grouped_gemm"]),
        qk_layernorm=bool(opts["qk_layernorm"]),
        normalization=opts["normalization"],
        qk_l2_norm=bool(opts["qk_l2_norm"]),
    )
    spec = _with_sequence_parallel_norms(spec)
    if not packed_attention:
        return spec
    attn = spec.submodules.self_attention
    if attn.submodules.core_attention is not DotProductAttention:
        raise input_error(
            fn, "packed_attention", "a local spec whose core attention is DotProductAttention",
            repr(attn.submodules.core_attention),
        )
    new_attn = dataclasses.replace(
        attn,
        params=dict(attn.params),
        submodules=dataclasses.replace(attn.submodules, core_attention=PackedDotProductAttention),
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=new_attn))


def _with_sequence_parallel_norms(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` with Megatron's ``WrappedTorchNorm`` replaced by :class:`fnppo.megatron.norms.SequenceParallelNorm`
    (the same torch norms, usable with ``sequence_parallel=True``)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from fnppo.megatron.norms import SequenceParallelNorm

    def swap(sub: Any) -> Any:
        if not dataclasses.is_dataclass(sub):
            return sub
        changes = {f.name: SequenceParallelNorm for f in dataclasses.fields(sub) if getattr(sub, f.name) is WrappedTorchNorm}
        attn = getattr(sub, "self_attention", None)
        if isinstance(attn, ModuleSpec) and dataclasses.is_dataclass(attn.submodules):
            changes["self_attention"] = dataclasses.replace(attn, params=dict(attn.params), submodules=swap(attn.submodules))
        return dataclasses.replace(sub, **changes) if changes else sub

    return dataclasses.replace(spec, submodules=swap(spec.submodules))


def default_layer_spec(
    config: Any = None,
    *,
    qk_layernorm: bool | None = None,
    normalization: Normalization | None = None,
    num_experts: int | None = None,
    moe_grouped_gemm: bool | None = None,
    qk_l2_norm: bool | None = None,
) -> ModuleSpec:
    """Transformer Engine's GPT layer spec when TE is installed, else :func:`local_layer_spec`.

    Both take packed (THD) micro-batches. Options as in :func:`local_layer_spec`; with TE the norm
    follows the model config's ``normalization`` (TE's norm module reads it).
    """
    opts = _spec_options(
        config, qk_layernorm=qk_layernorm, normalization=normalization, num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm, qk_l2_norm=qk_l2_norm,
    )
    if te_available():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=opts["num_experts"],
            moe_grouped_gemm=bool(opts["moe_grouped_gemm"]),
            qk_layernorm=bool(opts["qk_layernorm"]),
            qk_l2_norm=bool(opts["qk_l2_norm"]),
        )
    return local_layer_spec(packed_attention=True, **opts)
