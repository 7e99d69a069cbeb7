"""Triton kernels for :func:`fnppo.core.ops.linear_distill.linear_logprob_entropy_and_divergence`:
the tiles of :mod:`fnppo.core.kernels.linear_logprob_triton` computed for two models at once, the
student's ``h @ w.T`` and the teacher's ``h_t @ w_t.T`` over the same vocabulary columns.

Forward (``_fwd_kernel``): a program owns ``BM`` token rows and one split of the vocabulary; per
tile of ``BN`` columns it computes both fp32 tiles (each a ``BK``-blocked dot over its own hidden
size) and folds them into running per-row statistics in base-2 units (``u = x log2(e) / T``,
``u_t = max(x_t log2(e) / T_t, f log2(e))``, non-finite teacher values -> the floor): the student's
``(m, s, w)`` as in the log-prob kernel, the teacher's ``(m_t, s_t)``, and the cross sum
``sum_j 2^(u_j - m) ((u_j - m) - (u_t,j - m_t))`` (reverse KL) or the same with the models swapped
(forward KL), moved to new maxima as ``x <- a (x + s ((m - m') - (m_t - m_t')))``. The splits are merged in
PyTorch (:func:`forward_stats`); the label logit is the log-prob module's ``_label_kernel``.

Backward (``_dz_kernel``): per ``BM x BN`` tile of one token group and one vocabulary block, both
tiles are recomputed and the student's logit gradient written in the inputs' dtype::

    reverse:  dz = p (C - B log2 p - G log2 p_t) + A 1[j = label]
    forward:  dz = p (C - B log2 p) - G p_t + A 1[j = label],     log2 p_t = (u_t - m_t) - log2 s_t

with per-token coefficients pre-scaled by ``1/T`` (and ``ln 2`` where they multiply base-2 values:
:func:`backward_grads`). Each block is contracted at once with cuBLAS into the fp32 ``d hidden``
accumulator and ``d weight`` (as in the log-prob backward). Tiles are read with pointer loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fnppo.core.kernels import triton_interpreting
from fnppo.core.kernels.linear_logprob_launch import _num_splits, grouped_backward
from fnppo.core.kernels.linear_logprob_triton import LN2, LOG2E, _label_kernel, _tile_logits

__all__ = ["forward_stats", "backward_grads"]

_FWD_BM = 128  # fixed: the forward grid (and so the number of vocabulary splits) depends on it
_INTERP = dict(BM=16, BN=32, BK=16)  # the CPU interpreter: small tiles exercise the multi-tile logic
_NO_TMA = tl.constexpr(False)


def _fwd_configs() -> list[triton.Config]:
    # Two fp32 [BM, BN] accumulators live at once: BN of 128 or 64.
    return [
        triton.Config({"BN": 128, "BK": 64}, num_warps=8, num_stages=3),
        triton.Config({"BN": 128, "BK": 64}, num_warps=8, num_stages=4),
        triton.Config({"BN": 64, "BK": 64}, num_warps=4, num_stages=4),
        triton.Config({"BN": 64, "BK": 64}, num_warps=8, num_stages=3),
    ]


def _dz_configs() -> list[triton.Config]:
    return [
        triton.Config({"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BM": 128, "BN": 64, "BK": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
        triton.Config({"BM": 64, "BN": 128, "BK": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    ]


@triton.jit
def _teacher_units(acc_t, scale2_t, floor2):
    """Teacher tile in base-2 units, raised to the floor; NaN and +-inf become the floor."""
    u = acc_t * scale2_t
    return tl.where((u >= floor2) & (u < float("inf")), u, floor2)


@triton.jit
def _fold2(acc, acc_t, m, s, w, mt, s_t, x, col_ok, scale2, scale2_t, floor2, WITH_ENT: tl.constexpr,
           REVERSE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Fold one pair of fp32 tiles into the running ``(m, s, w, m_t, s_t, x)`` (base-2 units)."""
    u = acc * scale2
    ut = _teacher_units(acc_t, scale2_t, floor2)
    if MASKED:
        u = tl.where(col_ok[None, :], u, float("-inf"))
        ut = tl.where(col_ok[None, :], ut, float("-inf"))
    m_new = tl.maximum(m, tl.max(u, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - shift)
    d = u - shift[:, None]
    e = tl.exp2(d)
    mt_new = tl.maximum(mt, tl.max(ut, 1))
    shift_t = tl.where(mt_new == float("-inf"), 0.0, mt_new)
    alpha_t = tl.exp2(mt - shift_t)
    dt = ut - shift_t[:, None]
    et = tl.exp2(dt)
    # changes of the maxima (0 while a row has seen no valid column; its sums are 0 then)
    delta = tl.where(m == float("-inf"), 0.0, m - shift)
    delta_t = tl.where(mt == float("-inf"), 0.0, mt - shift_t)
    if REVERSE:
        cross = e * (d - dt)
    else:
        cross = et * (dt - d)
    if MASKED:
        cross = tl.where(col_ok[None, :], cross, 0.0)  # e = et = 0 and d = dt = -inf there
    if REVERSE:
        x = alpha * (x + s * (delta - delta_t)) + tl.sum(cross, 1)
    else:
        x = alpha_t * (x + s_t * (delta_t - delta)) + tl.sum(cross, 1)
    if WITH_ENT:
        ed = e * d
        if MASKED:
            ed = tl.where(col_ok[None, :], ed, 0.0)
        w = alpha * (w + s * delta) + tl.sum(ed, 1)
    s = s * alpha + tl.sum(e, 1)
    s_t = s_t * alpha_t + tl.sum(et, 1)
    return m_new, s, w, mt_new, s_t, x


@triton.jit
def _fwd_kernel(h_ptr, w_ptr, ht_ptr, wt_ptr, out_ptr, n_tok, n_voc, hid, hid_t, stride_h, stride_w, stride_ht,
                stride_wt, scale2, scale2_t, floor2, cols_per_split, plane, WITH_ENT: tl.constexpr,
                REVERSE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                IEEE_T: tl.constexpr, EVEN_K: tl.constexpr, EVEN_KT: tl.constexpr):  # fmt: skip
    """Statistics of rows ``[BM pid_m, ...)`` over split ``pid_s``, into ``out[6, splits, tokens]``
    (``plane = splits * tokens``, from the host: an int argument equal to 1 would be a constant)."""
    pid_s = tl.program_id(0)
    pid_m = tl.program_id(1)
    row0 = pid_m * BM
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < n_tok
    rows_c = tl.minimum(rows, n_tok - 1)
    m = tl.full([BM], float("-inf"), tl.float32)
    mt = tl.full([BM], float("-inf"), tl.float32)
    s = tl.zeros([BM], tl.float32)
    w = tl.zeros([BM], tl.float32)
    s_t = tl.zeros([BM], tl.float32)
    x = tl.zeros([BM], tl.float32)
    v_begin = pid_s * cols_per_split
    v_end = tl.minimum(v_begin + cols_per_split, n_voc)
    n_full = (v_end - v_begin) // BN
    for i in range(0, n_full):  # whole tiles: no masks
        col0 = v_begin + i * BN
        cols = col0 + tl.arange(0, BN)
        acc = _tile_logits(
            h_ptr, w_ptr, rows_c, cols, row0, col0, hid, stride_h, stride_w, BM, BN, BK, IEEE, EVEN_K, _NO_TMA
        )
        acc_t = _tile_logits(
            ht_ptr, wt_ptr, rows_c, cols, row0, col0, hid_t, stride_ht, stride_wt, BM, BN, BK, IEEE_T, EVEN_KT, _NO_TMA
        )
        m, s, w, mt, s_t, x = _fold2(
            acc, acc_t, m, s, w, mt, s_t, x, cols < v_end, scale2, scale2_t, floor2, WITH_ENT, REVERSE, False
        )
    col0 = v_begin + n_full * BN
    if col0 < v_end:  # the split's last, partial tile
        cols = col0 + tl.arange(0, BN)
        cols_c = tl.minimum(cols, n_voc - 1)
        acc = _tile_logits(
            h_ptr, w_ptr, rows_c, cols_c, row0, col0, hid, stride_h, stride_w, BM, BN, BK, IEEE, EVEN_K, _NO_TMA
        )
        acc_t = _tile_logits(
            ht_ptr, wt_ptr, rows_c, cols_c, row0, col0, hid_t, stride_ht, stride_wt, BM, BN, BK, IEEE_T, EVEN_KT,
            _NO_TMA,
        )  # fmt: skip
        m, s, w, mt, s_t, x = _fold2(
            acc, acc_t, m, s, w, mt, s_t, x, cols < v_end, scale2, scale2_t, floor2, WITH_ENT, REVERSE, True
        )
    out = out_ptr + pid_s.to(tl.int64) * n_tok + rows
    tl.store(out, m, mask=row_ok)
    tl.store(out + plane, s, mask=row_ok)
    tl.store(out + 2 * plane, w, mask=row_ok)
    tl.store(out + 3 * plane, mt, mask=row_ok)
    tl.store(out + 4 * plane, s_t, mask=row_ok)
    tl.store(out + 5 * plane, x, mask=row_ok)


@triton.jit
def _dz_kernel(h_ptr, w_ptr, ht_ptr, wt_ptr, labels_ptr, a_ptr, b_ptr, c_ptr, g_ptr, lse2_ptr, mt2_ptr, lst2_ptr,
               dz_ptr,
               row_base, n_tok, col_base, n_cols, hid, hid_t, stride_h, stride_w, stride_ht, stride_wt, stride_dz,
               col_start, scale2, scale2_t, floor2, REVERSE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr, IEEE_T: tl.constexpr,
               EVEN_K: tl.constexpr, EVEN_KT: tl.constexpr):  # fmt: skip
    """The block of student logit gradients of token rows ``row_base + [0, n_tok)`` and vocabulary
    rows ``col_base + [0, n_cols)``, written to ``dz[0:n_tok, 0:n_cols]``."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_tok, BM)
    num_n = tl.cdiv(n_cols, BN)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    grow = row_base + tl.minimum(rows, n_tok - 1)
    gcol = col_base + tl.minimum(cols, n_cols - 1)
    acc = _tile_logits(h_ptr, w_ptr, grow, gcol, 0, 0, hid, stride_h, stride_w, BM, BN, BK, IEEE, EVEN_K, _NO_TMA)
    acc_t = _tile_logits(
        ht_ptr, wt_ptr, grow, gcol, 0, 0, hid_t, stride_ht, stride_wt, BM, BN, BK, IEEE_T, EVEN_KT, _NO_TMA
    )
    ut = _teacher_units(acc_t, scale2_t, floor2)
    logp2 = acc * scale2 - tl.load(lse2_ptr + grow)[:, None]  # log2 p
    p = tl.exp2(logp2)
    c = tl.load(c_ptr + grow)[:, None]
    b = tl.load(b_ptr + grow)[:, None]
    g = tl.load(g_ptr + grow)[:, None]
    logpt2 = (ut - tl.load(mt2_ptr + grow)[:, None]) - tl.load(lst2_ptr + grow)[:, None]  # log2 p_t
    if REVERSE:
        dz = p * (c - b * logp2 - g * logpt2)
    else:
        dz = p * (c - b * logp2) - g * tl.exp2(logpt2)
    lab = tl.load(labels_ptr + grow).to(tl.int32) - col_start  # a block holds < 2^31 columns
    a = tl.load(a_ptr + grow)
    dz = tl.where(cols[None, :] == lab[:, None], dz + a[:, None], dz)
    ptrs = dz_ptr + rows.to(tl.int64)[:, None] * stride_dz + cols[None, :]
    tl.store(ptrs, dz.to(dz_ptr.dtype.element_ty), mask=(rows < n_tok)[:, None] & (cols < n_cols)[None, :])


def _even(args: dict) -> dict:
    return {"EVEN_K": args["hid"] % args["BK"] == 0, "EVEN_KT": args["hid_t"] % args["BK"] == 0}


if triton_interpreting():
    _fwd_tuned = None
    _dz_tuned = None
else:
    _fwd_tuned = triton.autotune(configs=_fwd_configs(), key=["hid", "hid_t", "WITH_ENT", "REVERSE", "IEEE", "IEEE_T"])(
        triton.heuristics({"EVEN_K": lambda a: _even(a)["EVEN_K"], "EVEN_KT": lambda a: _even(a)["EVEN_KT"]})(
            _fwd_kernel
        )
    )
    _dz_tuned = triton.autotune(configs=_dz_configs(), key=["hid", "hid_t", "REVERSE", "IEEE", "IEEE_T"])(
        triton.heuristics({"EVEN_K": lambda a: _even(a)["EVEN_K"], "EVEN_KT": lambda a: _even(a)["EVEN_KT"]})(
            _dz_kernel
        )
    )


# ---------------------------------------------------------------------------------------------
# Drivers
# ---------------------------------------------------------------------------------------------
def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def forward_stats(h2, w_valid, labels, ht2, wt_valid, cfg):  # noqa: ANN001, ANN201
    """This shard's ``(m_s, s_s, w_s, zl, m_t, s_t, x)`` in natural units (see ``linear_distill._combine``)."""
    n, hid = h2.shape
    n_voc, hid_t = w_valid.shape[0], ht2.shape[1]
    f32 = dict(dtype=torch.float32, device=h2.device)
    if n == 0 or n_voc == 0:
        zeros = torch.zeros(n, **f32)
        neg = torch.full((n,), float("-inf"), **f32)
        return (
            neg,
            zeros,
            (zeros.clone() if cfg.with_entropy else None),
            zeros.clone(),
            neg.clone(),
            *(zeros.clone() for _ in range(2)),
        )
    w_valid, wt_valid = _contiguous_rows(w_valid), _contiguous_rows(wt_valid)
    interp = _fwd_tuned is None
    bm = _INTERP["BM"] if interp else _FWD_BM
    splits = _num_splits(n, n_voc, h2.device, bm)
    per = -(-(-(-n_voc // splits)) // 256) * 256  # noqa: B002 - ceil divisions: columns per split, a multiple of every BN
    splits = -(-n_voc // per)
    out = torch.empty((6, splits, n), **f32)
    args = (h2, w_valid, ht2, wt_valid, out, n, n_voc, hid, hid_t, h2.stride(0), w_valid.stride(0), ht2.stride(0))
    args += (wt_valid.stride(0), cfg.inv_t * LOG2E, cfg.inv_tt * LOG2E, cfg.floor * LOG2E, per, splits * n)
    flags = dict(
        WITH_ENT=cfg.with_entropy,
        REVERSE=cfg.reverse,
        IEEE=h2.dtype == torch.float32,
        IEEE_T=ht2.dtype == torch.float32,
    )
    grid = (splits, -(-n // bm))
    if interp:
        even = dict(EVEN_K=hid % _INTERP["BK"] == 0, EVEN_KT=hid_t % _INTERP["BK"] == 0)
        _fwd_kernel[grid](*args, **flags, BM=bm, BN=_INTERP["BN"], BK=_INTERP["BK"], **even)
    else:
        _fwd_tuned[grid](*args, **flags, BM=bm)
    zl = torch.empty(n, **f32)
    br, bh = (16, 16) if interp else (16, 128)
    _label_kernel[(-(-n // br),)](
        h2,
        w_valid,
        labels,
        zl,
        n,
        n_voc,
        hid,
        h2.stride(0),
        w_valid.stride(0),
        cfg.vocab_start,
        cfg.inv_t,
        BR=br,
        BH=bh,
    )
    return _merge(out, zl, cfg.reverse, cfg.with_entropy)


def _merge(out: torch.Tensor, zl: torch.Tensor, reverse: bool, with_entropy: bool) -> tuple:
    """The splits' base-2 statistics ``out[6, splits, tokens]`` merged per token, in natural units."""
    m, s, w, mt, s_t, x = out.unbind(0)

    def rescale(mk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        big = mk.amax(dim=0)
        shift = torch.where(big == float("-inf"), torch.zeros_like(big), big)
        return big, torch.exp2(mk - shift)

    big, a = rescale(m)
    big_t, a_t = rescale(mt)
    own = m - torch.where(big == float("-inf"), torch.zeros_like(big), big)
    own_t = mt - torch.where(big_t == float("-inf"), torch.zeros_like(big_t), big_t)
    w_all = None
    if with_entropy:
        w_all = (a * (w + torch.where(s > 0, s * own, torch.zeros_like(s)))).sum(0) * LN2
    if reverse:
        x_all = (a * (x + torch.where(s > 0, s * (own - own_t), torch.zeros_like(s)))).sum(0) * LN2
    else:
        x_all = (a_t * (x + torch.where(s_t > 0, s_t * (own_t - own), torch.zeros_like(s_t)))).sum(0) * LN2
    return big * LN2, (s * a).sum(0), w_all, zl, big_t * LN2, (s_t * a_t).sum(0), x_all


def _launch_dz(ptrs, labels, coef2, block, strides, col_start, scales, reverse):  # noqa: ANN001
    """One block of logit gradients: ``dz[:n_tok, :n_cols]`` of rows ``g0 + [0, n_tok)``, columns ``c0 + [0, n_cols)``."""
    g0, n, c0, n_cols = block
    hid, hid_t = ptrs[0].shape[1], ptrs[2].shape[1]
    args = (*ptrs[:4], labels, *coef2, ptrs[4], g0, n, c0, n_cols, hid, hid_t, *strides, col_start)
    flags = dict(REVERSE=reverse, IEEE=ptrs[0].dtype == torch.float32, IEEE_T=ptrs[2].dtype == torch.float32)
    if _dz_tuned is None:
        cfg = dict(_INTERP, GROUP_M=2)
        grid = (-(-n // cfg["BM"]) * -(-n_cols // cfg["BN"]),)
        even = dict(EVEN_K=hid % cfg["BK"] == 0, EVEN_KT=hid_t % cfg["BK"] == 0)
        _dz_kernel[grid](*args, *scales, **flags, **cfg, **even)
        return
    grid = lambda meta: (triton.cdiv(n, meta["BM"]) * triton.cdiv(n_cols, meta["BN"]),)  # noqa: E731
    _dz_tuned[grid](*args, *scales, **flags)


def backward_grads(h2, w_valid, labels, teacher, coef, cfg, need_h, dw, *, group_tokens, block_vocab):  # noqa: ANN001, ANN201
    """``dh`` (or None) in ``h2``'s dtype; writes the valid rows' weight gradient into ``dw``.

    ``teacher = (ht2, wt_valid)``; ``coef = (a, B, C, G, lse_s, m_t, log s_t)`` of
    ``linear_distill._coefficients`` (natural units, before ``1/T``).
    """
    ht2, wt_valid = teacher
    n, hid = h2.shape
    n_valid = w_valid.shape[0]
    dh = torch.empty_like(h2) if need_h else None
    if n == 0:
        if dw is not None:
            dw.zero_()
        return dh
    w_valid, wt_valid = _contiguous_rows(w_valid), _contiguous_rows(wt_valid)
    a, b, c, g, lse_s, m_t, log_st = coef
    inv_t = cfg.inv_t
    if cfg.reverse:  # p (C - B ln2 log2p - G ln2 log2 p_t) / T
        coef2 = (a * inv_t, b * (LN2 * inv_t), c * inv_t, g * (LN2 * inv_t))
    else:  # p (C - B ln2 log2p) / T - (G / T) p_t
        coef2 = (a * inv_t, b * (LN2 * inv_t), c * inv_t, g * inv_t)
    coef2 = tuple(t.contiguous() for t in (*coef2, lse_s * LOG2E, m_t * LOG2E, log_st * LOG2E))
    scales = (inv_t * LOG2E, cfg.inv_tt * LOG2E, cfg.floor * LOG2E)
    dz_buf = torch.empty((min(group_tokens, n), min(block_vocab, max(n_valid, 1))), dtype=h2.dtype, device=h2.device)
    acc_buf = torch.empty((dz_buf.shape[0], hid), dtype=torch.float32, device=h2.device) if need_h else None
    ptrs = (h2, w_valid, ht2, wt_valid, dz_buf)
    strides = (h2.stride(0), w_valid.stride(0), ht2.stride(0), wt_valid.stride(0), dz_buf.stride(0))

    def launch(block: tuple[int, int, int, int]) -> None:
        _launch_dz(ptrs, labels, coef2, block, strides, cfg.vocab_start + block[2], scales, cfg.reverse)

    return grouped_backward(
        h2, w_valid, dz_buf, acc_buf, dh, dw, launch, group_tokens=group_tokens, block_vocab=block_vocab
    )
