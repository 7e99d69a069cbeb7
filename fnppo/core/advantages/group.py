"""Group-relative outcome advantages: one score per sequence, a baseline from its group (pure torch).

* :func:`grpo_advantages` -- group-normalized outcome advantages (GRPO, Dr. GRPO without std).
* :func:`rloo_advantages` -- REINFORCE leave-one-out baseline.
* :func:`pass_at_k_advantages` -- the best-of-k (pass@k / max@k) objective in closed form.
* :func:`opo_advantages` -- OPO's length-weighted group mean.
* :func:`gpg_advantages` -- GPG's rescaled group advantage (:func:`gpg_batch_counts`: its batch counts).

Per-sequence scores are ``[n]`` with group ids, or ``[n_groups, group_size]``. Use
:func:`fnppo.core.advantages.broadcast_to_tokens` to spread a result over the response tokens.

Conventions of the estimators (docs/conventions.md lists where other frameworks differ):

* ``valid`` (per sequence) / ``mask`` (per token): rows that are masked out never count in a
  group statistic, a batch statistic or a count, and their advantage is exactly 0;
* a group estimator gives a group with fewer than two valid rows no baseline: advantage exactly 0
  (ReMax has no groups; pass@k refuses groups smaller than k);
* results are detached, in ``promote_types(input dtype, float32)`` (float64 stays float64).
"""

from __future__ import annotations

import math

import torch

from fnppo.core.advantages.inputs import (
    SeqMask,
    SeqScores,
    check_eps,
    group_index,
    group_stats,
    masked_group_stats,
    seq_inputs,
)
from fnppo.core.errors import check_finite, check_float, describe, input_error
from fnppo.core.typing import Float, Integer, Tensor, typechecked

__all__ = [
    "grpo_advantages",
    "rloo_advantages",
    "pass_at_k_advantages",
    "opo_advantages",
    "gpg_advantages",
    "gpg_batch_counts",
]


@typechecked
def grpo_advantages(
    scores: Float[Tensor, "n"] | Float[Tensor, "groups group_size"],  # noqa: F821
    group_ids: Integer[Tensor, "n"] | None = None,  # noqa: F821
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Float[Tensor, "n"] | Float[Tensor, "groups group_size"]:  # noqa: F821
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
    fn = "fnppo.advantages.grpo_advantages"
    check_finite(fn, "scores", scores)
    check_float(fn, "eps", eps, low=0)
    x, index, g = group_index(fn, scores.detach(), group_ids)
    count, total, sq = group_stats(x, index, g)
    centered = x - total / count
    if normalize_std:
        denom = torch.sqrt(sq / torch.clamp(count - 1, min=1)) + eps
        centered = torch.where(denom > 0, centered / torch.where(denom > 0, denom, 1.0), 0.0)
    adv = torch.where(count > 1, centered, torch.zeros_like(centered))
    return adv.reshape(scores.shape)


@typechecked
def rloo_advantages(
    scores: Float[Tensor, "n"] | Float[Tensor, "groups group_size"],  # noqa: F821
    group_ids: Integer[Tensor, "n"] | None = None,  # noqa: F821
) -> Float[Tensor, "n"] | Float[Tensor, "groups group_size"]:  # noqa: F821
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
    fn = "fnppo.advantages.rloo_advantages"
    check_finite(fn, "scores", scores)
    x, index, g = group_index(fn, scores.detach(), group_ids)
    count, total, _ = group_stats(x, index, g)
    others = torch.clamp(count - 1, min=1)
    adv = torch.where(count > 1, x - (total - x) / others, torch.zeros_like(x))
    return adv.reshape(scores.shape)


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
def pass_at_k_advantages(
    scores: SeqScores,
    group_ids: Integer[Tensor, "n"] | None = None,  # noqa: F821
    *,
    k: int,
    valid: SeqMask | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> SeqScores:
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
    fn = "fnppo.advantages.pass_at_k_advantages"
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise input_error(fn, "k", "an int >= 1", repr(k))
    check_eps(fn, eps)
    x, index, g, keep = seq_inputs(fn, scores, group_ids, valid)
    values, present, counts, perm, slot = _sorted_groups(x, index, g, keep)
    small = (counts > 0) & (counts < k)
    if bool(small.any()):
        raise input_error(
            fn,
            "k",
            f"an int <= the number of valid rows of every group "
            f"(smallest non-empty group: {int(counts[counts > 0].min())})",
            repr(k),
        )
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
def opo_advantages(
    scores: SeqScores,
    lengths: SeqMask,
    group_ids: Integer[Tensor, "n"] | None = None,  # noqa: F821
    *,
    valid: SeqMask | None = None,  # noqa: F821
) -> SeqScores:
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
    fn = "fnppo.advantages.opo_advantages"
    if lengths.shape != scores.shape:
        raise input_error(fn, "lengths", f"a tensor of the shape of scores {tuple(scores.shape)}", describe(lengths))
    x, index, g, keep = seq_inputs(fn, scores, group_ids, valid)
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


def _gpg_rows(
    fn: str, scores: Tensor, group_ids: Tensor | None, valid: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per row for GPG: ``(x, keep, informative, centered, stack([group count, group sum of squares]))``."""
    x, index, g, keep = seq_inputs(fn, scores, group_ids, valid)
    count, mean, sq, spread = masked_group_stats(x, index, g, keep)
    informative = keep & (count > 1) & spread
    centered = torch.where(informative, x - mean, 0.0)
    return x, keep, informative, centered, torch.stack([count, sq])


@typechecked
def gpg_batch_counts(
    scores: SeqScores,
    group_ids: Integer[Tensor, "n"] | None = None,  # noqa: F821
    *,
    valid: SeqMask | None = None,  # noqa: F821
) -> Float[Tensor, "2"]:
    """``(B, B_valid)`` of :func:`gpg_advantages` as a summable float64 ``[2]`` tensor.

    ``B``: valid rows; ``B_valid``: valid rows of groups with at least two valid rows whose rewards
    are not all equal. Sum it over the parts of a batch (whole groups per part) or all-reduce it
    over data-parallel ranks and pass the sum as ``batch_counts``.
    """
    _, keep, informative, _, _ = _gpg_rows("fnppo.advantages.gpg_batch_counts", scores, group_ids, valid)
    return torch.stack([keep.sum(), informative.sum()]).to(torch.float64)


@typechecked
def gpg_advantages(
    scores: SeqScores,
    group_ids: Integer[Tensor, "n"] | None = None,  # noqa: F821
    *,
    valid: SeqMask | None = None,
    normalize_std: bool = False,
    eps: float = 1e-6,
    batch_counts: Float[Tensor, "2"] | None = None,
) -> SeqScores:
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
    fn = "fnppo.advantages.gpg_advantages"
    check_eps(fn, eps)
    x, keep, informative, centered, stats = _gpg_rows(fn, scores, group_ids, valid)
    if batch_counts is None:
        batch_counts = torch.stack([keep.sum(), informative.sum()]).to(torch.float64)
    elif not bool(torch.isfinite(batch_counts).all() & (batch_counts[1] >= 0) & (batch_counts[1] <= batch_counts[0])):
        raise input_error(fn, "batch_counts", "finite (B, B_valid) with 0 <= B_valid <= B", repr(batch_counts.tolist()))
    b, b_valid = batch_counts.to(device=x.device, dtype=torch.float64).unbind()
    alpha = torch.where(b_valid > 0, b / torch.clamp(b_valid, min=1e-300), 0.0).to(x.dtype)
    adv = alpha * centered
    if normalize_std:
        count, sq = stats.unbind()
        denom = torch.sqrt(sq / torch.clamp(count - 1, min=1)) + eps
        adv = torch.where(informative & (denom > 0), adv / torch.where(denom > 0, denom, 1.0), 0.0)
    return adv.reshape(scores.shape)
