"""Advantage estimators as pure functions (pure torch, no Megatron).

* :func:`gae_advantages` -- generalized advantage estimation with a critic.
* :func:`grpo_advantages` -- group-normalized outcome advantages (GRPO, Dr. GRPO without std).
* :func:`rloo_advantages` -- REINFORCE leave-one-out baseline.
* :func:`reinforce_pp_advantages` -- REINFORCE++: discounted KL-shaped returns, whitened.
* :func:`broadcast_to_tokens` -- spread one scalar per sequence over its response tokens.

Per-token tensors use the padded layout ``[batch, seq]`` (each row is one episode; positions with
``mask == 0`` are skipped: they neither receive nor break the discounting, so prompt, padding and
tool-output tokens can sit anywhere). Per-sequence scores are ``[n]`` with group ids, or
``[n_groups, group_size]``. These functions run once per step, outside the micro-batch loop;
the recursions are vectorized (a log-depth scan), with no Python loop over tokens.
"""

from __future__ import annotations

import math

import torch

from fnppo.core.segments import Segments, segments
from fnppo.core.typing import (
    Float,
    Integer,
    PaddedFloat,
    PaddedMask,
    Shaped,
    Tensor,
    check_finite,
    check_mask01,
    describe,
    input_error,
    typechecked,
)

__all__ = [
    "gae_advantages",
    "grpo_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "broadcast_to_tokens",
    "discounted_scan",
]


def _check_unit(fn: str, arg: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value <= 1.0):
        raise input_error(fn, arg, "a number in [0, 1]", repr(value))


def _check_token_inputs(fn: str, mask: Tensor, **tensors: Tensor | None) -> None:
    check_mask01(fn, "mask", mask)
    for name, t in tensors.items():
        check_finite(fn, name, t, where=mask)


@typechecked
def discounted_scan(coeffs: PaddedFloat, inputs: PaddedFloat) -> PaddedFloat:
    """Solve the backward linear recursion ``x_t = coeffs_t * x_{t+1} + inputs_t``, ``x_seq = 0``.

    Vectorized over the batch and computed with a log-depth (Hillis-Steele) suffix scan over
    affine maps: ``ceil(log2(seq))`` steps of elementwise work, no Python loop over tokens.
    Setting ``coeffs_t = 1, inputs_t = 0`` passes ``x_{t+1}`` through position ``t`` unchanged
    (how masked positions are skipped).

    Reference: W. D. Hillis and G. L. Steele, Data Parallel Algorithms (1986), the scan of
    associative operators (here composition of affine maps).

    Args:
        coeffs, inputs: ``[batch, seq]`` coefficients and inputs of the recursion.

    Returns:
        ``x``, ``[batch, seq]``.
    """
    a, b = coeffs, inputs
    n = a.shape[-1]
    d = 1
    while d < n:
        a_next = torch.cat([a[:, d:], torch.ones_like(a[:, :d])], dim=-1)
        b_next = torch.cat([b[:, d:], torch.zeros_like(b[:, :d])], dim=-1)
        b = b + a * b_next
        a = a * a_next
        d *= 2
    return b


def _next_valid_values(values: Tensor, m: Tensor) -> Tensor:
    """``values`` at the next valid position after each t (0 if there is none)."""
    n = values.shape[-1]
    idx = torch.arange(n, device=values.device).expand_as(m)
    pos = torch.where(m, idx, torch.full_like(idx, n))
    suffix_min = torch.flip(torch.cummin(torch.flip(pos, [-1]), dim=-1).values, [-1])  # min over k >= t
    nxt = torch.cat([suffix_min[:, 1:], torch.full_like(suffix_min[:, :1], n)], dim=-1)
    padded = torch.cat([values, torch.zeros_like(values[:, :1])], dim=-1)
    return torch.gather(padded, -1, nxt)


@typechecked
def gae_advantages(rewards: PaddedFloat, values: PaddedFloat, mask: PaddedMask, *, gamma: float,
                   lam: float) -> tuple[PaddedFloat, PaddedFloat]:
    """Generalized advantage estimation over the valid tokens of each row.

    With ``t'`` the next valid position after ``t`` (``V_{t'} = 0`` at the end of the row):
    ``delta_t = r_t + gamma V_{t'} - V_t`` and ``A_t = delta_t + gamma lam A_{t'}``; the returns are
    ``R_t = A_t + V_t``. Both are 0 where ``mask == 0``; rewards and values there are ignored (put
    the outcome reward on the last valid token). ``lam = 1`` gives Monte-Carlo returns minus V,
    ``lam = 0`` the one-step TD error.

    Reference: Schulman et al., High-Dimensional Continuous Control Using Generalized Advantage
    Estimation, arXiv:1506.02438.

    Args:
        rewards, values: ``[batch, seq]`` per-token rewards and critic values.
        mask: 0/1 mask of the valid tokens.
        gamma, lam: discount and GAE lambda, in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, both ``[batch, seq]``, detached.

    Raises:
        InputError: ``gamma`` / ``lam`` outside ``[0, 1]``, a mask that is not 0/1, NaN/inf at
            valid positions.
    """
    fn = "fnppo.gae_advantages"
    _check_unit(fn, "gamma", gamma)
    _check_unit(fn, "lam", lam)
    _check_token_inputs(fn, mask, rewards=rewards, values=values)
    dtype = torch.promote_types(values.dtype, torch.float32)
    m = mask != 0
    zero = torch.zeros((), dtype=dtype, device=values.device)
    r = torch.where(m, rewards.detach().to(dtype), zero)
    v = torch.where(m, values.detach().to(dtype), zero)
    delta = torch.where(m, r + gamma * _next_valid_values(v, m) - v, zero)
    coeffs = torch.where(m, torch.full_like(v, gamma * lam), torch.ones_like(v))
    adv = torch.where(m, discounted_scan(coeffs, delta), zero)
    return adv, torch.where(m, adv + v, zero)


def _group_index(fn: str, scores: Tensor, group_ids: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """Flattened scores, a group index in [0, G) per score, and G."""
    if group_ids is None:
        if scores.ndim != 2:
            raise input_error(fn, "group_ids", "a tensor [n] when scores is 1-D (or scores [n_groups, group_size])",
                              "None")
        g, s = scores.shape
        index = torch.arange(g, device=scores.device).repeat_interleave(s)
        return scores.reshape(-1), index, g
    if scores.ndim != 1:
        raise input_error(fn, "group_ids", "None when scores is [n_groups, group_size]", "a tensor")
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return scores, inverse.reshape(-1), unique.numel()


def _group_stats(x: Tensor, index: Tensor, g: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-score group size, group sum and group sum of squared deviations (gathered)."""
    seg = Segments(index, g)
    count = seg.sum(torch.ones_like(x))
    total = seg.sum(x)
    mean = total / torch.where(count > 0, count, torch.ones_like(count))
    dev = x - seg.gather(mean, x)
    sq = seg.sum(dev * dev)
    return seg.gather(count, x), seg.gather(total, x), seg.gather(sq, x)


@typechecked
def grpo_advantages(scores: Float[Tensor, "n"] | Float[Tensor, "groups group_size"],
                    group_ids: Integer[Tensor, "n"] | None = None, *, normalize_std: bool = True,
                    eps: float = 1e-6) -> Float[Tensor, "n"] | Float[Tensor, "groups group_size"]:
    """Group-relative outcome advantages.

    ``A_i = (s_i - mean_g) / (std_g + eps)`` over the group g of i (std with Bessel's correction,
    as in the reference GRPO implementations), or ``A_i = s_i - mean_g`` with
    ``normalize_std=False`` (Dr. GRPO, arXiv:2503.20783). A group of size 1 has no baseline: its
    advantage is defined as 0 (as is every advantage of a group with ``std + eps == 0``).

    Groups are the rows of ``scores [n_groups, group_size]``, or given by ``group_ids [n]`` (any
    integers) for ``scores [n]``. Use :func:`broadcast_to_tokens` to spread the result over the
    response tokens.

    Reference: DeepSeekMath (GRPO), arXiv:2402.03300.

    Args:
        scores: ``[n]`` with ``group_ids``, or ``[n_groups, group_size]``.
        group_ids: ``[n]`` group of each score (any integers), or None.
        normalize_std: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: added to the std, ``>= 0``.

    Returns:
        Advantages of the shape of ``scores``, detached.

    Raises:
        InputError: NaN/inf scores, a bad ``eps``, groups given both ways or neither.
    """
    fn = "fnppo.grpo_advantages"
    check_finite(fn, "scores", scores)
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise input_error(fn, "eps", "a finite number >= 0", repr(eps))
    x, index, g = _group_index(fn, scores.detach(), group_ids)
    count, total, sq = _group_stats(x, index, g)
    centered = x - total / count
    if normalize_std:
        denom = torch.sqrt(sq / torch.clamp(count - 1, min=1)) + eps
        centered = torch.where(denom > 0, centered / torch.where(denom > 0, denom, 1.0), 0.0)
    adv = torch.where(count > 1, centered, torch.zeros_like(centered))
    return adv.reshape(scores.shape)


@typechecked
def rloo_advantages(scores: Float[Tensor, "n"] | Float[Tensor, "groups group_size"],
                    group_ids: Integer[Tensor, "n"] | None = None
                    ) -> Float[Tensor, "n"] | Float[Tensor, "groups group_size"]:
    """REINFORCE leave-one-out advantages: ``A_i = s_i - (sum_{j in g, j != i} s_j) / (|g| - 1)``.

    Equivalently ``|g| / (|g| - 1) * (s_i - mean_g)``. A group of size 1 gets advantage 0.
    Groups as in :func:`grpo_advantages`.

    Reference: Ahmadian et al., Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs, arXiv:2402.14740.

    Args:
        scores, group_ids: as in :func:`grpo_advantages`.

    Returns:
        Advantages of the shape of ``scores``, detached.

    Raises:
        InputError: NaN/inf scores, groups given both ways or neither.
    """
    fn = "fnppo.rloo_advantages"
    check_finite(fn, "scores", scores)
    x, index, g = _group_index(fn, scores.detach(), group_ids)
    count, total, _ = _group_stats(x, index, g)
    others = torch.clamp(count - 1, min=1)
    adv = torch.where(count > 1, x - (total - x) / others, torch.zeros_like(x))
    return adv.reshape(scores.shape)


@typechecked
def reinforce_pp_advantages(rewards: PaddedFloat, mask: PaddedMask, *, gamma: float = 1.0,
                            kl: PaddedFloat | None = None, kl_coef: float = 0.0,
                            eps: float = 1e-8) -> tuple[PaddedFloat, PaddedFloat]:
    """REINFORCE++ advantages: whitened discounted returns of KL-shaped token rewards.

    ``r'_t = r_t - kl_coef * kl_t`` (``kl``: per-token KL to the reference policy, e.g.
    ``fnppo.kl_penalty(logprobs, ref_logprobs, "k1")``; needed when ``kl_coef != 0``), returns
    ``G_t = r'_t + gamma G_{t'}`` over valid positions (``t'`` the next valid one, ``G = 0`` past
    the end), and ``A_t = (G_t - mu) / sqrt(var + eps)`` with the mean and (Bessel-corrected)
    variance of ``G`` over all valid tokens of the call. Both outputs are 0 where ``mask == 0``.

    Reference: J. Hu, REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models, arXiv:2501.03262.

    Args:
        rewards: ``[batch, seq]`` per-token rewards.
        mask: 0/1 mask of the valid tokens.
        gamma: discount in ``[0, 1]``.
        kl, kl_coef: per-token KL and its weight in the shaped reward.
        eps: added to the variance, ``>= 0``.

    Returns:
        ``(advantages, returns)``, detached.

    Raises:
        InputError: a bad ``gamma`` / ``kl_coef`` / ``eps``, ``kl`` missing while ``kl_coef != 0``,
            a mask that is not 0/1, NaN/inf at valid positions.
    """
    fn = "fnppo.reinforce_pp_advantages"
    _check_unit(fn, "gamma", gamma)
    if isinstance(kl_coef, bool) or not (isinstance(kl_coef, (int, float)) and math.isfinite(kl_coef)):
        raise input_error(fn, "kl_coef", "a finite number", repr(kl_coef))
    if kl_coef != 0 and kl is None:
        raise input_error(fn, "kl", f"a per-token KL tensor since kl_coef={kl_coef!r}", "None")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise input_error(fn, "eps", "a finite number >= 0", repr(eps))
    _check_token_inputs(fn, mask, rewards=rewards, kl=kl if kl_coef != 0 else None)
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    m = mask != 0
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    r = torch.where(m, rewards.detach().to(dtype), zero)
    if kl_coef != 0:
        r = r - kl_coef * torch.where(m, kl.detach().to(dtype), zero)
    coeffs = torch.where(m, torch.full_like(r, gamma), torch.ones_like(r))
    returns = torch.where(m, discounted_scan(coeffs, r), zero)
    mf = m.to(dtype)
    n = mf.sum()
    mean = returns.sum() / torch.clamp(n, min=1)
    var = (((returns - mean) * mf) ** 2).sum() / torch.clamp(n - 1, min=1)
    adv = torch.where(m, (returns - mean) * torch.rsqrt(var + eps), zero)
    return adv, returns


@typechecked
def broadcast_to_tokens(values: Float[Tensor, "nseq"], mask: PaddedMask, *,
                        seq_ids: Integer[Tensor, "batch seq"] | None = None) -> PaddedFloat:
    """Spread one value per sequence over its tokens: ``out[b, t] = values[seq(b, t)] * mask[b, t]``.

    ``seq_ids is None``: sequence ``i`` is row ``i`` (``nseq == batch``). Packed layout: ``seq_ids``
    gives each token's index into ``values`` (-1: no sequence, output 0). The grouping is
    :class:`fnppo.core.segments.Segments`, shared with the losses.

    Args:
        values: ``[nseq]`` one value per sequence (e.g. from :func:`grpo_advantages`).
        mask: ``[batch, seq]`` 0/1 mask of the tokens to fill.
        seq_ids: packed layout: per-token sequence index, or None.

    Returns:
        ``[batch, seq]`` per-token values, 0 where ``mask`` is 0.

    Raises:
        InputError: a mask that is not 0/1, not one value per row, ``seq_ids`` out of range or -1
            at a masked-in token.
    """
    fn = "fnppo.broadcast_to_tokens"
    check_mask01(fn, "mask", mask)
    m = mask != 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    if seq_ids is None:
        if values.shape[0] != mask.shape[0]:
            raise input_error(fn, "values", f"one value per row ([{mask.shape[0]}]) when seq_ids is None",
                              f"[{values.shape[0]}]")
        return torch.where(m, segments(mask.shape, None).gather(values, mask), zero)
    if seq_ids.numel() and (int(seq_ids.min()) < -1 or int(seq_ids.max()) >= values.shape[0]):
        raise input_error(fn, "seq_ids", f"values in [-1, {values.shape[0]})",
                          f"values in [{int(seq_ids.min())}, {int(seq_ids.max())}]")
    if bool((m & (seq_ids < 0)).any()):
        raise input_error(fn, "seq_ids", "a sequence (>= 0) wherever mask is 1", "-1 at a masked-in token")
    return torch.where(m, segments(mask.shape, seq_ids, num=values.shape[0]).gather(values, mask), zero)


# =============================================================================================
# More estimators: pass@k, REINFORCE++-baseline, ReMax, OPO, GPG, optimal token baseline.
# Conventions shared by all of them (docs/conventions.md lists where other frameworks differ):
# * ``valid`` (per sequence) / ``mask`` (per token): rows that are masked out never count in a
#   group statistic, a batch statistic or a count, and their advantage is exactly 0;
# * a group estimator gives a group with fewer than two valid rows no baseline: advantage exactly 0
#   (ReMax has no groups; pass@k refuses groups smaller than k);
# * results are detached, in ``promote_types(input dtype, float32)`` (float64 stays float64).
# =============================================================================================
__all__ += [
    "pass_at_k_advantages",
    "reinforce_pp_baseline_advantages",
    "masked_moments",
    "remax_advantages",
    "opo_advantages",
    "gpg_advantages",
    "gpg_batch_counts",
    "optimal_token_baseline_advantages",
]

SeqScores = Float[Tensor, "n"] | Float[Tensor, "groups group_size"]
SeqMask = Shaped[Tensor, "n"] | Shaped[Tensor, "groups group_size"]


def _check_eps(fn: str, eps: float) -> None:
    if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise input_error(fn, "eps", "a finite number >= 0", repr(eps))


def _valid_rows(fn: str, valid: Tensor | None, scores: Tensor) -> Tensor:
    """Flattened bool ``[numel]`` of the rows that count (all of them when ``valid is None``)."""
    if valid is None:
        return torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
    if valid.shape != scores.shape:
        raise input_error(fn, "valid", f"a 0/1 mask of the shape of scores {tuple(scores.shape)}", describe(valid))
    check_mask01(fn, "valid", valid)
    return (valid != 0).reshape(-1).to(scores.device)


def _seq_inputs(fn: str, scores: Tensor, group_ids: Tensor | None,
                valid: Tensor | None) -> tuple[Tensor, Tensor, int, Tensor]:
    """Validated ``(x, index, G, keep)``: flat scores in the compute dtype, group index, count, valid rows."""
    keep = _valid_rows(fn, valid, scores)
    check_finite(fn, "scores", scores, where=None if valid is None else valid)
    x, index, g = _group_index(fn, scores.detach(), group_ids)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    x = torch.where(keep, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))
    return x, index.to(x.device), g, keep


def _masked_group_stats(x: Tensor, index: Tensor, g: int, keep: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
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


def _log_comb(a: Tensor, b: Tensor) -> Tensor:
    """``log C(a, b)`` in float64, ``-inf`` where ``b < 0`` or ``b > a`` (C = 0 there)."""
    ok = (b >= 0) & (b <= a)
    a_, b_ = torch.where(ok, a, 0.0), torch.where(ok, b, 0.0)
    value = torch.lgamma(a_ + 1) - torch.lgamma(b_ + 1) - torch.lgamma(a_ - b_ + 1)
    return torch.where(ok, value, -math.inf)


def _comb_ratio(a: Tensor, b: Tensor, n: Tensor, k: Tensor) -> Tensor:
    """``C(a, b) / C(n, k)`` in float64 (0 where ``C(a, b) = 0``; requires ``C(n, k) > 0``)."""
    num = _log_comb(a, b)
    return torch.where(num > -math.inf, torch.exp(num - _log_comb(n, k)), 0.0)


def _sorted_groups(x: Tensor, index: Tensor, g: int, keep: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Each group's valid values in a dense ``[G, W]`` matrix, sorted ascending within the row.

    Returns ``(values, present, counts, perm, slot)``: ``values[g, j]`` the j-th smallest valid
    value of group g (0 where ``present`` is False), ``counts [G]``, and the permutation / slot that
    map row i to ``(index[i], slot[i])`` before sorting (``perm`` as returned by ``torch.sort``).
    """
    bucket = torch.where(keep, index, torch.full_like(index, g))  # invalid rows: an extra bucket
    counts = torch.zeros(g + 1, dtype=torch.long, device=x.device).index_add(0, bucket, torch.ones_like(bucket))
    order = torch.argsort(bucket, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(x.numel(), device=x.device) - starts[bucket[order]]
    slot = torch.zeros_like(order).scatter(0, order, pos)
    width = int(counts.max()) if x.numel() else 0
    dense = torch.full((g + 1, width), math.inf, dtype=x.dtype, device=x.device)
    dense = dense.index_put((bucket, slot), torch.where(keep, x, math.inf))[:g]
    values, perm = torch.sort(dense, dim=1)
    present = torch.arange(width, device=x.device)[None, :] < counts[:g, None]
    return torch.where(present, values, 0.0), present, counts[:g], perm, slot


@typechecked
def pass_at_k_advantages(scores: SeqScores, group_ids: Integer[Tensor, "n"] | None = None, *, k: int,
                         valid: SeqMask | None = None, normalize_std: bool = True, eps: float = 1e-6) -> SeqScores:
    """Advantages for the best-of-k (pass@k / max@k) objective, in closed form over each group.

    For a group of ``n`` valid rows with rewards ``x_1..x_n`` and ``S`` ranging over its ``C(n, k)``
    subsets of size k, with ``x_(1) <= ... <= x_(n)`` sorted and row i at rank ``r``:

    * ``R = mean_S max(S) = sum_m C(m-1, k-1) / C(n, k) * x_(m)`` -- the unbiased (U-statistic)
      estimate of ``E[max of k samples]`` (pass@k for 0/1 rewards);
    * ``m_i = mean_{S containing i} max(S) = [C(r-1, k-1) x_(r) + sum_{m>r} C(m-2, k-2) x_(m)] / C(n-1, k-1)``;
    * ``sigma^2 = mean_S max(S)^2 - R^2`` (population variance over the subsets);
    * ``A_i = (m_i - R) / (sigma + eps)``, or ``m_i - R`` with ``normalize_std=False``.

    Derivation: ``x_(m)`` is the maximum of the ``C(m-1, k-1)`` subsets whose other members all
    rank below m. Of the ``C(n-1, k-1)`` subsets containing i, ``C(r-1, k-1)`` have their other
    members below r (maximum ``x_i``) and ``C(m-2, k-2)`` have their maximum at rank ``m > r`` (the
    other ``k-2`` members among the ``m-2`` ranks below m other than r). Averaging over all subsets
    (instead of sampling some) keeps the estimates unbiased with the least variance.

    For binary rewards with ``c`` correct rows this is exactly the analytical advantage of Chen et
    al.: ``R = 1 - C(n-c, k)/C(n, k)``, ``sigma = sqrt(R (1 - R))``, ``A = (1 - R) / sigma`` for a
    correct row and ``(1 - R - C(n-c-1, k-1)/C(n-1, k-1)) / sigma`` for a wrong one. Continuous
    rewards are supported through the order statistics above (max@k). ``(k/n) m_i`` is PKPO's
    transformed reward, whose policy gradient is unbiased for the gradient of ``E[max of k]``
    (Walder & Karkhanis); like GRPO's group mean, the baseline ``R`` includes row i itself. The
    advantages of a group sum to 0; ``k = 1`` is GRPO with the population std.

    Ties are harmless (the formulas are invariant to the order of equal values). When
    ``x_(k) = x_(n)`` every subset has the same maximum (e.g. all rewards equal, or fewer than k
    wrong answers): the advantages are exactly 0. References: Chen et al., Pass@k Training for Adaptively
    Balancing Exploration and Exploitation of Large Reasoning Models, arXiv:2508.10751; Walder &
    Karkhanis, Pass@K Policy Optimization, arXiv:2505.15201.

    Args:
        scores: ``[n]`` with ``group_ids [n]``, or ``[n_groups, group_size]`` (one group per row).
        group_ids: any integers; None for 2-D ``scores``.
        k: the k of pass@k, an int >= 1 and <= the number of valid rows of every non-empty group.
        valid: optional 0/1 mask of the shape of ``scores``; masked rows are left out of every
            group statistic (and of n) and get advantage 0. None: all rows valid.
        normalize_std: divide by ``sigma + eps`` (Chen et al.) or not.
        eps: added to sigma, >= 0.

    Returns:
        Advantages of the shape of ``scores``, detached, dtype ``promote(scores.dtype, float32)``.

    Raises:
        InputError: ``k`` not an int >= 1, a group with ``0 < n < k`` valid rows (so a group of size
            1 is an error for k >= 2; for k = 1 its advantage is 0), non-finite valid scores, a bad
            ``valid`` or ``eps``. ShapeError: inconsistent shapes.
    """
    fn = "fnppo.pass_at_k_advantages"
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise input_error(fn, "k", "an int >= 1", repr(k))
    _check_eps(fn, eps)
    x, index, g, keep = _seq_inputs(fn, scores, group_ids, valid)
    values, present, counts, perm, slot = _sorted_groups(x, index, g, keep)
    small = (counts > 0) & (counts < k)
    if bool(small.any()):
        raise input_error(fn, "k", f"an int <= the number of valid rows of every group "
                          f"(smallest non-empty group: {int(counts[counts > 0].min())})", repr(k))
    f64 = dict(dtype=torch.float64, device=x.device)
    n = counts.to(**f64)[:, None]
    r = torch.arange(1, values.shape[1] + 1, **f64)[None, :]
    kk = torch.full((), float(k), **f64)
    ok = present & (n >= k)
    w_max = torch.where(ok, _comb_ratio(r - 1, kk - 1, n, kk), 0.0).to(x.dtype)  # P(rank r is max(S))
    w_self = torch.where(ok, _comb_ratio(r - 1, kk - 1, n - 1, kk - 1), 0.0).to(x.dtype)
    w_above = torch.where(ok, _comb_ratio(r - 2, kk - 2, n - 1, kk - 1), 0.0).to(x.dtype)
    mu = values.sum(1, keepdim=True) / torch.clamp(counts, min=1)[:, None].to(x.dtype)
    c = torch.where(present, values - mu, 0.0)  # max(S) is shift-equivariant: work centered
    mean_max = (w_max * c).sum(1, keepdim=True)
    var = torch.clamp((w_max * c * c).sum(1, keepdim=True) - mean_max * mean_max, min=0.0)
    above = w_above * c
    m = w_self * c + (above.sum(1, keepdim=True) - torch.cumsum(above, 1))  # sum over ranks > r
    adv = m - mean_max
    if normalize_std:
        denom = torch.sqrt(var) + eps
        adv = torch.where(denom > 0, adv / torch.where(denom > 0, denom, 1.0), 0.0)
    # max(S) is the same for every S iff x_(k) = x_(n) (then A = 0 exactly, not rounding noise / eps)
    top = values.gather(1, torch.clamp(counts - 1, min=0)[:, None])
    kth = values[:, min(k, values.shape[1]) - 1 : min(k, values.shape[1])] if values.shape[1] else top
    adv = torch.where(present & (top > kth), adv, 0.0)
    unsorted = torch.zeros_like(adv).scatter(1, perm, adv)
    out = torch.where(keep, unsorted[index, slot], 0.0) if g else x
    return out.reshape(scores.shape)


@typechecked
def masked_moments(values: PaddedFloat, mask: PaddedMask) -> Float[Tensor, "3"]:
    """``(count, sum, sum of squares)`` of ``values`` over the positions where ``mask == 1``.

    float64 ``[3]``, summable: the elementwise sum over the parts of a batch (micro-batches, data-
    parallel ranks via an all-reduce) is the moments of the whole batch. Feed it to
    ``batch_moments`` of :func:`reinforce_pp_baseline_advantages` to whiten with whole-batch
    statistics when each part is processed separately.

    Raises:
        InputError: a mask that is not 0/1, non-finite values where ``mask == 1``.
    """
    fn = "fnppo.masked_moments"
    _check_token_inputs(fn, mask, values=values)
    m = mask != 0
    v = torch.where(m, values.detach().to(torch.float64), 0.0)
    return torch.stack([m.sum().to(torch.float64), v.sum(), (v * v).sum()])


def _whiten(x: Tensor, m: Tensor, moments: Tensor, eps: float) -> Tensor:
    """``(x - mu) / sqrt(var + eps)`` with Bessel's variance from ``(count, sum, sumsq)`` moments."""
    n, s1, s2 = moments.to(device=x.device, dtype=torch.float64).unbind()
    mean = s1 / torch.clamp(n, min=1)
    var = torch.clamp((s2 - s1 * mean) / torch.clamp(n - 1, min=1), min=0.0)
    scale = torch.where(var + eps > 0, torch.rsqrt(var + eps), 0.0)  # var = eps = 0: all equal, A = 0
    return torch.where(m, ((x.to(torch.float64) - mean) * scale).to(x.dtype), 0.0)


@typechecked
def reinforce_pp_baseline_advantages(
    scores: Float[Tensor, "batch"],
    mask: PaddedMask,
    group_ids: Integer[Tensor, "batch"],
    *,
    kl: PaddedFloat | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
    batch_moments: Float[Tensor, "3"] | None = None,
) -> tuple[PaddedFloat, PaddedFloat]:
    """REINFORCE++-baseline: group-mean baseline on the outcome, then whitening over the batch.

    Row i (an episode, ``mask`` its trained tokens) in group g with outcome ``s_i``:
    ``G_it = (s_i - mean_g s) - kl_coef * sum_{t' >= t} kl_it'`` over the valid positions
    (``gamma = 1``; the KL term needs ``kl``, e.g. ``fnppo.kl_penalty(logp, ref_logp, "k1")``), and
    ``A_it = (G_it - mu) / sqrt(var + eps)`` with the mean ``mu`` and Bessel-corrected variance
    ``var`` of ``G`` over every valid token of the batch.

    The group mean is over the rows with at least one valid token; rows with none (fully masked)
    neither count in it nor in ``mu``/``var``, and get 0 everywhere. A group with a single valid row
    has no baseline: its centered outcome is 0 (only the KL term remains). With ``batch_moments``
    (the summed :func:`masked_moments` of the returns of every part of the batch), ``mu`` and
    ``var`` come from it instead of this call, so processing the batch in parts (whole groups per
    part) gives the same advantages as one call.

    Reference: J. Hu, REINFORCE++ (REINFORCE++-baseline), arXiv:2501.03262.

    Args:
        scores: one outcome reward per row.
        mask: ``[batch, seq]`` 0/1 mask of the trained tokens.
        group_ids: the group (prompt) of each row, any integers.
        kl: per-token KL to the reference, needed when ``kl_coef != 0``.
        kl_coef: finite number.
        eps: added to the variance, >= 0.
        batch_moments: optional whole-batch ``(count, sum, sumsq)`` of the returns.

    Returns:
        ``(advantages, returns)``, both ``[batch, seq]``, detached, 0 where ``mask == 0``.

    Raises:
        InputError: non-finite inputs where they are used, a non-0/1 mask, ``kl`` missing,
            bad ``kl_coef`` / ``eps``. ShapeError: inconsistent shapes.
    """
    fn = "fnppo.reinforce_pp_baseline_advantages"
    if isinstance(kl_coef, bool) or not (isinstance(kl_coef, (int, float)) and math.isfinite(kl_coef)):
        raise input_error(fn, "kl_coef", "a finite number", repr(kl_coef))
    if kl_coef != 0 and kl is None:
        raise input_error(fn, "kl", f"a per-token KL tensor since kl_coef={kl_coef!r}", "None")
    _check_eps(fn, eps)
    _check_token_inputs(fn, mask, kl=kl if kl_coef != 0 else None)
    check_finite(fn, "batch_moments", batch_moments)
    m = mask != 0
    row_valid = m.any(dim=-1)
    x, index, g, keep = _seq_inputs(fn, scores, group_ids, row_valid)
    count, mean, _, _ = _masked_group_stats(x, index, g, keep)
    centered = torch.where(keep & (count > 1), x - mean, 0.0)
    dtype = x.dtype
    returns = torch.where(m, centered[:, None].expand(m.shape), 0.0)
    if kl_coef != 0:
        k = torch.where(m, kl.detach().to(dtype), 0.0)
        returns = returns - kl_coef * torch.where(m, torch.flip(torch.cumsum(torch.flip(k, [-1]), -1), [-1]), 0.0)
    moments = masked_moments(returns, m) if batch_moments is None else batch_moments
    return _whiten(returns, m, moments, eps), returns


@typechecked
def remax_advantages(scores: SeqScores, greedy_scores: Float[Tensor, "*greedy"], *,
                     valid: SeqMask | None = None) -> SeqScores:
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
    fn = "fnppo.remax_advantages"
    keep = _valid_rows(fn, valid, scores).reshape(scores.shape)
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
def opo_advantages(scores: SeqScores, lengths: SeqMask, group_ids: Integer[Tensor, "n"] | None = None, *,
                   valid: SeqMask | None = None) -> SeqScores:
    """OPO: outcome minus the length-weighted group mean (the optimal baseline of OPO).

    ``b_g = sum_{j in g} l_j s_j / sum_{j in g} l_j`` over the valid rows of group g (``l`` the
    response lengths in tokens) and ``A_i = s_i - b_g``. OPO derives it from the variance-optimal
    baseline ``E[|grad log pi|^2 s] / E[|grad log pi|^2]`` with ``|grad log pi(y)|^2`` taken
    proportional to ``|y|`` (exact on-policy training).

    A group with fewer than two valid rows, or whose valid rows all have length 0, gets 0. Masked
    rows (``valid == 0``) get 0 and count nowhere. Groups as in :func:`grpo_advantages`.

    Reference: Hao et al., On-Policy RL with Optimal Reward Baseline, arXiv:2505.23585.

    Args:
        scores: ``[n]`` with ``group_ids``, or ``[n_groups, group_size]``.
        lengths: response lengths (number of trained tokens), any real dtype, finite and >= 0,
            of the shape of ``scores``.
        group_ids: any integers; None for 2-D ``scores``.
        valid: optional 0/1 mask of the shape of ``scores``.

    Returns:
        Advantages of the shape of ``scores``, detached, dtype ``promote(scores.dtype, float32)``.

    Raises:
        InputError: ``lengths`` of another shape, negative or non-finite; non-finite valid scores.
    """
    fn = "fnppo.opo_advantages"
    if lengths.shape != scores.shape:
        raise input_error(fn, "lengths", f"a tensor of the shape of scores {tuple(scores.shape)}", describe(lengths))
    x, index, g, keep = _seq_inputs(fn, scores, group_ids, valid)
    lf = lengths.detach().reshape(-1).to(device=x.device, dtype=x.dtype)
    if bool((keep & (~torch.isfinite(lf) | (lf < 0))).any()):
        raise input_error(fn, "lengths", "finite values >= 0 on valid rows", describe(lengths))
    lf = torch.where(keep, lf, 0.0)
    count = torch.zeros(g, dtype=x.dtype, device=x.device).index_add(0, index, keep.to(x.dtype))
    total_len = torch.zeros(g, dtype=x.dtype, device=x.device).index_add(0, index, lf)
    weighted = torch.zeros(g, dtype=x.dtype, device=x.device).index_add(0, index, lf * x)
    ok = (count > 1) & (total_len > 0)
    base = weighted / torch.where(ok, total_len, 1.0)
    adv = torch.where(keep & ok[index], x - base[index], 0.0)
    return adv.reshape(scores.shape)


def _gpg_rows(fn: str, scores: Tensor, group_ids: Tensor | None,
              valid: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per row for GPG: ``(x, keep, informative, centered, stack([group count, group sum of squares]))``."""
    x, index, g, keep = _seq_inputs(fn, scores, group_ids, valid)
    count, mean, sq, spread = _masked_group_stats(x, index, g, keep)
    informative = keep & (count > 1) & spread
    centered = torch.where(informative, x - mean, 0.0)
    return x, keep, informative, centered, torch.stack([count, sq])


@typechecked
def gpg_batch_counts(scores: SeqScores, group_ids: Integer[Tensor, "n"] | None = None, *,
                     valid: SeqMask | None = None) -> Float[Tensor, "2"]:
    """``(B, B_valid)`` of :func:`gpg_advantages` as a summable float64 ``[2]`` tensor.

    ``B``: valid rows; ``B_valid``: valid rows of groups with at least two valid rows whose rewards
    are not all equal. Sum it over the parts of a batch (whole groups per part) or all-reduce it
    over data-parallel ranks and pass the sum as ``batch_counts``.
    """
    _, keep, informative, _, _ = _gpg_rows("fnppo.gpg_batch_counts", scores, group_ids, valid)
    return torch.stack([keep.sum(), informative.sum()]).to(torch.float64)


@typechecked
def gpg_advantages(scores: SeqScores, group_ids: Integer[Tensor, "n"] | None = None, *,
                   valid: SeqMask | None = None, normalize_std: bool = False, eps: float = 1e-6,
                   batch_counts: Float[Tensor, "2"] | None = None) -> SeqScores:
    """GPG's corrected group advantage: ``A_i = alpha (s_i - mean_g) / F``, ``alpha = B / B_valid``.

    ``mean_g`` over the valid rows of i's group; ``F = 1`` (GPG's default) or, with
    ``normalize_std=True``, ``F = std_g + eps`` (Bessel, as :func:`grpo_advantages`). Groups whose
    valid rewards are all equal (including groups with one valid row) carry no gradient; GPG
    rescales the others by ``alpha = B / B_valid`` with ``B`` the number of valid rows of the batch
    and ``B_valid`` the number in informative groups, so that the gradient of a loss averaged over
    the batch is not shrunk by the rows that carry none.

    ``alpha`` aggregates over the whole batch: when the batch is processed in parts (whole groups
    per part, e.g. one part per data-parallel rank), pass the summed :func:`gpg_batch_counts` of
    all parts as ``batch_counts`` and every part gets the advantages of one call on the whole
    batch. ``B_valid = 0``: every advantage is 0. Masked rows (``valid == 0``) get 0, count in no
    mean and not in ``B``.

    Reference: Chu et al., GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning, arXiv:2504.02546 (Eq. for the corrected advantage, ``alpha = B / (B - M)``).

    Args:
        scores: ``[n]`` with ``group_ids``, or ``[n_groups, group_size]``.
        group_ids: any integers; None for 2-D ``scores``.
        valid: optional 0/1 mask of the shape of ``scores``.
        normalize_std: divide by the group std + eps.
        eps: >= 0.
        batch_counts: whole-batch ``(B, B_valid)`` (float64 ``[2]``), or None for this call's.

    Returns:
        Advantages of the shape of ``scores``, detached, dtype ``promote(scores.dtype, float32)``.

    Raises:
        InputError: non-finite valid scores, bad ``valid`` / ``eps`` / ``batch_counts``
            (``B_valid > B`` or negative counts).
    """
    fn = "fnppo.gpg_advantages"
    _check_eps(fn, eps)
    x, keep, informative, centered, stats = _gpg_rows(fn, scores, group_ids, valid)
    if batch_counts is None:
        batch_counts = torch.stack([keep.sum(), informative.sum()]).to(torch.float64)
    elif not bool(torch.isfinite(batch_counts).all() & (batch_counts[1] >= 0) & (batch_counts[1] <= batch_counts[0])):
        raise input_error(fn, "batch_counts", "finite (B, B_valid) with 0 <= B_valid <= B",
                          repr(batch_counts.tolist()))
    b, b_valid = batch_counts.to(device=x.device, dtype=torch.float64).unbind()
    alpha = torch.where(b_valid > 0, b / torch.clamp(b_valid, min=1e-300), 0.0).to(x.dtype)
    adv = alpha * centered
    if normalize_std:
        count, sq = stats.unbind()
        denom = torch.sqrt(sq / torch.clamp(count - 1, min=1)) + eps
        adv = torch.where(informative & (denom > 0), adv / torch.where(denom > 0, denom, 1.0), 0.0)
    return adv.reshape(scores.shape)


@typechecked
def optimal_token_baseline_advantages(
    rewards: PaddedFloat,
    mask: PaddedMask,
    group_ids: Integer[Tensor, "batch"],
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
    fn = "fnppo.optimal_token_baseline_advantages"
    _check_token_inputs(fn, mask, rewards=rewards, logprobs=logprobs, sum_pi_squared=sum_pi_squared,
                        is_weights=is_weights)
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
