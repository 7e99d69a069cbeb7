"""Triton kernels for :func:`fnppo.logprob_and_entropy`: per-token softmax statistics and the
logits gradient, each in one pass over the vocabulary.

One program handles one token row of the ``[tokens, vocab_shard]`` logits and walks the shard in
blocks of ``BLOCK`` columns with an online (running-max) softmax, accumulating in fp32:

* forward (one read of the logits), per row, with ``z = x / T`` and ``m`` the row's running max::

      m = max_j z_j,   s = sum_j exp(z_j - m),   w = sum_j exp(z_j - m) (z_j - m),   zl = z[label]

  ``zl`` is 0 when the label is not in this shard. ``w`` is only accumulated with ``WITH_ENT``.
  When a block raises the max from ``m`` to ``m'``, the sums are rescaled exactly:
  ``s <- s a``, ``w <- a (w + s (m - m'))`` with ``a = exp(m - m')``.
* backward (one read, one write), per row, from the saved ``lse = log sum_j exp z_j`` and ``H``::

      log p_j = z_j - lse
      dz_j = g_lp (1[j = label] - p_j) - g_H p_j (log p_j + H)
      dx_j = dz_j / T           (stored in the logits' dtype)

Entries equal to ``-inf`` (masked vocabulary) have ``p_j = 0`` and contribute nothing (``0 log 0``
is taken as 0). A padded vocabulary (``make_vocab_size_divisible_by``) is a tail of each row that
is not part of the distribution: the forward reads only the first ``n_cols`` (real) columns of the
row, and the backward reads those and writes 0 to the remaining ``n_store - n_cols`` columns. Row
offsets are 64-bit (a 16k x 152k tensor has more than 2^31 elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fnppo.core.kernels import triton_interpreting

__all__ = ["forward_stats", "backward_grad"]


def _bwd_configs() -> list[triton.Config]:
    # Few configs: each is compiled and timed once per vocabulary size (autotuning at first call).
    return [
        triton.Config({"BLOCK": 4096}, num_warps=8),
        triton.Config({"BLOCK": 8192}, num_warps=8),
        triton.Config({"BLOCK": 8192}, num_warps=16),
    ]


def _fwd_configs() -> list[triton.Config]:
    # LANE_ACC keeps per-lane partial sums (one block reduction per step, for the max, instead of three).
    return [
        triton.Config({"BLOCK": block, "LANE_ACC": lane}, num_warps=warps)
        for block, warps in ((4096, 8), (8192, 8), (8192, 16))
        for lane in (False, True)
    ]


_INTERP_BLOCK = 64  # the interpreter runs on CPU: small blocks exercise the multi-block logic
_INTERP_LANE_ACC = False  # the interpreter's variant of the forward accumulation (a check sets it to test the other)


@triton.jit
def _fwd_kernel(
    x_ptr,
    stride_x,
    labels_ptr,
    m_ptr,
    s_ptr,
    w_ptr,
    zl_ptr,
    n_cols,
    vocab_start,
    inv_t,
    WITH_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
    LANE_ACC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    if LANE_ACC:
        s = tl.zeros([BLOCK], tl.float32)
        w = tl.zeros([BLOCK], tl.float32)
    else:
        s = tl.zeros([], tl.float32)
        w = tl.zeros([], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        z = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        # A row that is -inf so far keeps the shift at 0 (avoids -inf - -inf); while m is -inf the
        # sums are 0, so the correction term s (m - m') is taken as 0 then.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        delta = tl.where(m == float("-inf"), 0.0, m - shift)
        a = tl.exp(m - shift)
        d = z - shift
        e = tl.exp(d)
        ed = tl.where(e > 0, e * d, 0.0)  # 0 log 0 = 0 for -inf entries and padding lanes
        if LANE_ACC:
            if WITH_ENT:
                w = a * (w + s * delta) + ed
            s = s * a + e
        else:
            if WITH_ENT:
                w = a * (w + s * delta) + tl.sum(ed, 0)
            s = s * a + tl.sum(e, 0)
        m = m_new
    if LANE_ACC:
        s_row = tl.sum(s, 0)
        w_row = tl.sum(w, 0)
    else:
        s_row = s
        w_row = w
    lab = tl.load(labels_ptr + row).to(tl.int64) - vocab_start
    inside = (lab >= 0) & (lab < n_cols)
    safe = tl.where(inside, lab, 0)
    zl = tl.load(base + safe, mask=inside, other=0.0).to(tl.float32) * inv_t
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s_row)
    tl.store(zl_ptr + row, tl.where(inside, zl, 0.0))
    if WITH_ENT:
        tl.store(w_ptr + row, w_row)


@triton.jit
def _bwd_kernel(
    x_ptr,
    stride_x,
    g_ptr,
    stride_g,
    labels_ptr,
    lse_ptr,
    h_ptr,
    glp_ptr,
    gh_ptr,
    n_cols,
    n_store,
    vocab_start,
    inv_t,
    HAS_GLP: tl.constexpr,
    HAS_GH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    xbase = x_ptr + row * stride_x
    gbase = g_ptr + row * stride_g
    offs = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    lab = tl.load(labels_ptr + row).to(tl.int64) - vocab_start
    if HAS_GLP:
        a = tl.load(glp_ptr + row)
    else:
        a = tl.zeros([], tl.float32)
    if HAS_GH:
        b = tl.load(gh_ptr + row)
        h = tl.load(h_ptr + row)
    else:
        b = tl.zeros([], tl.float32)
        h = tl.zeros([], tl.float32)
    # dz = p (c - b log p) + a 1[j = label], with c = -a - b H.
    c = -a - b * h
    for start in range(0, n_store, BLOCK):
        cols = start + offs
        valid = cols < n_cols  # real vocabulary; [n_cols, n_store) is padding: gradient 0
        z = tl.load(xbase + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
        logp = z - lse
        p = tl.exp(logp)
        if HAS_GH:
            dz = tl.where(p > 0, p * (c - b * logp), 0.0)
        else:
            dz = p * c
        dz = tl.where(cols == lab, dz + a, dz)
        dz = tl.where(valid, dz, 0.0)
        tl.store(gbase + cols, (dz * inv_t).to(g_ptr.dtype.element_ty), mask=cols < n_store)


if triton_interpreting():
    _fwd_tuned = None
    _bwd_tuned = None
else:
    _fwd_tuned = triton.autotune(configs=_fwd_configs(), key=["n_cols", "WITH_ENT"])(_fwd_kernel)
    _bwd_tuned = triton.autotune(configs=_bwd_configs(), key=["n_cols", "n_store", "HAS_GLP", "HAS_GH"])(_bwd_kernel)


def _rows(x2: torch.Tensor) -> torch.Tensor:
    # The kernels index columns with unit stride; rows may have any stride.
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def forward_stats(
    x2: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    inv_t: float,
    with_entropy: bool,
    n_valid: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-row ``(m, s, w, zl)`` of this shard's first ``n_valid`` columns (default: all; see the
    module docstring); ``w`` is None without entropy."""
    x2 = _rows(x2)
    n = x2.shape[0]
    v = x2.shape[1] if n_valid is None else n_valid
    f32 = dict(dtype=torch.float32, device=x2.device)
    m = torch.empty(n, **f32)
    s = torch.empty(n, **f32)
    zl = torch.empty(n, **f32)
    w = torch.empty(n, **f32) if with_entropy else s  # placeholder pointer, never written
    if n == 0:
        return m, s, (w if with_entropy else None), zl
    args = (x2, x2.stride(0), labels, m, s, w, zl, v, vocab_start, inv_t)
    if _fwd_tuned is None:
        _fwd_kernel[(n,)](*args, WITH_ENT=with_entropy, BLOCK=_INTERP_BLOCK, LANE_ACC=_INTERP_LANE_ACC)
    else:
        _fwd_tuned[(n,)](*args, WITH_ENT=with_entropy)
    return m, s, (w if with_entropy else None), zl


def backward_grad(
    x2: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    g_lp: torch.Tensor | None,
    g_h: torch.Tensor | None,
    vocab_start: int,
    inv_t: float,
    n_valid: int | None = None,
) -> torch.Tensor:
    """The gradient of the logits ``[rows, shard]`` in their dtype, written once (0 in columns
    ``>= n_valid``, the vocabulary padding)."""
    x2 = _rows(x2)
    n, v = x2.shape
    n_valid = v if n_valid is None else n_valid
    grad = torch.empty((n, v), dtype=x2.dtype, device=x2.device)
    if n == 0 or v == 0:
        return grad
    has_glp, has_gh = g_lp is not None, g_h is not None
    dummy = lse
    args = (
        x2,
        x2.stride(0),
        grad,
        grad.stride(0),
        labels,
        lse,
        entropy if has_gh else dummy,
        g_lp if has_glp else dummy,
        g_h if has_gh else dummy,
        n_valid,
        v,
        vocab_start,
        inv_t,
    )
    if _bwd_tuned is None:
        _bwd_kernel[(n,)](*args, HAS_GLP=has_glp, HAS_GH=has_gh, BLOCK=_INTERP_BLOCK)
    else:
        _bwd_tuned[(n,)](*args, HAS_GLP=has_glp, HAS_GH=has_gh)
    return grad
