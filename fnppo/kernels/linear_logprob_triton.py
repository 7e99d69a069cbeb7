"""Triton kernels for :func:`fnppo.linear_logprob_and_entropy`: blocked ``hidden @ weight.T`` tiles
with softmax statistics in the epilogue, so that no ``[tokens, vocab]`` tensor is ever stored.

Forward (``_fwd_kernel``): a program owns ``BM`` token rows and one contiguous split of the
vocabulary rows of ``weight``; it walks its split in tiles of ``BN`` columns, computes each fp32
tile ``x = h[rows] @ w[cols].T`` (a ``BK``-blocked dot over the hidden size) and folds it into
running per-row statistics, in base-2 units ``u = x log2(e) / T``::

    m = max_j u_j,   s = sum_j 2^(u_j - m),   w = sum_j 2^(u_j - m) (u_j - m),   zl = u[label]

rescaled exactly when a tile raises the max: ``s <- s a``, ``w <- a (w + s (m - m'))``,
``a = 2^(m - m')``. The splits (several per row block, so that the grid fills the GPU) are merged
in PyTorch and converted to natural units (times ln 2). The split index varies fastest in the
grid: programs running at the same time share their ``BM`` rows of ``hidden`` (kept in L2) and
read a handful of vocabulary regions.

Backward (``_dz_kernel``): for one group of tokens and one block of vocabulary rows, the program
of each ``BM x BN`` tile recomputes the logits tile and writes the logit gradient in the inputs'
dtype, from the saved ``lse`` and per-token coefficients::

    log p = x / T - lse,   dz = ( p (c - b log p) + a 1[j = label] ) / T,   c = -a - b H

with ``a = dL/dlogprob``, ``b = dL/dentropy``. :func:`backward_grads` contracts each block at once
with cuBLAS: ``dh_group += dz @ w_block`` (fp32 accumulator) and ``dw_block (+)= dz.T @ h_group``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from fnppo.kernels import triton_interpreting

__all__ = ["forward_stats", "backward_grads"]

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
        triton.Config({"BN": 256, "BK": 64}, num_warps=8, num_stages=3),
        triton.Config({"BN": 256, "BK": 64}, num_warps=8, num_stages=4),
        triton.Config({"BN": 128, "BK": 64}, num_warps=8, num_stages=3),
        triton.Config({"BN": 128, "BK": 64}, num_warps=8, num_stages=4),
    ]


def _dz_configs() -> list[triton.Config]:
    return [
        triton.Config({"BM": 128, "BN": 256, "BK": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BM": 128, "BN": 256, "BK": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BM": 256, "BN": 128, "BK": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8}, num_warps=4, num_stages=3),
    ]


@triton.jit
def _tile_logits(
    h_ptr, w_ptr, rows, cols, hid, stride_h, stride_w,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
):
    """fp32 ``h[rows] @ w[cols].T``; ``rows`` and ``cols`` are already clamped to valid indices.

    ``IEEE``: fp32 inputs are multiplied in full fp32 (not TF32), as ``torch.mm`` does by default.
    """
    ks = tl.arange(0, BK)
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_h + ks[None, :]
    b_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
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
def _fwd_kernel(
    h_ptr, w_ptr, labels_ptr, m_ptr, s_ptr, went_ptr, zl_ptr,
    n_tok, n_voc, hid, stride_h, stride_w, vocab_start, scale2, cols_per_split,
    WITH_ENT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < n_tok
    rows_c = tl.minimum(rows, n_tok - 1)  # clamped: loads stay in bounds without masks
    lab = tl.load(labels_ptr + rows_c).to(tl.int64) - vocab_start
    m = tl.full([BM], float("-inf"), tl.float32)
    s = tl.zeros([BM], tl.float32)
    w = tl.zeros([BM], tl.float32)
    zl = tl.zeros([BM], tl.float32)
    v_begin = pid_s * cols_per_split
    v_end = tl.minimum(v_begin + cols_per_split, n_voc)
    for i in range(0, cols_per_split, BN):  # a fixed trip count; columns past v_end are masked
        cols = v_begin + i + tl.arange(0, BN)
        col_ok = cols < v_end
        acc = _tile_logits(h_ptr, w_ptr, rows_c, tl.minimum(cols, n_voc - 1), hid, stride_h, stride_w, BM, BN, BK, IEEE, EVEN_K)
        u = tl.where(col_ok[None, :], acc * scale2, float("-inf"))
        m_new = tl.maximum(m, tl.max(u, 1))
        # While a row has seen no valid column, m = m' = -inf: shift by 0 and take the
        # correction s (m - m') as 0 (s = w = 0 then).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        d = u - shift[:, None]
        e = tl.exp2(d)
        if WITH_ENT:
            delta = tl.where(m == float("-inf"), 0.0, m - shift)
            w = alpha * (w + s * delta) + tl.sum(tl.where(col_ok[None, :], e * d, 0.0), 1)
        s = s * alpha + tl.sum(e, 1)
        m = m_new
        zl += tl.sum(tl.where(cols[None, :].to(tl.int64) == lab[:, None], u, 0.0), 1)
    out = pid_s.to(tl.int64) * n_tok + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(zl_ptr + out, zl, mask=row_ok)
    if WITH_ENT:
        tl.store(went_ptr + out, w, mask=row_ok)


@triton.jit
def _dz_kernel(
    h_ptr, w_ptr, labels_ptr, a_ptr, b_ptr, c_ptr, lse2_ptr, dz_ptr,
    n_tok, n_cols, hid, stride_h, stride_w, stride_dz, col_start, scale2, inv_t,
    HAS_GH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    IEEE: tl.constexpr, EVEN_K: tl.constexpr,
):
    # Grouped tile order (tiles of GROUP_M row blocks share their columns in L2).
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
    rows_c = tl.minimum(rows, n_tok - 1)
    acc = _tile_logits(h_ptr, w_ptr, rows_c, tl.minimum(cols, n_cols - 1), hid, stride_h, stride_w, BM, BN, BK, IEEE, EVEN_K)
    logp2 = acc * scale2 - tl.load(lse2_ptr + rows_c)[:, None]  # log2 p
    p = tl.exp2(logp2)
    c = tl.load(c_ptr + rows_c)
    if HAS_GH:
        b = tl.load(b_ptr + rows_c) * _LN2  # b log p = (b ln 2) log2 p
        dz = p * (c[:, None] - b[:, None] * logp2)
    else:
        dz = p * c[:, None]
    lab = tl.load(labels_ptr + rows_c).to(tl.int64) - col_start
    a = tl.load(a_ptr + rows_c)
    dz = tl.where(cols[None, :].to(tl.int64) == lab[:, None], dz + a[:, None], dz) * inv_t
    ptrs = dz_ptr + rows.to(tl.int64)[:, None] * stride_dz + cols[None, :]
    tl.store(ptrs, dz.to(dz_ptr.dtype.element_ty), mask=(rows < n_tok)[:, None] & (cols < n_cols)[None, :])


def _even_k(args: dict) -> bool:
    return args["hid"] % args["BK"] == 0


if triton_interpreting():
    _fwd_tuned = None
    _dz_tuned = None
else:
    _fwd_tuned = triton.autotune(configs=_fwd_configs(), key=["hid", "WITH_ENT", "IEEE"])(
        triton.heuristics({"EVEN_K": _even_k})(_fwd_kernel)
    )
    _dz_tuned = triton.autotune(configs=_dz_configs(), key=["hid", "HAS_GH", "IEEE"])(
        triton.heuristics({"EVEN_K": _even_k})(_dz_kernel)
    )


# ---------------------------------------------------------------------------------------------
# Drivers
# ---------------------------------------------------------------------------------------------
@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(n: int, n_voc: int, device: torch.device, bm: int) -> int:
    """Vocabulary splits per row block: the grid fills whole waves of the GPU's SMs."""
    row_blocks = -(-n // bm)
    max_splits = max(1, min(64, -(-n_voc // 1024)))
    if device.type != "cuda":
        return min(3, max_splits)  # the interpreter: a few splits exercise the merge
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    best, best_eff = 1, 0.0
    for k in range(1, max_splits + 1):
        programs = row_blocks * k
        eff = programs / (math.ceil(programs / sms) * sms)
        if eff > best_eff + 1e-9:
            best, best_eff = k, eff
    return best


def forward_stats(
    h2: torch.Tensor, w_valid: torch.Tensor, labels: torch.Tensor, vocab_start: int, inv_t: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-token ``(m, s, w, zl)`` of this shard in natural units; ``w`` is None without entropy."""
    from fnppo.linear_logprob import _merge_stats

    n, hid = h2.shape
    n_voc = w_valid.shape[0]
    f32 = dict(dtype=torch.float32, device=h2.device)
    if n == 0 or n_voc == 0:
        empty = torch.zeros(n, **f32)
        return torch.full((n,), float("-inf"), **f32), empty, (empty.clone() if with_entropy else None), empty.clone()
    w_valid = w_valid if w_valid.stride(-1) == 1 else w_valid.contiguous()
    bm = _INTERP["BM"] if _fwd_tuned is None else _FWD_BM
    splits = _num_splits(n, n_voc, h2.device, bm)
    per = -(-(-(-n_voc // splits)) // 256) * 256  # columns per split, a multiple of every BN
    splits = -(-n_voc // per)
    m, s, w, zl = (torch.empty((splits, n), **f32) for _ in range(4))
    ieee = h2.dtype == torch.float32
    args = (h2, w_valid, labels, m, s, w, zl, n, n_voc, hid, h2.stride(0), w_valid.stride(0), vocab_start, inv_t * LOG2E, per)
    if _fwd_tuned is None:
        _fwd_kernel[(splits, -(-n // bm))](
            *args, WITH_ENT=with_entropy, BM=bm, BN=_INTERP["BN"], BK=_INTERP["BK"], IEEE=ieee, EVEN_K=hid % _INTERP["BK"] == 0
        )
    else:
        _fwd_tuned[(splits, -(-n // bm))](*args, WITH_ENT=with_entropy, BM=bm, IEEE=ieee)
    m_all, s_all, w_all = _merge_stats(m * LN2, s, (w * LN2) if with_entropy else None, dim=0)
    return m_all, s_all, w_all, zl.sum(0) * LN2


@functools.cache
def _addmm_fp32_ok(device_type: str) -> bool:
    """Whether ``torch.addmm(acc_fp32, a_half, b_half, out_dtype=float32, out=acc)`` accumulates correctly here."""
    if device_type != "cuda":
        return False
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(64, 48, device="cuda", generator=g).bfloat16()
        b = torch.randn(48, 32, device="cuda", generator=g).bfloat16()
        acc = torch.randn(64, 32, device="cuda", generator=g)
        want = acc + a.float() @ b.float()
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return bool(torch.allclose(acc, want, rtol=1e-4, atol=1e-4))
    except Exception:  # noqa: BLE001 - not supported by this build: use the fallback
        return False


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with an fp32 ``acc`` and half-precision (or fp32) ``a``, ``b``."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif _addmm_fp32_ok(acc.device.type):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(torch.mm(a.float(), b.float()))


def _launch_dz(hg, wb, lab, coef, dz, col_start, inv_t, has_gh):  # noqa: ANN001
    a, b, c, lse2 = coef
    n, hid = hg.shape
    n_cols = wb.shape[0]
    ieee = hg.dtype == torch.float32
    args = (hg, wb, lab, a, b, c, lse2, dz, n, n_cols, hid, hg.stride(0), wb.stride(0), dz.stride(0), col_start, inv_t * LOG2E, inv_t)
    if _dz_tuned is None:
        grid = (-(-n // _INTERP["BM"]) * -(-n_cols // _INTERP["BN"]),)
        _dz_kernel[grid](*args, HAS_GH=has_gh, GROUP_M=2, IEEE=ieee, EVEN_K=hid % _INTERP["BK"] == 0, **_INTERP)
    else:
        _dz_tuned[lambda meta: (triton.cdiv(n, meta["BM"]) * triton.cdiv(n_cols, meta["BN"]),)](*args, HAS_GH=has_gh, IEEE=ieee)


def backward_grads(
    h2: torch.Tensor, w_valid: torch.Tensor, labels: torch.Tensor, coef: tuple[torch.Tensor, ...], has_gh: bool,
    cfg, need_h: bool, dw: torch.Tensor | None, *, group_tokens: int, block_vocab: int,  # noqa: ANN001
) -> torch.Tensor | None:
    """``dh`` (or None) in ``h2``'s dtype; writes the valid rows' weight gradient into ``dw``."""
    n, hid = h2.shape
    n_valid = w_valid.shape[0]
    dh = torch.empty_like(h2) if need_h else None
    if n == 0:
        if dw is not None:
            dw.zero_()
        return dh
    w_valid = w_valid if w_valid.stride(-1) == 1 else w_valid.contiguous()
    a, b, c, lse = coef
    coef2 = (a, b, c, lse * LOG2E)
    dz_buf = torch.empty((min(group_tokens, n), min(block_vocab, max(n_valid, 1))), dtype=h2.dtype, device=h2.device)
    acc_buf = torch.empty((min(group_tokens, n), hid), dtype=torch.float32, device=h2.device) if need_h else None
    for g0 in range(0, n, group_tokens):
        g1 = min(n, g0 + group_tokens)
        hg = h2[g0:g1]
        acc = None if acc_buf is None else acc_buf[: g1 - g0].zero_()  # one accumulator, reused per group
        for c0 in range(0, n_valid, block_vocab):
            c1 = min(n_valid, c0 + block_vocab)
            wb = w_valid[c0:c1]
            dz = dz_buf[: g1 - g0, : c1 - c0]
            _launch_dz(hg, wb, labels[g0:g1], tuple(t[g0:g1] for t in coef2), dz, cfg.vocab_start + c0, cfg.inv_t, has_gh)
            if acc is not None:
                _accumulate(acc, dz, wb)
            if dw is not None:
                if g0 == 0:
                    torch.mm(dz.t(), hg, out=dw[c0:c1])
                else:
                    dw[c0:c1].addmm_(dz.t(), hg)
        if dh is not None:
            dh[g0:g1].copy_(acc)
    return dh
