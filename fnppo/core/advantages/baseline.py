"""Advantages against a baseline outside the group mean: the greedy response, the optimal token baseline.

* :func:`remax_advantages` -- ReMax: the reward minus that of the greedy response to the prompt.
* :func:`optimal_token_baseline_advantages` -- the optimal token baseline (OTB), a per-position
  baseline weighted by the realized gradient energy.

Conventions of the estimators (docs/conventions.md lists where other frameworks differ):

* ``valid`` (per sequence) / ``mask`` (per token): rows that are masked out never count in a
  group statistic, a batch statistic or a count, and their advantage is exactly 0;
* a group estimator gives a group with fewer than two valid rows no baseline: advantage exactly 0
  (ReMax has no groups; pass@k refuses groups smaller than k);
* results are detached, in ``promote_types(input dtype, float32)`` (float64 stays float64).
"""

from __future__ import annotations

import torch

from fnppo.core.advantages.inputs import SeqMask, SeqScores, check_token_inputs, valid_rows
from fnppo.core.errors import check_finite, describe, input_error
from fnppo.core.typing import Float, Integer, PaddedFloat, PaddedMask, Tensor, typechecked

__all__ = ["remax_advantages", "optimal_token_baseline_advantages"]


@typechecked
def remax_advantages(
    scores: SeqScores, greedy_scores: Float[Tensor, "*greedy"], *, valid: SeqMask | None = None
) -> SeqScores:
    """ReMax: the reward minus the reward of the greedy response to the same prompt.

    ``A_i = s_i - s_greedy(prompt of i)``. The baseline does not depend on the sampled responses,
    so the gradient estimate is unbiased and needs no group: ReMax's usual setting is one sampled
    response per prompt (a "group of size 1" is the normal case and gets ``s_i - s_greedy``).
    Masked rows (``valid == 0``) get 0. Use :func:`broadcast_to_tokens` to spread the result.

    Reference: Li et al., ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models, arXiv:2310.10505.

    Args:
        scores: ``[n]``, or ``[n_groups, group_size]`` (several samples per prompt).
        greedy_scores: the greedy response's reward, of the shape of ``scores``, or ``[n_groups]``
            for 2-D ``scores`` (one greedy response per row).
        valid: optional 0/1 mask of the shape of ``scores``.

    Returns:
        Advantages of the shape of ``scores``, detached, dtype ``promote(scores.dtype, float32)``.

    Raises:
        InputError: ``greedy_scores`` of another shape, non-finite values on valid rows, a bad
            ``valid``.
    """
    fn = "fnppo.advantages.remax_advantages"
    keep = valid_rows(fn, valid, scores).reshape(scores.shape)
    if greedy_scores.shape == scores.shape:
        base = greedy_scores
    elif scores.ndim == 2 and greedy_scores.shape == scores.shape[:1]:
        base = greedy_scores[:, None].expand(scores.shape)
    else:
        allowed = f"{tuple(scores.shape)}" + (f" or ({scores.shape[0]},)" if scores.ndim == 2 else "")
        raise input_error(fn, "greedy_scores", f"a tensor of shape {allowed}", describe(greedy_scores))
    check_finite(fn, "scores", scores, where=keep)
    check_finite(fn, "greedy_scores", base, where=keep)
    dtype = torch.promote_types(torch.promote_types(scores.dtype, greedy_scores.dtype), torch.float32)
    adv = scores.detach().to(dtype) - base.detach().to(dtype)
    return torch.where(keep, adv, 0.0)


@typechecked
def optimal_token_baseline_advantages(
    rewards: PaddedFloat,
    mask: PaddedMask,
    group_ids: Integer[Tensor, "batch"],  # noqa: F821
    logprobs: PaddedFloat,
    sum_pi_squared: PaddedFloat,
    *,
    is_weights: PaddedFloat | None = None,
) -> tuple[PaddedFloat, PaddedFloat]:
    """Optimal token baseline (OTB): a per-position baseline weighted by the realized gradient energy.

    For row i, with ``t`` counting its valid (trained) tokens ``1, 2, ...`` (prompt, padding and
    tool tokens skipped, so rows of one group are aligned by response position):

    * ``G_it = sum_{t' >= t} r_it'`` (reward-to-go, ``gamma = 1``);
    * ``w_it = 1 - 2 pi_it + sum_v pi_itv^2`` -- ``|e_y - pi|^2``, the squared norm of the gradient
      of ``log pi(y)`` w.r.t. the logits (``pi_it = exp(logprobs)``, the sampled token's
      probability; ``sum_pi_squared`` is ``sum_v pi_v^2``, e.g. ``exp(logsumexp(2 z) -
      2 logsumexp(z))`` of the logits ``z``), times ``is_weights^2`` when given (rollout IS);
      clamped at 0 against rounding;
    * ``W_it = sum_{t' <= t} w_it'`` (cumulative path energy);
    * ``B_gt = sum_i G_it W_it / sum_i W_it`` over the rows i of group g that have a t-th token
      (the unweighted mean of their ``G_it`` if all their ``W`` are 0), and ``A_it = G_it - B_gt``.

    Where a row is the only one of its group with a t-th token (a group of size 1, or the tail of
    the longest response) the baseline is its own return: ``A = 0`` exactly. Fully masked rows
    count nowhere. No epsilon enters the division.

    Reference: the Optimal Token Baseline, arXiv:2602.07078 (as documented with verl's
    ``optimal_token_baseline`` estimator, docs/algo/otb.md).

    Args:
        rewards: ``[batch, seq]`` token rewards (e.g. the outcome on the last valid token).
        mask: 0/1 mask of the trained tokens.
        group_ids: ``[batch]`` the group (prompt) of each row, any integers.
        logprobs: log-probability of each sampled token under the policy that generated the data.
        sum_pi_squared: ``sum_v pi_v^2`` of the same distribution, per token.
        is_weights: optional per-token rollout importance weights.

    Returns:
        ``(advantages, returns)``, ``[batch, seq]``, detached, 0 where ``mask == 0``.

    Raises:
        InputError: a non-0/1 mask, non-finite inputs at valid positions. ShapeError: shapes.
    """
    fn = "fnppo.advantages.optimal_token_baseline_advantages"
    check_token_inputs(
        fn, mask, rewards=rewards, logprobs=logprobs, sum_pi_squared=sum_pi_squared, is_weights=is_weights
    )
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    m = mask != 0

    def clean(t: Tensor) -> Tensor:
        return torch.where(m, t.detach().to(dtype), 0.0)

    r = clean(rewards)
    returns = torch.where(m, torch.flip(torch.cumsum(torch.flip(r, [-1]), -1), [-1]), 0.0)
    w = torch.clamp(1.0 - 2.0 * torch.exp(clean(logprobs)) + clean(sum_pi_squared), min=0.0)
    if is_weights is not None:
        w = w * clean(is_weights) ** 2
    big_w = torch.where(m, torch.cumsum(torch.where(m, w, 0.0), -1), 0.0)
    _, group = torch.unique(group_ids, return_inverse=True)
    seq = m.shape[-1]
    pos = torch.cumsum(m.long(), -1) - 1  # response position of each valid token
    bins = torch.where(m, group.reshape(-1, 1).to(m.device) * seq + pos, 0).reshape(-1)
    n_bins = (int(group.max()) + 1) * seq if group.numel() else 0

    def per_bin(v: Tensor) -> Tensor:
        return torch.zeros(n_bins, dtype=dtype, device=v.device).index_add(0, bins, torch.where(m, v, 0.0).reshape(-1))

    num, den = per_bin(returns * big_w), per_bin(big_w)
    alive, plain = per_bin(torch.ones_like(returns)), per_bin(returns)
    base = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), plain / torch.clamp(alive, min=1))
    base, alive = base[bins].reshape(m.shape), alive[bins].reshape(m.shape)
    adv = torch.where(m & (alive > 1), returns - base, 0.0)
    return adv, returns
