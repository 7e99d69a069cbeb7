"""Two more group estimators: GDPO (several rewards, normalized apart) and MaxRL (pure torch).

Conventions as in :mod:`fnppo.core.advantages.group`: groups are the rows of ``[n_groups,
group_size]`` scores or given by ``group_ids``; a group of fewer than two samples has no baseline
(advantage 0); results are detached.
"""

from __future__ import annotations

import torch

from fnppo.core.advantages.group import grpo_advantages
from fnppo.core.advantages.inputs import group_index, group_stats
from fnppo.core.errors import check_finite, check_float, describe, input_error
from fnppo.core.typing import Float, Integer, Tensor, typechecked

__all__ = ["gdpo_advantages", "maxrl_advantages"]


@typechecked
def gdpo_advantages(
    rewards: Float[Tensor, "n k"],
    group_ids: Integer[Tensor, " n"],
    *,
    weights: Float[Tensor, " k"] | None = None,
    eps: float = 1e-6,
) -> Float[Tensor, " n"]:
    """Group reward-Decoupled Normalization: each reward normalized within its group, then summed,
    then whitened over the batch.

    ``A_k = grpo(r_k)`` per reward column ``k`` (:func:`~fnppo.core.advantages.group.grpo_advantages`:
    ``(r_k - mean_g) / (std_g + eps)``, std with Bessel's correction, 0 for a group of one),
    ``S = sum_k w_k A_k`` (``w = 1`` by default) and ``A = (S - mean(S)) / (std(S) + eps)`` over the
    ``n`` sequences of the batch (Bessel's correction; ``std + eps == 0``: ``A = 0``). Summing first
    (GRPO on ``sum_k r_k``) maps distinct reward combinations of a group to the same advantage; this
    keeps them apart.

    Reference: GDPO, arXiv:2601.05242; verl ``AdvantageEstimator.GDPO`` (#5503), which whitens over the
    valid *tokens* (a sequence weighs by its length); here every sequence counts once (broadcast with
    :func:`~fnppo.core.advantages.broadcast_to_tokens`, then whiten per token yourself for verl's).

    Args:
        rewards: ``[n, k]`` the ``k`` rewards of each sequence.
        group_ids: ``[n]`` the group of each sequence (any integers).
        weights: ``[k]`` the weight of each reward (None: all 1).
        eps: added to every std, ``>= 0``.

    Returns:
        ``[n]`` advantages, detached.

    Raises:
        InputError: NaN/inf rewards or weights, a bad ``eps``, ``rewards`` without a reward column
            (``k = 0``: there is nothing to normalize, and the sum over no rewards would be a silent 0).
    """
    fn = "fnppo.advantages.gdpo_advantages"
    if rewards.shape[1] == 0:
        raise input_error(fn, "rewards", "[n, k] rewards with k >= 1 reward columns", describe(rewards))
    check_finite(fn, "rewards", rewards)
    check_float(fn, "eps", eps, low=0)
    r = rewards.detach()
    w = torch.ones(r.shape[1], dtype=r.dtype, device=r.device) if weights is None else weights.detach().to(r.dtype)
    check_finite(fn, "weights", w)
    per_reward = torch.stack([grpo_advantages(r[:, k], group_ids, eps=eps) for k in range(r.shape[1])], dim=1)
    s = (per_reward * w).sum(dim=1)
    if s.numel() < 2:
        return torch.zeros_like(s)
    denom = s.std(correction=1) + eps
    return torch.where(denom > 0, (s - s.mean()) / torch.where(denom > 0, denom, 1.0), torch.zeros_like(s))


@typechecked
def maxrl_advantages(
    scores: Float[Tensor, " n"] | Float[Tensor, "groups group_size"],
    group_ids: Integer[Tensor, " n"] | None = None,
    *,
    eps: float = 1e-6,
) -> Float[Tensor, " n"] | Float[Tensor, "groups group_size"]:
    """MaxRL: the group-centred score divided by the group mean, ``A_i = (s_i - mean_g) / (mean_g + eps)``.

    With 0/1 rewards ``mean_g`` is the group's pass rate ``p``: the advantage of a success is
    ``(1 - p) / p``, which weights hard prompts (small ``p``) up, the gradient of ``log p`` instead of
    ``p`` (maximum likelihood of success). A group of one gets 0 (SkyRL gives it ``s_i``, no
    baseline); a group with ``mean_g + eps == 0`` (all scores 0) gets 0.

    MaxRL's scores are success indicators (or probabilities of success), ``>= 0``: a negative score
    can bring ``mean_g`` to 0 or below, where ``1 / (mean_g + eps)`` explodes (``1e6``) or flips the
    sign of a success's advantage. Negative scores are refused (shift or rescale them into
    ``[0, 1]`` first).

    Reference: SkyRL ``compute_maxrl_advantage`` (#1126), for 0/1 rewards.

    Args:
        scores, group_ids: as in :func:`~fnppo.core.advantages.group.grpo_advantages`.
        eps: added to the mean, ``>= 0``.

    Returns:
        Advantages of the shape of ``scores``, detached.

    Raises:
        InputError: NaN/inf or negative scores, a bad ``eps``, groups given both ways or neither.
    """
    fn = "fnppo.advantages.maxrl_advantages"
    check_finite(fn, "scores", scores)
    if bool((scores < 0).any()):
        raise input_error(
            fn,
            "scores",
            "scores >= 0 (MaxRL's rewards are successes, 0/1, or probabilities of success: a negative one can "
            "make a group's mean <= 0 and flip or explode the advantages)",
            f"{describe(scores)} with min {scores.min().item()!r}",
        )
    check_float(fn, "eps", eps, low=0)
    x, index, g = group_index(fn, scores.detach(), group_ids)
    count, total, _ = group_stats(x, index, g)
    mean = total / count
    denom = mean + eps
    adv = torch.where((count > 1) & (denom != 0), (x - mean) / torch.where(denom != 0, denom, 1.0), 0.0)
    return adv.reshape(scores.shape)
