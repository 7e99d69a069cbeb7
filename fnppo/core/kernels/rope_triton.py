"""Triton kernel for :func:`fnppo.ops.apply_rotary`: one pass over ``x`` per direction.

A program owns one token and ``BH`` of its heads: it loads the token's angle row
``freqs[pos]`` once (fp32), takes cos/sin, rotates the two halves of the rotary dimensions of each
head in fp32 and stores them in ``x``'s dtype; dimensions past ``rot`` are copied. ``INVERSE``
applies the transposed rotation (the backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rotate"]


@triton.jit
def _rope_kernel(
    x_ptr,
    out_ptr,
    pos_ptr,
    f_ptr,
    heads,
    dim,
    sx_t,
    sx_h,
    so_t,
    so_h,
    sf,
    HALF: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    BP: tl.constexpr,
    PASS: tl.constexpr,
    INVERSE: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BD)
    dm = d < HALF
    f1 = tl.load(f_ptr + pos * sf + d, mask=dm, other=0.0).to(tl.float32)
    f2 = tl.load(f_ptr + pos * sf + HALF + d, mask=dm, other=0.0).to(tl.float32)
    c1 = tl.cos(f1)
    s1 = tl.sin(f1)
    c2 = tl.cos(f2)
    s2 = tl.sin(f2)
    h = hb * BH + tl.arange(0, BH)
    m = (h < heads)[:, None] & dm[None, :]
    xb = x_ptr + t.to(tl.int64) * sx_t + h.to(tl.int64)[:, None] * sx_h + d[None, :]
    ob = out_ptr + t.to(tl.int64) * so_t + h.to(tl.int64)[:, None] * so_h + d[None, :]
    x1 = tl.load(xb, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF, mask=m, other=0.0).to(tl.float32)
    if INVERSE:
        o1 = x1 * c1[None, :] + x2 * s2[None, :]
        o2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:
        o1 = x1 * c1[None, :] - x2 * s1[None, :]
        o2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(ob, o1.to(out_ptr.dtype.element_ty), mask=m)
    tl.store(ob + HALF, o2.to(out_ptr.dtype.element_ty), mask=m)
    if PASS:  # dimensions [2 * HALF, dim) are not rotated
        p = 2 * HALF + tl.arange(0, BP)
        pm = (h < heads)[:, None] & (p < dim)[None, :]
        xp = x_ptr + t.to(tl.int64) * sx_t + h.to(tl.int64)[:, None] * sx_h + p[None, :]
        op = out_ptr + t.to(tl.int64) * so_t + h.to(tl.int64)[:, None] * so_h + p[None, :]
        tl.store(op, tl.load(xp, mask=pm, other=0.0), mask=pm)


def rotate(x: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
    """``x`` ``[T, H, D]`` rotated by ``freqs[positions]`` (``inverse``: the transposed rotation)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    freqs = freqs if freqs.stride(-1) == 1 else freqs.contiguous()
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens == 0 or heads == 0:
        return out
    half = freqs.shape[-1] // 2
    bd = triton.next_power_of_2(half)
    bh = max(1, min(triton.next_power_of_2(heads), max(1, 4096 // (2 * bd))))
    rest = dim - 2 * half
    grid = (tokens, triton.cdiv(heads, bh))
    _rope_kernel[grid](
        x,
        out,
        positions,
        freqs,
        heads,
        dim,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        freqs.stride(0),
        HALF=half,
        BH=bh,
        BD=bd,
        BP=triton.next_power_of_2(max(rest, 1)),
        PASS=rest > 0,
        INVERSE=inverse,
    )
    return out
