"""Metrics as exact ``(weighted_sum, weight)`` pairs: build, merge, reduce over ranks, finalize.

Every metric is a detached fp32 tensor of shape ``[2]``: ``(weighted_sum, weight)``. Pairs add
elementwise, so a metric of a whole step is the elementwise sum of the pairs of its micro-batches
and data-parallel ranks, whatever the split; only :func:`finalize_metrics` divides. Plain torch
(``torch.distributed`` for the cross-rank sum); nothing here imports Megatron.

* :func:`weighted_metric` / :func:`pair_metric` -- build a pair.
* :func:`merge_metrics` -- sum dicts of pairs (micro-batches, mini-batches).
* :func:`reduce_metrics` -- the step's reduction: micro-batches, then data-parallel ranks, then
  shared from the last pipeline stage to every stage (it takes the process groups, not a layout).
* :func:`finalize_metrics` -- pairs to floats.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fnppo.core.typing import Tensor

__all__ = ["weighted_metric", "pair_metric", "merge_metrics", "reduce_metrics", "finalize_metrics"]


def weighted_metric(values: Tensor, weights: Tensor) -> Tensor:
    """``(sum(values * weights), sum(weights))`` as a detached fp32 ``[2]`` tensor.

    Positions with weight 0 are ignored even if ``values`` is NaN/inf there.

    Args:
        values, weights: tensors of one shape (e.g. a per-token value and the loss mask).

    Returns:
        The ``[2]`` pair; :func:`finalize_metrics` turns it into the weighted mean.
    """
    v = torch.where(weights != 0, values.detach(), torch.zeros((), dtype=values.dtype, device=values.device))
    w = weights.detach().to(v.dtype)
    return torch.stack([(v * w).sum(), w.sum()]).float()


def pair_metric(num: Tensor, den: Tensor) -> Tensor:
    """``(num, den)`` as a detached fp32 ``[2]`` tensor (both 0-dim or one-element)."""
    return torch.stack([num.detach().float().reshape(()), den.detach().float().reshape(())])


def merge_metrics(metrics: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Combine metric dicts of micro-batches (or ranks) by elementwise summing.

    The result holds the union of the keys; a key missing from some dicts just contributes nothing.
    Inputs are not modified.

    Args:
        metrics: dicts of ``[2]`` pairs.

    Returns:
        ``{key: sum of the pairs}`` (detached copies).
    """
    out: dict[str, Tensor] = {}
    for d in metrics:
        for key, value in d.items():
            out[key] = value.detach().clone() if key not in out else out[key] + value.detach()
    return out


def reduce_metrics(
    per_microbatch: Sequence[Mapping[str, Tensor]],
    *,
    device: torch.device | None = None,
    dp_group: Any = None,
    pp_group: Any = None,
    is_last_stage: bool = True,
) -> dict[str, Tensor]:
    """Sum ``(weighted_sum, weight)`` metrics over micro-batches and DP ranks, then share across stages.

    On the last pipeline stage (the only one with losses) the micro-batch dicts are merged and
    all-reduced (SUM, in fp64) over the data-parallel group; the result is then sent to every
    pipeline stage, so every rank returns the same dict of CPU ``[2]`` tensors.

    Args:
        per_microbatch: this rank's metric dicts, one per micro-batch (empty on other stages).
        device: where the DP all-reduce runs (the model's device); None: where the pairs are.
        dp_group: the data-parallel process group the pairs are summed over (with context
            parallelism: data x context parallel); None or a group of one rank: no all-reduce.
        pp_group: the pipeline-parallel process group the result is shared over; None or a group of
            one rank: a single stage.
        is_last_stage: whether this rank is on the last pipeline stage (the one with losses).

    Returns:
        The merged ``dict[str, Tensor]`` (detached, on the CPU), identical on every rank.
    """
    dp, pp = _group_size(dp_group), _group_size(pp_group)
    merged: dict[str, Any] = {}
    if is_last_stage:
        merged = merge_metrics(per_microbatch) if per_microbatch else {}
        if dp > 1 and merged:
            keys = sorted(merged)
            flat = torch.stack([merged[k].to(device=device, dtype=torch.float64) for k in keys])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_group)
            merged = {k: flat[i].float() for i, k in enumerate(keys)}
        merged = {k: v.detach().cpu() for k, v in merged.items()}
    if pp > 1:
        gathered: list[Any] = [None] * pp
        dist.all_gather_object(gathered, merged, group=pp_group)
        merged = gathered[-1]
    return merged


def _group_size(group: Any) -> int:
    """Ranks in a process group (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def finalize_metrics(metrics: Mapping[str, Tensor]) -> dict[str, float]:
    """Turn ``(weighted_sum, weight)`` pairs into floats ``sum / weight`` (weight 0 -> 0.0).

    Derived entry: when ``tis_weight`` and ``tis_weight_sq`` are present, ``tis_ess`` is the
    normalized effective sample size of the importance weights,
    ``ESS / n = mean(w)^2 / mean(w^2)`` in ``(0, 1]`` (computed from the merged sums, so it is the
    exact ESS of the whole step; Kong 1992). When the value-loss means ``vf_returns``,
    ``vf_returns_sq``, ``vf_error``, ``vf_error_sq`` (of ``R``, ``R^2``, ``e = R - V``, ``e^2``
    over valid tokens, :func:`fnppo.value_loss`) are present, ``vf_explained_var`` is
    ``1 - Var(e) / Var(R)`` with ``Var(x) = mean(x^2) - mean(x)^2`` of the whole step (0.0 when the
    returns have no variance).

    Args:
        metrics: ``{key: [2] pair}``, on any device.

    Returns:
        ``{key: float}`` (one device-to-host copy for all keys).
    """
    if not metrics:
        return {}
    keys = list(metrics)
    rows = torch.stack([metrics[k].detach().float().reshape(2).cpu() for k in keys]).tolist()
    out = {k: (s / w if w != 0 else 0.0) for k, (s, w) in zip(keys, rows)}
    if "tis_weight" in out and "tis_weight_sq" in out:
        mean_w, mean_w2 = out["tis_weight"], out["tis_weight_sq"]
        out["tis_ess"] = mean_w * mean_w / mean_w2 if mean_w2 > 0 else 0.0
    if all(k in out for k in ("vf_returns", "vf_returns_sq", "vf_error", "vf_error_sq")):
        var_r = out["vf_returns_sq"] - out["vf_returns"] ** 2
        var_e = out["vf_error_sq"] - out["vf_error"] ** 2
        out["vf_explained_var"] = 1.0 - var_e / var_r if var_r > 0 else 0.0
    return out
