"""Rotary position embedding (RoPE) applied in one pass: a fused kernel for packed (THD) batches.

:func:`apply_rotary` rotates each token's heads by the angles of its position,

    f = freqs[pos_t],   h = rot / 2,
    out[..., :h]    = x[..., :h] cos f[:h] - x[..., h:rot] sin f[:h],
    out[..., h:rot] = x[..., h:rot] cos f[h:] + x[..., :h] sin f[h:],
    out[..., rot:]  = x[..., rot:],

which is ``x cos f + rotate_half(x) sin f`` with ``rotate_half(x) = [-x2, x1]`` (the
non-interleaved RoPE of Megatron and Hugging Face; RoFormer, arXiv:2104.09864). Its gradient is the
inverse rotation of the upstream gradient (``dx1 = g1 cos f1 + g2 sin f2``,
``dx2 = g2 cos f2 - g1 sin f1``).

Why: Megatron's unfused THD path (used without Transformer Engine) splits the packed tokens per
sequence, reads the sequence lengths to the host (``.tolist()``: one device sync per call, i.e. per
layer, for queries and keys), concatenates slices of the angle table, and runs about eight
element-wise kernels (cos, sin, two products, a chunk-negate-concatenate, a sum and a final
concatenation). Here one kernel reads ``x`` and the angles and writes the result, forward and
backward, with no host sync: the per-token positions come from :func:`thd_positions`, a few
device ops (and memoized per ``cu_seqlens`` tensor by the Megatron adapter in
:mod:`fnppo.megatron.forward`). Angles and products are computed in fp32 and rounded once to ``x``'s dtype
(Megatron rounds ``cos``/``sin`` to ``x``'s dtype first), so half-precision results differ from
Megatron's unfused ones by rounding only.

Kernels: Triton on CUDA (:mod:`fnppo.core.kernels.rope_triton`), plain torch elsewhere (fp32 math,
the CPU path and the reference of the tests). Plain torch, no Megatron import.
"""

from __future__ import annotations

from typing import Any

import torch

from fnppo.core.errors import describe, input_error
from fnppo.core.kernels import rope_kernels, triton_available, triton_interpreting
from fnppo.core.typing import CuSeqlens, Float, Int, Tensor, typechecked

__all__ = ["apply_rotary", "thd_positions", "ROPE_IMPLS"]

_FN = "fnppo.ops.apply_rotary"
ROPE_IMPLS = ("auto", "triton", "torch")


def _use_triton(x: Tensor, impl: str) -> bool:
    if impl == "torch":
        return False
    ok = triton_available() and (x.is_cuda or triton_interpreting())
    if impl == "triton" and not ok:
        raise input_error(
            _FN, "impl", "'torch' or 'auto' here (Triton needs CUDA tensors or TRITON_INTERPRET=1)", repr(impl)
        )
    return ok and (impl == "triton" or x.is_cuda)


def _rotate_torch(x: Tensor, angles: Tensor, inverse: bool) -> Tensor:
    """The rotation in plain torch: fp32 (fp64 for fp64 inputs) math, one rounding to ``x.dtype``."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    rot = angles.shape[-1]
    half = rot // 2
    f = angles.to(work)[:, None, :]  # [T, 1, rot]
    c, s = f.cos(), f.sin()
    xr = x[..., :rot].to(work)
    x1, x2 = xr[..., :half], xr[..., half:]
    if inverse:
        o1 = x1 * c[..., :half] + x2 * s[..., half:]
        o2 = x2 * c[..., half:] - x1 * s[..., :half]
    else:
        o1 = x1 * c[..., :half] - x2 * s[..., :half]
        o2 = x2 * c[..., half:] + x1 * s[..., half:]
    out = torch.cat([o1, o2], dim=-1).to(x.dtype)
    if rot < x.shape[-1]:
        out = torch.cat([out, x[..., rot:]], dim=-1)
    return out


def _rotate(x: Tensor, freqs: Tensor, positions: Tensor, inverse: bool, triton: bool) -> Tensor:
    if triton:
        return rope_kernels().rotate(x, freqs, positions, inverse)
    return _rotate_torch(x, freqs[positions.long()], inverse)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, freqs: Tensor, positions: Tensor, triton: bool) -> Tensor:  # noqa: ANN401
        ctx.save_for_backward(freqs, positions)
        ctx.triton = triton
        return _rotate(x, freqs, positions, inverse=False, triton=triton)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # noqa: ANN401
        freqs, positions = ctx.saved_tensors
        return _rotate(grad, freqs, positions, inverse=True, triton=ctx.triton), None, None, None


@typechecked
def apply_rotary(
    x: Float[Tensor, "tokens heads dim"],
    freqs: Float[Tensor, "table rot"],
    positions: Int[Tensor, "tokens"],  # noqa: F821
    *,
    impl: str = "auto",
) -> Float[Tensor, "tokens heads dim"]:
    """RoPE: rotate every head of token ``t`` by the angles ``freqs[positions[t]]`` (module docstring).

    ``x`` ``[tokens, heads, dim]`` (any strides with a contiguous last dimension), ``freqs``
    ``[table, rot]`` fp32 angles (``rot`` even, ``<= dim``; Megatron's table holds
    ``cat(theta, theta)`` per position), ``positions`` ``[tokens]`` integer indices into the table
    (not checked against its length: they come from :func:`thd_positions` or ``arange``).
    ``impl``: ``"triton"`` (CUDA, or Triton's interpreter), ``"torch"``, or ``"auto"`` (Triton on
    CUDA when installed). Returns a new tensor of ``x``'s dtype; differentiable in ``x``.
    Reference: RoFormer, arXiv:2104.09864.
    """
    if impl not in ROPE_IMPLS:
        raise input_error(_FN, "impl", f"one of {ROPE_IMPLS}", repr(impl))
    rot = freqs.shape[-1]
    if rot % 2 or rot > x.shape[-1] or rot == 0:
        raise input_error(
            _FN, "freqs", f"an even number of angles per position, at most dim={x.shape[-1]}", describe(freqs)
        )
    return _Rotary.apply(x, freqs, positions, _use_triton(x, impl))


@typechecked
def thd_positions(cu_seqlens: CuSeqlens, total: int) -> Int[Tensor, "{total}"]:  # noqa: F821
    """Position of each packed token within its own sequence: ``pos_t = t - cu[seg(t)]``.

    ``seg(t)`` is the sequence holding token ``t`` (``cu[seg] <= t < cu[seg + 1]``; empty
    sequences are skipped). Device ops only, no host sync; ``cu_seqlens`` is trusted (it is
    validated where packed micro-batches are built). int64 on ``cu_seqlens``' device.
    """
    t = torch.arange(total, device=cu_seqlens.device, dtype=torch.int64)
    cu = cu_seqlens.to(torch.int64)
    seg = torch.searchsorted(cu[1:].contiguous(), t, right=True)
    return t - cu[seg.clamp_max(cu.numel() - 1)]
