"""The input checks and group bookkeeping shared by the advantage estimators (pure torch).

Argument checks in the standard error format (:mod:`fnppo.core.errors`), the grouping of
per-sequence scores (``[n]`` with group ids, or ``[n_groups, group_size]``) into a group index, and
per-group statistics over the valid rows, gathered back to the rows.
"""

from __future__ import annotations

import math

import torch

from fnppo.core.errors import check_finite, check_mask01, describe, input_error
from fnppo.core.segments import Segments
from fnppo.core.typing import Float, Shaped, Tensor

__all__ = [
    "SeqScores",
    "SeqMask",
    "check_unit",
    "check_eps",
    "check_token_inputs",
    "group_index",
    "group_stats",
    "valid_rows",
    "seq_inputs",
    "masked_group_stats",
]

SeqScores = Float[Tensor, "n"] | Float[Tensor, "groups group_size"]
"""One score per sequence: ``[n]`` (groups by ``group_ids``) or ``[n_groups, group_size]``."""
SeqMask = Shaped[Tensor, "n"] | Shaped[Tensor, "groups group_size"]
"""A per-sequence 0/1 mask (or lengths) of the shape of the scores."""


def check_unit(fn: str, arg: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value <= 1.0):
        raise input_error(fn, arg, "a number in [0, 1]", repr(value))


def check_eps(fn: str, eps: float) -> None:
    if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise input_error(fn, "eps", "a finite number >= 0", repr(eps))


def check_token_inputs(fn: str, mask: Tensor, **tensors: Tensor | None) -> None:
    check_mask01(fn, "mask", mask)
    for name, t in tensors.items():
        check_finite(fn, name, t, where=mask)


def group_index(fn: str, scores: Tensor, group_ids: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """Flattened scores, a group index in [0, G) per score, and G."""
    if group_ids is None:
        if scores.ndim != 2:
            raise input_error(
                fn, "group_ids", "a tensor [n] when scores is 1-D (or scores [n_groups, group_size])", "None"
            )
        g, s = scores.shape
        index = torch.arange(g, device=scores.device).repeat_interleave(s)
        return scores.reshape(-1), index, g
    if scores.ndim != 1:
        raise input_error(fn, "group_ids", "None when scores is [n_groups, group_size]", "a tensor")
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return scores, inverse.reshape(-1), unique.numel()


def group_stats(x: Tensor, index: Tensor, g: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-score group size, group sum and group sum of squared deviations (gathered)."""
    seg = Segments(index, g)
    count = seg.sum(torch.ones_like(x))
    total = seg.sum(x)
    mean = total / torch.where(count > 0, count, torch.ones_like(count))
    dev = x - seg.gather(mean, x)
    sq = seg.sum(dev * dev)
    return seg.gather(count, x), seg.gather(total, x), seg.gather(sq, x)


def valid_rows(fn: str, valid: Tensor | None, scores: Tensor) -> Tensor:
    """Flattened bool ``[numel]`` of the rows that count (all of them when ``valid is None``)."""
    if valid is None:
        return torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
    if valid.shape != scores.shape:
        raise input_error(fn, "valid", f"a 0/1 mask of the shape of scores {tuple(scores.shape)}", describe(valid))
    check_mask01(fn, "valid", valid)
    return (valid != 0).reshape(-1).to(scores.device)


def seq_inputs(
    fn: str, scores: Tensor, group_ids: Tensor | None, valid: Tensor | None
) -> tuple[Tensor, Tensor, int, Tensor]:
    """Validated ``(x, index, G, keep)``: flat scores in the compute dtype, group index, count, valid rows."""
    keep = valid_rows(fn, valid, scores)
    check_finite(fn, "scores", scores, where=None if valid is None else valid)
    x, index, g = group_index(fn, scores.detach(), group_ids)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    x = torch.where(keep, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))
    return x, index.to(x.device), g, keep


def masked_group_stats(x: Tensor, index: Tensor, g: int, keep: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row (gathered) valid count, mean and sum of squared deviations of its group over the
    valid rows, and whether the group's valid values are not all equal (max > min, exact)."""
    kf = keep.to(x.dtype)
    count = torch.zeros(g, dtype=x.dtype, device=x.device).index_add(0, index, kf)
    total = torch.zeros(g, dtype=x.dtype, device=x.device).index_add(0, index, x * kf)
    mean = total / torch.clamp(count, min=1)
    dev = (x - mean[index]) * kf
    sq = torch.zeros(g, dtype=x.dtype, device=x.device).index_add(0, index, dev * dev)
    inf = torch.full((g,), math.inf, dtype=x.dtype, device=x.device)
    hi = (-inf).scatter_reduce(0, index, torch.where(keep, x, -math.inf), "amax")
    lo = inf.scatter_reduce(0, index, torch.where(keep, x, math.inf), "amin")
    return count[index], mean[index], sq[index], (hi > lo)[index]
