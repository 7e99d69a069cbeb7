"""Packed (THD) document-causal attention with PyTorch's own kernels: segments, masks, the kernel call.

For a packed batch of ``T`` tokens described by ``cu_seqlens`` (int32 ``[0, l0, l0+l1, ..., T]``),
:func:`packed_causal_attention` computes

    out_i = sum_j softmax_j(scale * q_i . k_j + M_ij) v_j,
    M_ij = 0 if seg(i) == seg(j) and j <= i else -inf,

where ``seg(i)`` is the index of the sequence that holds packed token ``i`` (:func:`segment_ids`).
No token attends across a sample boundary, so the outputs of the real tokens equal those of the
padded layout ``[b, s]`` with a causal mask (Megatron's default). Megatron's module around it is
:class:`fnppo.megatron.core_attention.PackedDotProductAttention`.

Kernels (:func:`packed_causal_attention`):

* CUDA: ``torch.nn.attention.flex_attention.flex_attention`` compiled with ``torch.compile``
  and a document-causal ``BlockMask``: fully masked blocks are skipped, so the cost grows with
  ``sum_i len_i^2``, not ``T^2``. Compiled once for the first pack length and once more, with a
  dynamic length, for the second; :func:`flex_compile_count` counts the compilations (on one H200
  with torch 2.11, 50 packs of 49 different lengths compiled the kernel twice,
  ``benchmarks/flex_compiles.py``). ``buckets=True`` pads every pack to one of a few bucket
  lengths (:func:`flex_bucket_length`: multiples of 128 up to 1,024 tokens, then 8 lengths per
  octave, at most 12.5 % padding), bounding the kernel shapes for torch versions that specialize
  on the length; the padding tokens form a segment of their own, so real tokens never see them, and
  their outputs are dropped. Off by default: it measured no fewer compilations with torch 2.11 and
  costs up to 12.5 % more attention work. Measured on one H200,
  bf16, 32 heads / 8 groups of 128, forward + backward: 6.7 ms for 32k tokens in 32 sequences
  (SDPA with a dense mask: 207 ms); 2.1 ms vs 3.4 ms for 4k tokens in 4 sequences.
* CPU, and any device when attention dropout is active: ``scaled_dot_product_attention`` with a
  causal mask on each sequence alone: the sequences become the rows of padded batches (one call per
  row length, sequences of similar length together, under 12.5 % padding above 128 tokens; one host
  sync), so the work is about ``sum_i len_i^2``. (A single call over the pack with a dense ``[T, T]`` mask let a NaN or inf of
  one sequence reach every other one, as ``0 * NaN`` in the masked products.)

NaN isolation: a non-finite value in one sequence never reaches another's outputs. The flex path
zeroes non-finite values before the kernel (inside a block shared by two sequences a masked
probability, exactly 0, multiplies the other sequence's values) and sets NaN at exactly the
outputs whose visible keys hold one (:func:`_restore_nonfinite`); masked scores are replaced, not
added to, so a NaN key stays in its sequence.

GQA (``num_query_groups < num_attention_heads``) is passed to the kernels (``enable_gqa``), not
expanded. Softmax statistics are kept in fp32 by both kernels whatever the input dtype (as
Megatron's ``attention_softmax_in_fp32``); inputs and outputs keep their dtype. Dropout
(``dropout_p > 0``) is applied by SDPA; flex attention has no dropout, so that case uses the SDPA
path (it materializes the ``[T, T]`` mask).

Reference: packed sequences without cross-contamination, arXiv:2107.02027 (Krell et al.); flex
attention, arXiv:2412.05496 (Dong et al.).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import flex_attention
from torch.utils.weak import WeakIdKeyDictionary

from fnppo.core.errors import describe, input_error
from fnppo.core.typing import Bool, CuSeqlens, Float, Int, Int32, Tensor, typechecked, typechecking_enabled
from fnppo.megatron.block_mask import document_causal_block_mask, prefix_tree_block_mask

__all__ = [
    "packed_causal_attention",
    "segment_ids",
    "document_causal_mask",
    "flex_bucket_length",
    "flex_compile_count",
    "check_cu_seqlens",
    "shared_prefix_attention",
    "FLEX_BLOCK",
]

Backend = Literal["auto", "flex", "sdpa"]

FLEX_BLOCK = 128
"""The block size of the flex-attention ``BlockMask`` (torch's default): key blocks start at
multiples of it from the start of the pack (the batch-invariant mode aligns sequences to it)."""


# ---------------------------------------------------------------------------------------------
# Segments and masks
# ---------------------------------------------------------------------------------------------
def check_cu_seqlens(fn: str, arg: str, cu_seqlens: Tensor, total: int) -> None:
    """Values of ``cu_seqlens``: starts at 0, non-decreasing, ends at ``total`` (one host sync)."""
    if cu_seqlens.numel() < 2:
        raise input_error(fn, arg, "at least 2 entries [0, l0, ...]", describe(cu_seqlens))
    values = cu_seqlens.tolist()
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        shown = values if len(values) <= 12 else values[:6] + ["..."] + values[-3:]
        raise input_error(fn, arg, f"non-decreasing cumulative lengths from 0 to the token count {total}", f"{shown}")


@typechecked
def segment_ids(cu_seqlens: CuSeqlens, total: int) -> Int32[Tensor, "{total}"]:  # noqa: F821
    """Index of the sequence that holds each packed token: ``seg(i) = k`` iff ``cu[k] <= i < cu[k+1]``.

    Computed as ``#{k >= 1 : cu[k] <= i}`` (a sorted search), so empty sequences are skipped.
    ``cu_seqlens`` must start at 0, be non-decreasing and end at ``total`` (checked).
    Reference: the THD layout of Transformer Engine / flash-attention varlen (arXiv:2205.14135).
    """
    check_cu_seqlens("fnppo.megatron.packed_attention.segment_ids", "cu_seqlens", cu_seqlens, total)
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
    check_cu_seqlens("fnppo.megatron.packed_attention.document_causal_mask", "cu_seqlens", cu_seqlens, total)
    return _dense_mask(_segment_ids(cu_seqlens, total))


def _dense_mask(seg: Tensor) -> Tensor:
    idx = torch.arange(seg.numel(), device=seg.device)
    return (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])


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
        check_cu_seqlens(fn, arg, cu_seqlens, total)
    seg = _segment_ids(cu_seqlens, total)
    if padded is not None and padded > total:
        seg = torch.cat([seg, seg.new_full((padded - total,), cu_seqlens.numel())])
    mask = document_causal_block_mask(seg) if kind == "flex" else _dense_mask(seg)
    _MASKS[cu_seqlens] = {key: mask}
    return mask


_FLEX_COMPILES = [0]  # compilations of the packed flex-attention kernel in this process (diagnostics)


def flex_compile_count() -> int:
    """How many graphs ``torch.compile`` has produced inside :func:`packed_causal_attention`'s
    flex-attention calls in this process (each a compilation of the kernel; 0 on CPU, where flex
    runs eagerly)."""
    return _FLEX_COMPILES[0]


@functools.cache
def _flex_fn(device_type: str, dynamic: bool = False) -> Any:
    """flex_attention, compiled on CUDA (once per process), eager elsewhere (slow; for tests).

    ``dynamic``: compiled for any pack length from the first call. By default torch.compile
    specializes its first graph on the first call's length and compiles a dynamic one at the
    second length: two kernels whose results for a token can differ in the last bits (on one
    H200 the first call's log-probs differed from every later composition's by up to 0.1 in bf16),
    so the batch-invariant mode runs the dynamic kernel for every call."""
    if device_type != "cuda":
        return flex_attention
    compiled = torch.compile(flex_attention, dynamic=True) if dynamic else torch.compile(flex_attention)

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
    dynamic: bool = False,
    buckets: bool = False,
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

    ``dynamic``: the CUDA flex kernel is compiled for any length from the first call (one kernel for
    every pack length, as the batch-invariant mode needs; see :func:`_flex_fn`).

    ``buckets``: the flex kernel runs at :func:`flex_bucket_length` of the pack, bounding the kernel
    shapes for torch versions that specialize on the length (off by default: no fewer compilations with
    torch 2.11); otherwise at the pack length rounded up to a multiple of :data:`FLEX_BLOCK` (Inductor's
    flex templates found no valid configuration for some short packs). The padding tokens form a segment
    of their own and their outputs are dropped.

    ``cu_seqlens`` (int32 ``[0, l0, l0+l1, ..., T]``) is validated once per tensor (a host sync;
    skipped with call-time checking off) and the mask is memoized for that tensor.
    """
    fn = "fnppo.megatron.packed_attention.packed_causal_attention"
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
        # Inductor's flex templates have no valid configuration for some short or odd lengths (a pack of one
        # 50-token sample failed to lower, NoValidChoicesError): the kernel runs at a multiple of its block
        padded = flex_bucket_length(total) if buckets else -(-total // FLEX_BLOCK) * FLEX_BLOCK
        block_mask = _cached_mask(fn, "cu_seqlens", cu_seqlens, total, "flex", padded)
        if padded > total:  # the padding tokens attend among themselves only; their outputs are dropped
            q, k, v = (F.pad(t, (0, 0, 0, padded - total)) for t in (q, k, v))
        flex = _flex_fn(query.device.type, dynamic)
        out = flex(q, k, _finite_values(v), block_mask=block_mask, scale=scale, enable_gqa=gqa)
        out = _restore_nonfinite(out[:, :, :total], value, cu_seqlens, heads)
    else:
        out = _per_sequence_sdpa(q, k, v, _bounds(fn, cu_seqlens, total), dropout_p, scale, gqa)
    return out.squeeze(0).transpose(0, 1)


def _bounds(fn: str, cu_seqlens: Tensor, total: int) -> list[int]:
    """``cu_seqlens`` as host ints (one sync), validated."""
    values = [int(v) for v in cu_seqlens.tolist()]
    if not values or values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        check_cu_seqlens(fn, "cu_seqlens", cu_seqlens, total)
    return values


def _row_length(length: int) -> int:
    """The padded row length of a sequence of ``length`` tokens in :func:`_per_sequence_sdpa`:
    multiples of 16 up to 128, then 8 lengths per octave (padding under 12.5 %)."""
    if length <= 128:
        return -(-length // 16) * 16
    step = 1 << (length.bit_length() - 4)
    return -(-length // step) * step


def _per_sequence_sdpa(
    q: Tensor, k: Tensor, v: Tensor, bounds: list[int], dropout_p: float, scale: float, gqa: bool
) -> Tensor:
    """SDPA with a causal mask on each sequence alone (``[1, H, T, D]`` views): every sequence is one
    row of a padded batch, so no score, product or NaN crosses a sequence boundary, and the work is
    about ``sum_i l_i^2``, not ``T^2``. Sequences of similar length share a call (one per row length
    of :func:`_row_length`); each row holds the sequence's tokens first and zeros after them, which
    its real queries never see (causal mask), and the padded outputs are dropped."""
    starts = torch.tensor(bounds[:-1], dtype=torch.int64)
    lengths = torch.tensor(bounds[1:], dtype=torch.int64) - starts
    total = bounds[-1]
    if total == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    rows = torch.tensor([_row_length(int(n)) for n in lengths.tolist()], dtype=torch.int64)
    zero = torch.zeros(1, 1, 1, 1, dtype=q.dtype, device=q.device)
    qz, kz, vz = (torch.cat([t, zero.expand(1, t.shape[1], 1, t.shape[3])], dim=2)[0] for t in (q, k, v))
    outs, positions = [], []
    for width in sorted(set(rows[lengths > 0].tolist())):
        members = ((rows == width) & (lengths > 0)).nonzero().squeeze(1)
        col = torch.arange(width)[None, :]
        valid = col < lengths[members, None]  # [n, width]
        index = torch.where(valid, starts[members, None] + col, torch.full_like(col, total)).to(q.device)
        qb, kb, vb = (t[:, index].transpose(0, 1) for t in (qz, kz, vz))  # [n, H, width, D]
        ob = F.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
        outs.append(ob.transpose(0, 1)[:, valid.to(q.device)])  # [H, tokens of these rows, Dv]
        positions.append(index[valid.to(q.device)])
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    order = torch.cat(positions) if len(positions) > 1 else positions[0]
    return out[:, torch.argsort(order)].unsqueeze(0)


def _finite_values(v: Tensor) -> Tensor:
    """``v`` with its non-finite entries set to 0: flex attention multiplies a masked probability
    (exactly 0) by the values of other sequences in a shared block, and ``0 * NaN`` is NaN."""
    return torch.where(torch.isfinite(v), v, torch.zeros_like(v))


def _restore_nonfinite(out: Tensor, value: Tensor, cu_seqlens: Tensor, heads: int) -> Tensor:
    """NaN at the outputs (query token, head) whose visible keys (same sequence, at or before it)
    include a non-finite value of the head's group, as attention over those values gives; the
    other outputs are those of the finite values, i.e. exactly the unaffected ones."""
    bad = (~torch.isfinite(value)).any(dim=-1)  # [T, groups]
    total = bad.shape[0]
    # bad keys at or before each token; scanned along the innermost dim ([groups, T]): a scan over
    # dim 0 of the [T, groups] tensor runs CUDA's outer-dim kernel, 775 us per layer at 8,192 tokens
    # on an H200 against 43 us this way
    count = torch.cumsum(bad.t().to(torch.int32).contiguous(), dim=1, dtype=torch.int32).t()
    seg = _segment_ids(cu_seqlens, total).to(torch.int64)
    starts = cu_seqlens.to(torch.int64)[seg]  # first token of each token's sequence
    before = torch.where(starts[:, None] > 0, count[(starts - 1).clamp_min(0)], torch.zeros_like(count))
    seen = (count - before) > 0  # [T, groups]
    seen = seen.repeat_interleave(heads // bad.shape[1], dim=1).transpose(0, 1)[None, :, :, None]  # [1, H, T, 1]
    return torch.where(seen, torch.full_like(out, float("nan")), out)


# ---------------------------------------------------------------------------------------------
# Shared-prefix packing: a document's prefix seen by each of its segments
# ---------------------------------------------------------------------------------------------
def _runs(branch: Tensor) -> tuple[Tensor, Tensor]:
    """``(start, length)`` of every run id ``0 .. max`` of ``branch_ids`` (runs are contiguous and
    numbered in order; an id without tokens has length 0), on ``branch``'s device. Counted on the
    host (one copy; CUDA's ``bincount`` adds with atomics, which the deterministic mode warns about)."""
    lengths = torch.bincount(branch.cpu())
    return (lengths.cumsum(0) - lengths).to(branch.device), lengths.to(branch.device)


_SHARED_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@typechecked
def shared_prefix_attention(
    query: Float[Tensor, "tokens heads head_dim"],
    key: Float[Tensor, "tokens groups head_dim"],
    value: Float[Tensor, "tokens groups v_dim"],
    branch_ids: Int[Tensor, " tokens"],
    root_ids: Int[Tensor, " tokens"],
    *,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    backend: Backend = "auto",
) -> Float[Tensor, "tokens heads v_dim"]:
    """Attention of a pack with shared prefixes (:mod:`fnppo.core.batching.prefix`).

    ``out_i = sum_j softmax_j(scale * q_i . k_j + M_ij) v_j`` with ``M_ij = 0`` iff ``j <= i`` and
    ``branch(j)`` is ``branch(i)`` or ``root(i)``, else ``-inf``: a document's prefix is causal
    among itself, a segment sees its document's whole prefix (which precedes it) and itself
    causally, nothing else. With one segment per document this is :func:`packed_causal_attention`.

    Kernels: ``"flex"`` (CUDA, no dropout: a ``BlockMask`` of that rule, so a segment's queries skip
    the other segments' key blocks; non-finite values isolated as in :func:`packed_causal_attention`);
    ``"sdpa"`` (CPU, dropout): every run one row of a padded batch, a segment's row its prefix
    followed by itself (the sample as it would be packed alone) with a causal mask, the prefix's
    outputs kept from its own row: no score crosses the rule and the work is that of the rows.
    ``"auto"``: flex on CUDA without dropout, sdpa otherwise.
    """
    fn = "fnppo.megatron.packed_attention.shared_prefix_attention"
    heads, groups = query.shape[1], key.shape[1]
    if groups == 0 or heads % groups != 0:
        raise input_error(fn, "key", f"a number of key/value groups dividing the {heads} query heads", describe(key))
    if backend == "flex" and dropout_p > 0:
        raise input_error(fn, "backend", "'sdpa' or 'auto' when dropout_p > 0 (flex has no dropout)", "'flex'")
    scale = 1.0 / math.sqrt(query.shape[-1]) if softmax_scale is None else float(softmax_scale)
    total = query.shape[0]
    if total == 0:
        return query.new_zeros(0, heads, value.shape[-1])
    use_flex = backend == "flex" or (backend == "auto" and query.is_cuda and dropout_p == 0.0)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    gqa = groups != heads
    if use_flex:
        # the mask and the runs once per micro-batch (every layer passes the same tensors; one host sync)
        cached = _SHARED_MASKS.get(branch_ids)
        if cached is None or cached[0] is not root_ids:
            cached = (root_ids, prefix_tree_block_mask(branch_ids, root_ids), _runs(branch_ids))
            _SHARED_MASKS[branch_ids] = cached
        out = _flex_fn(query.device.type, False)(
            q, k, _finite_values(v), block_mask=cached[1], scale=scale, enable_gqa=gqa
        )
        out = _restore_nonfinite_shared(out, value, branch_ids, root_ids, heads, cached[2])
    else:
        out = _shared_rows_sdpa(q, k, v, branch_ids, root_ids, dropout_p, scale, gqa)
    return out.squeeze(0).transpose(0, 1)


def _shared_rows_sdpa(
    q: Tensor, k: Tensor, v: Tensor, branch: Tensor, root: Tensor, dropout_p: float, scale: float, gqa: bool
) -> Tensor:
    """Causal SDPA over rows (``[1, H, T, D]`` views): every run alone, a segment after its prefix;
    each token's output is taken from the row of its own run (:func:`_rows_plan`, once per micro-batch)."""
    cached = _SHARED_ROWS.get(branch)
    if cached is None or cached[0] is not root:
        cached = (root, _rows_plan(branch, root))
        _SHARED_ROWS[branch] = cached
    groups, order = cached[1]
    zero = torch.zeros(1, 1, 1, 1, dtype=q.dtype, device=q.device)
    qz, kz, vz = (torch.cat([t, zero.expand(1, t.shape[1], 1, t.shape[3])], dim=2)[0] for t in (q, k, v))
    outs = []
    for index, keep in groups:
        qb, kb, vb = (t[:, index].transpose(0, 1) for t in (qz, kz, vz))  # [rows, H, width, D]
        ob = F.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
        outs.append(ob.transpose(0, 1)[:, keep])
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return out[:, order].unsqueeze(0)


_SHARED_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _rows_plan(branch: Tensor, root: Tensor) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """The rows of :func:`_shared_rows_sdpa`: per padded row width, ``(index, keep)`` -- each row's
    token positions (its document's prefix, then its run; ``total`` pads) and which of them are the
    row's own run -- and the order that puts the kept outputs back in pack order (one host sync)."""
    total = branch.numel()
    starts, lengths = (t.cpu() for t in _runs(branch.cpu()))
    runs = torch.nonzero(lengths).flatten()  # runs with tokens
    s, n = starts[runs], lengths[runs]
    r = root.cpu()[s]  # each run's document prefix (itself for a prefix run)
    own = r == runs
    ps = torch.where(own, s, starts[r])
    pl = torch.where(own, torch.zeros_like(n), lengths[r])
    widths = torch.tensor([_row_length(int(x)) for x in (pl + n).tolist()], dtype=torch.int64)
    groups, positions = [], []
    for width in sorted(set(widths.tolist())):
        m = widths == width
        gps, gpl, gs, gn = (t[m][:, None] for t in (ps, pl, s, n))
        c = torch.arange(width)[None, :]
        index = torch.where(c < gpl, gps + c, torch.where(c < gpl + gn, gs + c - gpl, torch.full_like(c, total)))
        keep = (c >= gpl) & (c < gpl + gn)
        groups.append((index.to(branch.device), keep.to(branch.device)))
        positions.append(index[keep])
    order = torch.argsort(torch.cat(positions)).to(branch.device)
    return groups, order


def _restore_nonfinite_shared(
    out: Tensor, value: Tensor, branch: Tensor, root: Tensor, heads: int, runs: tuple[Tensor, Tensor]
) -> Tensor:
    """NaN at the outputs whose visible keys (its run up to it, its document's prefix) hold a
    non-finite value of the head's group (the shared-prefix form of :func:`_restore_nonfinite`);
    ``runs``: :func:`_runs` of ``branch``."""
    bad = (~torch.isfinite(value)).any(dim=-1)  # [T, groups]
    count = torch.cumsum(bad.t().to(torch.int32).contiguous(), dim=1, dtype=torch.int32).t()  # [T, groups]
    zero = torch.zeros_like(count[:1])
    padded = torch.cat([zero, count])  # padded[i] = bad keys before token i
    starts, lengths = runs
    own_start = starts[branch]
    own = count - padded[own_start]
    r_start, r_len = starts[root], lengths[root]
    prefix = torch.where((root != branch)[:, None], padded[r_start + r_len] - padded[r_start], torch.zeros_like(count))
    seen = (own + prefix) > 0
    seen = seen.repeat_interleave(heads // bad.shape[1], dim=1).transpose(0, 1)[None, :, :, None]
    return torch.where(seen, torch.full_like(out, float("nan")), out)
