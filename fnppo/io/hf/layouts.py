"""Megatron <-> Hugging Face tensor layouts, one parameter at a time: :func:`read_shard` builds this
tensor-parallel rank's shard of a Megatron parameter from the Hugging Face tensors (reading only the
rows/columns the rank holds), :func:`to_hf` splits a full (1-rank) Megatron tensor back into them.
The kinds (from :func:`fnppo.io.hf.keys.param_rule`): ``copy`` (same layout), ``vocab`` (rows of the
padded vocabulary; padding rows are zero), ``gated`` (fused ``[gate; up]``), ``qkv`` (fused per group).

Megatron's fused QKV stacks, for every group ``g`` in order, the
``h * d`` query rows of the group's heads, then its ``d`` key rows and ``d`` value rows:
``qkv = concat_g [q[g*h*d : (g+1)*h*d]; k[g*d : (g+1)*d]; v[g*d : (g+1)*d]]``. Query head ``j``
belongs to group ``j // h``, as Hugging Face's ``repeat_kv`` (arXiv:2305.13245). The fused MLP input
projection is ``[gate; up]`` (SwiGLU, arXiv:2002.05202); under tensor parallelism each rank holds
``[gate_r; up_r]``. Column-parallel weights (QKV, fc1, embedding, output layer) are split on their
output rows, row-parallel ones (``o_proj``, ``down_proj``) on their input columns (Megatron-LM,
arXiv:1909.08053); a QKV shard is a contiguous range of whole groups.
"""

from __future__ import annotations

from typing import Any

import torch

from fnppo.core.typing import Tensor
from fnppo.io.hf.arch import Arch


def split_dim(param: Tensor, tp: int) -> tuple[int | None, int]:
    """(partition dim or None, tp) for a parameter."""
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim), tp
    return None, 1


def _take(read: Any, name: str, dim: int | None, lo: int, hi: int, ndim: int) -> Tensor:
    if dim is None:
        return read(name, None)
    idx = [slice(None)] * ndim
    idx[dim] = slice(lo, hi)
    return read(name, tuple(idx))


def read_shard(
    read: Any, a: Arch, kind: str, names: tuple[str, ...], param: Tensor, tp: int, tp_rank: int, vocab: int
) -> Tensor:
    """This rank's shard of one Megatron parameter, reading only the needed HF slices."""
    dim, n = split_dim(param, tp)
    r = tp_rank if n > 1 else 0
    if kind == "zero":
        return torch.zeros_like(param, device="cpu")
    if kind == "copy":
        if dim is None:
            return read(names[0], None)
        size = param.shape[dim]
        return _take(read, names[0], dim, r * size, (r + 1) * size, param.dim())
    if kind == "vocab":  # rows [r*s, (r+1)*s) of the padded vocabulary; padding rows are zero
        size = param.shape[0]
        lo, hi = r * size, (r + 1) * size
        part = read(names[0], (slice(lo, min(hi, vocab)), slice(None))) if lo < vocab else param.new_zeros(0, a.hidden)
        if part.shape[0] < size:
            part = torch.cat([part, part.new_zeros(size - part.shape[0], a.hidden)], 0)
        return part
    if kind == "gated":
        size = param.shape[0] // 2
        lo, hi = (r * size, (r + 1) * size) if dim is not None else (0, size)
        return torch.cat([_take(read, nm, 0, lo, hi, param.dim()) for nm in names], 0)
    if kind == "qkv":
        d, per = a.head_dim, a.heads // a.groups
        local_groups = a.groups // n
        g0 = r * local_groups
        q = _take(read, names[0], 0, g0 * per * d, (g0 + local_groups) * per * d, param.dim())
        k = _take(read, names[1], 0, g0 * d, (g0 + local_groups) * d, param.dim())
        v = _take(read, names[2], 0, g0 * d, (g0 + local_groups) * d, param.dim())
        rest = tuple(q.shape[1:])
        fused = torch.cat(
            [
                q.reshape(local_groups, per * d, *rest),
                k.reshape(local_groups, d, *rest),
                v.reshape(local_groups, d, *rest),
            ],
            1,
        )
        return fused.reshape(local_groups * (per + 2) * d, *rest)
    raise AssertionError(kind)


def to_hf(a: Arch, kind: str, names: tuple[str, ...], full: Tensor, vocab: int) -> dict[str, Tensor]:
    """HF tensors of one full Megatron tensor (the inverse of :func:`read_shard` with tp=1)."""
    if kind == "copy":
        return {names[0]: full}
    if kind == "vocab":
        return {names[0]: full[:vocab]}
    if kind == "gated":
        gate, up = full.chunk(2, dim=0)
        return {names[0]: gate, names[1]: up}
    d, per = a.head_dim, a.heads // a.groups
    rest = tuple(full.shape[1:])
    grouped = full.reshape(a.groups, per + 2, d, *rest)
    return {
        names[0]: grouped[:, :per].reshape(a.heads * d, *rest),
        names[1]: grouped[:, per].reshape(a.groups * d, *rest),
        names[2]: grouped[:, per + 1].reshape(a.groups * d, *rest),
    }
