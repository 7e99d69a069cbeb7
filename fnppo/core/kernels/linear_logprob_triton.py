"""Triton kernels for :func:`fnppo.linear_logprob_and_entropy`: blocked ``hidden @ weight.T`` tiles
with softmax statistics in the epilogue, so that no ``[tokens, vocab]`` tensor is ever stored.

Forward (``_fwd_kernel``): a program owns ``BM`` token rows and one contiguous split of the
vocabulary rows of ``weight``; it walks its split in tiles of ``BN`` columns, computes each fp32
tile ``x = h[rows] @ w[cols].T`` (a ``BK``-blocked dot over the hidden size) and folds it into
running per-row statistics, in base-2 units ``u = x log2(e) / T``::

    m = max_j u_j,   s = sum_j 2^(u_j - m),   w = sum_j 2^(u_j - m) (u_j - m)

rescaled exactly when a tile raises the max: ``s <- s a``, ``w <- a (w + s (m - m'))``,
``a = 2^(m - m')``. Per logit that is one max, one fma, one exp2 and two sums; only a split's
last tile masks columns. The splits (several per row block, so that the grid fills the GPU) are
merged in PyTorch and converted to natural units (times ln 2). The split index varies fastest in
the grid: programs running at the same time share their ``BM`` rows of ``hidden`` (kept in L2)
and read a handful of vocabulary regions. The label's logit ``zl = h[t] . w[label_t] / T`` is
its own small kernel (``_label_kernel``, an fp32 dot per token), so that the tiles compare no
column index with the label.

Backward (``_dz_kernel``): for one group of tokens and one block of vocabulary rows, the program
of each ``BM x BN`` tile recomputes the logits tile and writes the logit gradient in the inputs'
dtype, from the saved ``lse`` and per-token coefficients::

    log p = x / T - lse,   dz = ( p (c - b log p) + a 1[j = label] ) / T,   c = -a - b H

with ``a = dL/dlogprob``, ``b = dL/dentropy`` (passed pre-scaled by ``1/T``, so the tile does one
fma, one exp2, one fma and one multiply per logit, plus the label select). :func:`backward_grads`
contracts each block at once with cuBLAS: ``dh_group += dz @ w_block`` (fp32 accumulator) and
``dw_block (+)= dz.T @ h_group``.

On Hopper and newer GPUs the bf16/fp16 tiles are read (and the logit-gradient blocks written)
through TMA tensor descriptors when the tensors' layout allows it (16-byte aligned rows), else
through pointer loads. The host side (grids, splits, TMA descriptors, the cuBLAS contractions) is
:mod:`fnppo.core.kernels.linear_logprob_launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # Triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

from fnppo.core.kernels import triton_interpreting

__all__ = ["LOG2E", "LN2"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_LN2 = tl.constexpr(LN2)
_FWD_BM = 128  # fixed: the forward grid (and so the number of vocabulary splits) depends on it
_INTERP = dict(BM=16, BN=32, BK=16)  # the CPU interpreter: small tiles exercise the multi-tile logic
# Triton's interpreter (3.6) multiplies bf16 tiles wrongly in tl.dot: there, upcast them first.
_UPCAST = tl.constexpr(triton_interpreting())


def _fwd_configs() -> list[triton.Config]:
    # Few configs: each is compiled once and timed once per hidden size (autotuning at first call).
    # BN = 128 with 3 stages fits two programs per SM (one's epilogue overlaps the other's products).
    return [
        triton.Config({"BN": 256, "BK": 64}, num_warps=8, num_stages=3, pre_hook=_fwd_blocks),
        triton.Config({"BN": 256, "BK": 64}, num_warps=8, num_stages=4, pre_hook=_fwd_blocks),
        triton.Config({"BN": 128, "BK": 64}, num_warps=8, num_stages=3, pre_hook=_fwd_blocks),
        triton.Config({"BN": 128, "BK": 64}, num_warps=8, num_stages=4, pre_hook=_fwd_blocks),
    ]


def _dz_configs() -> list[triton.Config]:
    # The 3-stage BM=128 BN=256 setting is left out: alone it was 14 % slower than 4 stages at
    # hidden 896 (BENCHMARKS.md), yet the first-call timing kept picking it.
    return [
        triton.Config({"BM": 128, "BN": 256, "BK": 64, "GROUP_M": 8}, num_warps=8, num_stages=4, pre_hook=_dz_blocks),
        triton.Config({"BM": 256, "BN": 128, "BK": 64, "GROUP_M": 8}, num_warps=8, num_stages=3, pre_hook=_dz_blocks),
        triton.Config({"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8}, num_warps=8, num_stages=4, pre_hook=_dz_blocks),
        triton.Config({"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8}, num_warps=4, num_stages=3, pre_hook=_dz_blocks),
    ]


def _fwd_blocks(nargs: dict) -> None:
    """Autotuning hook: the tensor descriptors' block shapes follow the chosen tiles."""
    if nargs.get("TMA"):
        nargs["h_ptr"].block_shape = [nargs["BM"], nargs["BK"]]
        nargs["w_ptr"].block_shape = [nargs["BN"], nargs["BK"]]


def _dz_blocks(nargs: dict) -> None:
    if nargs.get("TMA"):
        _fwd_blocks(nargs)
        nargs["dz_ptr"].block_shape = [nargs["BM"], nargs["BN"]]


@triton.jit
def _tile_logits(
    h_ptr,
    w_ptr,
    rows,
    cols,
    row0,
    col0,
    hid,
    stride_h,
    stride_w,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
):
    """fp32 ``h[rows] @ w[cols].T``.

    ``TMA``: ``h_ptr`` and ``w_ptr`` are tensor descriptors, read at ``[row0, k]`` and ``[col0, k]``
    (out-of-bounds entries read as 0); else pointers, read at ``rows`` and ``cols`` (already clamped
    to valid indices). ``IEEE``: fp32 inputs are multiplied in full fp32 (not TF32), as ``torch.mm``
    does by default.
    """
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if TMA:
        for k0 in range(0, hid, BK):
            a = h_ptr.load([row0, k0])
            b = w_ptr.load([col0, k0])
            if _UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc)
    else:
        ks = tl.arange(0, BK)
        a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_h + ks[None, :]
        b_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
        for k0 in range(0, hid, BK):
            if EVEN_K:
                a = tl.load(a_ptrs + k0)
                b = tl.load(b_ptrs + k0)
            else:
                kmask = (k0 + ks) < hid
                a = tl.load(a_ptrs + k0, mask=kmask[None, :], other=0.0)
                b = tl.load(b_ptrs + k0, mask=kmask[None, :], other=0.0)
            if _UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _fold_tile(acc, m, s, w, col_ok, scale2, WITH_ENT: tl.constexpr, MASKED: tl.constexpr):
    """Fold one fp32 tile of logits ``x`` into the running ``(m, s, w)`` (base-2 units ``u = x scale2``).

    ``scale2 > 0``, so ``max_j u_j = scale2 max_j x_j`` and ``u_j - m' = fma(x_j, scale2, -m')``:
    per logit one max, one fma, one exp2 and the two sums. Only the last tile of a split masks.
    """
    if MASKED:
        acc = tl.where(col_ok[None, :], acc, float("-inf"))
    m_new = tl.maximum(m, tl.max(acc, 1) * scale2)
    # While a row has seen no valid column, m = m' = -inf: shift by 0 and take the
    # correction s (m - m') as 0 (s = w = 0 then).
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - shift)
    d = acc * scale2 - shift[:, None]
    e = tl.exp2(d)
    if WITH_ENT:
        ed = e * d
        if MASKED:
            ed = tl.where(col_ok[None, :], ed, 0.0)  # e = 0 and d = -inf there
        delta = tl.where(m == float("-inf"), 0.0, m - shift)
        w = alpha * (w + s * delta) + tl.sum(ed, 1)
    s = s * alpha + tl.sum(e, 1)
    return m_new, s, w


@triton.jit
def _fwd_kernel(
    h_ptr,
    w_ptr,
    m_ptr,
    s_ptr,
    went_ptr,
    n_tok,
    n_voc,
    hid,
    stride_h,
    stride_w,
    scale2,
    cols_per_split,
    WITH_ENT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_m = tl.program_id(1)
    row0 = pid_m * BM
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < n_tok
    rows_c = tl.minimum(rows, n_tok - 1)  # clamped: loads stay in bounds without masks
    m = tl.full([BM], float("-inf"), tl.float32)
    s = tl.zeros([BM], tl.float32)
    w = tl.zeros([BM], tl.float32)
    v_begin = pid_s * cols_per_split
    v_end = tl.minimum(v_begin + cols_per_split, n_voc)
    n_full = (v_end - v_begin) // BN
    for i in range(0, n_full):  # whole tiles: no masks
        col0 = v_begin + i * BN
        cols = col0 + tl.arange(0, BN)
        acc = _tile_logits(
            h_ptr, w_ptr, rows_c, cols, row0, col0, hid, stride_h, stride_w, BM, BN, BK, IEEE, EVEN_K, TMA
        )
        m, s, w = _fold_tile(acc, m, s, w, cols < v_end, scale2, WITH_ENT, False)
    col0 = v_begin + n_full * BN
    if col0 < v_end:  # the split's last, partial tile
        cols = col0 + tl.arange(0, BN)
        acc = _tile_logits(
            h_ptr,
            w_ptr,
            rows_c,
            tl.minimum(cols, n_voc - 1),
            row0,
            col0,
            hid,
            stride_h,
            stride_w,
            BM,
            BN,
            BK,
            IEEE,
            EVEN_K,
            TMA,
        )
        m, s, w = _fold_tile(acc, m, s, w, cols < v_end, scale2, WITH_ENT, True)
    out = pid_s.to(tl.int64) * n_tok + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    if WITH_ENT:
        tl.store(went_ptr + out, w, mask=row_ok)


@triton.jit
def _label_kernel(
    h_ptr,
    w_ptr,
    labels_ptr,
    zl_ptr,
    n_tok,
    n_voc,
    hid,
    stride_h,
    stride_w,
    vocab_start,
    inv_t,
    BR: tl.constexpr,
    BH: tl.constexpr,
):
    """``zl[t] = (h[t] . w[label_t - vocab_start]) / T`` in fp32 for labels in this shard, else 0."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < n_tok
    rows_c = tl.minimum(rows, n_tok - 1)
    loc = tl.load(labels_ptr + rows_c).to(tl.int64) - vocab_start
    inside = row_ok & (loc >= 0) & (loc < n_voc)
    loc = tl.where(inside, loc, 0)
    acc = tl.zeros([BR], tl.float32)
    for k0 in range(0, hid, BH):
        ks = k0 + tl.arange(0, BH)
        kmask = (ks < hid)[None, :]
        a = tl.load(h_ptr + rows_c.to(tl.int64)[:, None] * stride_h + ks[None, :], mask=kmask, other=0.0).to(tl.float32)
        b = tl.load(w_ptr + loc[:, None] * stride_w + ks[None, :], mask=kmask, other=0.0).to(tl.float32)
        acc += tl.sum(a * b, 1)
    tl.store(zl_ptr + rows, tl.where(inside, acc * inv_t, 0.0), mask=row_ok)


@triton.jit
def _merge_kernel(
    m_ptr,
    s_ptr,
    w_ptr,
    mo_ptr,
    so_ptr,
    wo_ptr,
    n_tok,
    splits,
    WITH_ENT: tl.constexpr,
    BR: tl.constexpr,
    BS: tl.constexpr,
):
    """The splits' ``(m, s, w)`` (base-2, ``[splits, tokens]``) merged per token, in natural units::

        M = max_k m_k,  S = sum_k s_k 2^(m_k - M),  W = ln2 sum_k 2^(m_k - M) (w_k + s_k (m_k - M))

    and ``M ln 2``; splits with ``m_k = -inf`` add nothing (the merge of
    :func:`fnppo.core.ops.linear_logprob._merge_stats`, in one launch instead of a dozen small ones).
    """
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ks = tl.arange(0, BS)
    ok = (ks < splits)[:, None] & (rows < n_tok)[None, :]
    idx = ks.to(tl.int64)[:, None] * n_tok + rows[None, :]
    m = tl.load(m_ptr + idx, mask=ok, other=float("-inf"))
    s = tl.load(s_ptr + idx, mask=ok, other=0.0)
    big = tl.max(m, 0)
    shift = tl.where(big == float("-inf"), 0.0, big)
    a = tl.exp2(m - shift[None, :])
    row_ok = rows < n_tok
    tl.store(mo_ptr + rows, big * _LN2, mask=row_ok)
    tl.store(so_ptr + rows, tl.sum(s * a, 0), mask=row_ok)
    if WITH_ENT:
        w = tl.load(w_ptr + idx, mask=ok, other=0.0)
        rel = tl.where(s > 0, s * (m - shift[None, :]), 0.0)
        tl.store(wo_ptr + rows, tl.sum(a * (w + rel), 0) * _LN2, mask=row_ok)


@triton.jit
def _dz_kernel(
    h_ptr,
    w_ptr,
    labels_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    lse2_ptr,
    dz_ptr,
    row_base,
    n_tok,
    col_base,
    n_cols,
    hid,
    stride_h,
    stride_w,
    stride_dz,
    col_start,
    scale2,
    HAS_GH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
):
    """The block of logit gradients of token rows ``row_base + [0, n_tok)`` and weight rows
    ``col_base + [0, n_cols)``, written to ``dz[0:n_tok, 0:n_cols]`` (the whole tensors are
    passed, with offsets: no per-block views or descriptors on the host)."""
    # Grouped tile order (tiles of GROUP_M row blocks share their columns in L2).
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_tok, BM)
    num_n = tl.cdiv(n_cols, BN)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    row0 = pid_m * BM
    col0 = pid_n * BN
    rows = row0 + tl.arange(0, BM)
    cols = col0 + tl.arange(0, BN)
    grow = row_base + tl.minimum(rows, n_tok - 1)  # clamped rows of the whole batch
    # TMA: rows past the group (or columns past the block) are loaded and computed, and their dz
    # lands in the buffer beyond [n_tok, n_cols], which nothing reads; past the tensors: zeros.
    acc = _tile_logits(
        h_ptr,
        w_ptr,
        grow,
        col_base + tl.minimum(cols, n_cols - 1),
        row_base + row0,
        col_base + col0,
        hid,
        stride_h,
        stride_w,
        BM,
        BN,
        BK,
        IEEE,
        EVEN_K,
        TMA,
    )
    # The per-token coefficients arrive scaled: a/T, (b ln 2)/T, c/T (see backward_grads).
    logp2 = acc * scale2 - tl.load(lse2_ptr + grow)[:, None]  # log2 p
    p = tl.exp2(logp2)
    c = tl.load(c_ptr + grow)
    if HAS_GH:
        b = tl.load(b_ptr + grow)
        dz = p * (c[:, None] - b[:, None] * logp2)
    else:
        dz = p * c[:, None]
    lab = tl.load(labels_ptr + grow).to(tl.int32) - col_start  # a block holds < 2^31 columns
    a = tl.load(a_ptr + grow)
    dz = tl.where(cols[None, :] == lab[:, None], dz + a[:, None], dz)
    if TMA:
        dz_ptr.store([row0, col0], dz.to(dz_ptr.dtype))
    else:
        ptrs = dz_ptr + rows.to(tl.int64)[:, None] * stride_dz + cols[None, :]
        tl.store(ptrs, dz.to(dz_ptr.dtype.element_ty), mask=(rows < n_tok)[:, None] & (cols < n_cols)[None, :])


def _even_k(args: dict) -> bool:
    return args["hid"] % args["BK"] == 0


if triton_interpreting():
    _fwd_tuned = None
    _dz_tuned = None
else:
    _fwd_tuned = triton.autotune(configs=_fwd_configs(), key=["hid", "WITH_ENT", "IEEE", "TMA"])(
        triton.heuristics({"EVEN_K": _even_k})(_fwd_kernel)
    )
    _dz_tuned = triton.autotune(configs=_dz_configs(), key=["hid", "HAS_GH", "IEEE", "TMA"])(
        triton.heuristics({"EVEN_K": _even_k})(_dz_kernel)
    )
