"""Per-token advantage estimators: discounted returns over the valid tokens of each row (pure torch).

* :func:`discounted_scan` -- the backward recursion ``x_t = c_t x_{t+1} + u_t`` as a log-depth scan.
* :func:`gae_advantages` -- generalized advantage estimation with a critic.
* :func:`reinforce_pp_advantages` -- REINFORCE++: discounted KL-shaped returns, whitened.
* :func:`reinforce_pp_baseline_advantages` -- REINFORCE++-baseline: group-mean baseline on the
  outcome, whitened over the batch (:func:`masked_moments`: the summable batch moments).
* :func:`broadcast_to_tokens` -- spread one scalar per sequence over its response tokens.
* :func:`whiten` -- masked whitening (e.g. of GAE advantages), with whole-batch moments if given.

Per-token tensors use the padded layout ``[batch, seq]`` (each row is one episode; positions with
``mask == 0`` are skipped: they neither receive nor break the discounting, so prompt, padding and
tool-output tokens can sit anywhere). The recursions are vectorized (a log-depth scan), with no
Python loop over tokens.
"""

from __future__ import annotations

import math

import torch

from fnppo.core.advantages.inputs import check_eps, check_token_inputs, check_unit, masked_group_stats, seq_inputs
from fnppo.core.errors import check_finite, check_mask01, input_error
from fnppo.core.segments import segments
from fnppo.core.typing import Float, Integer, PaddedFloat, PaddedMask, Tensor, typechecked

__all__ = [
    "discounted_scan",
    "gae_advantages",
    "reinforce_pp_advantages",
    "broadcast_to_tokens",
    "masked_moments",
    "whiten",
    "reinforce_pp_baseline_advantages",
]


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
def gae_advantages(
    rewards: PaddedFloat, values: PaddedFloat, mask: PaddedMask, *, gamma: float, lam: float
) -> tuple[PaddedFloat, PaddedFloat]:
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
    fn = "fnppo.advantages.gae_advantages"
    check_unit(fn, "gamma", gamma)
    check_unit(fn, "lam", lam)
    check_token_inputs(fn, mask, rewards=rewards, values=values)
    dtype = torch.promote_types(values.dtype, torch.float32)
    m = mask != 0
    zero = torch.zeros((), dtype=dtype, device=values.device)
    r = torch.where(m, rewards.detach().to(dtype), zero)
    v = torch.where(m, values.detach().to(dtype), zero)
    delta = torch.where(m, r + gamma * _next_valid_values(v, m) - v, zero)
    coeffs = torch.where(m, torch.full_like(v, gamma * lam), torch.ones_like(v))
    adv = torch.where(m, discounted_scan(coeffs, delta), zero)
    return adv, torch.where(m, adv + v, zero)


@typechecked
def reinforce_pp_advantages(
    rewards: PaddedFloat,
    mask: PaddedMask,
    *,
    gamma: float = 1.0,
    kl: PaddedFloat | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
) -> tuple[PaddedFloat, PaddedFloat]:
    """REINFORCE++ advantages: whitened discounted returns of KL-shaped token rewards.

    ``r'_t = r_t - kl_coef * kl_t`` (``kl``: per-token KL to the reference policy, e.g.
    ``fnppo.losses.kl_penalty(logprobs, ref_logprobs, "k1")``; needed when ``kl_coef != 0``), returns
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
    fn = "fnppo.advantages.reinforce_pp_advantages"
    check_unit(fn, "gamma", gamma)
    if isinstance(kl_coef, bool) or not (isinstance(kl_coef, (int, float)) and math.isfinite(kl_coef)):
        raise input_error(fn, "kl_coef", "a finite number", repr(kl_coef))
    if kl_coef != 0 and kl is None:
        raise input_error(fn, "kl", f"a per-token KL tensor since kl_coef={kl_coef!r}", "None")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise input_error(fn, "eps", "a finite number >= 0", repr(eps))
    check_token_inputs(fn, mask, rewards=rewards, kl=kl if kl_coef != 0 else None)
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
def broadcast_to_tokens(
    values: Float[Tensor, "nseq"],  # noqa: F821
    mask: PaddedMask,
    *,
    seq_ids: Integer[Tensor, "batch seq"] | None = None,  # noqa: F821
) -> PaddedFloat:
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
    fn = "fnppo.advantages.broadcast_to_tokens"
    check_mask01(fn, "mask", mask)
    m = mask != 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    if seq_ids is None:
        if values.shape[0] != mask.shape[0]:
            raise input_error(
                fn, "values", f"one value per row ([{mask.shape[0]}]) when seq_ids is None", f"[{values.shape[0]}]"
            )
        return torch.where(m, segments(mask.shape, None).gather(values, mask), zero)
    if seq_ids.numel() and (int(seq_ids.min()) < -1 or int(seq_ids.max()) >= values.shape[0]):
        raise input_error(
            fn,
            "seq_ids",
            f"values in [-1, {values.shape[0]})",
            f"values in [{int(seq_ids.min())}, {int(seq_ids.max())}]",
        )
    if bool((m & (seq_ids < 0)).any()):
        raise input_error(fn, "seq_ids", "a sequence (>= 0) wherever mask is 1", "-1 at a masked-in token")
    return torch.where(m, segments(mask.shape, seq_ids, num=values.shape[0]).gather(values, mask), zero)


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
    fn = "fnppo.advantages.masked_moments"
    check_token_inputs(fn, mask, values=values)
    m = mask != 0
    v = torch.where(m, values.detach().to(torch.float64), 0.0)
    return torch.stack([m.sum().to(torch.float64), v.sum(), (v * v).sum()])


@typechecked
def whiten(
    values: PaddedFloat,
    mask: PaddedMask,
    *,
    batch_moments: Float[Tensor, "3"] | None = None,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> PaddedFloat:
    """Masked whitening: ``(x - mu) / sqrt(var + eps)`` over the positions where ``mask == 1``.

    ``mu`` and the Bessel-corrected ``var`` are those of ``values`` at the valid positions, or of
    ``batch_moments`` (the summed :func:`masked_moments` of every part of the batch: micro-batches,
    data-parallel ranks after an all-reduce) so that each part is whitened with whole-batch
    statistics. ``shift_mean=False`` keeps the mean: ``x / sqrt(var + eps)``. The output is 0 where
    ``mask == 0`` and keeps the dtype of ``values`` (statistics in float64). The usual treatment of
    GAE advantages in PPO for language models (Ziegler et al., Fine-Tuning Language Models from
    Human Preferences, arXiv:1909.08593; Huang et al., The N+ Implementation Details of RLHF with
    PPO, arXiv:2403.17031).

    Raises:
        InputError: a mask that is not 0/1, non-finite values where ``mask == 1``, ``eps < 0``,
            ``batch_moments`` with a negative count or non-finite entries.
    """
    fn = "fnppo.advantages.whiten"
    check_token_inputs(fn, mask, values=values)
    check_eps(fn, eps)
    m = mask != 0
    if batch_moments is None:
        moments = masked_moments(values, mask)
    else:
        if not bool(torch.isfinite(batch_moments).all()) or float(batch_moments[0]) < 0:
            raise input_error(
                fn, "batch_moments", "finite (count >= 0, sum, sum of squares)", f"{batch_moments.tolist()}"
            )
        moments = batch_moments
    n, s1, _ = moments.to(device=values.device, dtype=torch.float64).unbind()
    x = values.detach().to(torch.float64)
    if shift_mean:
        x = x - s1 / torch.clamp(n, min=1)
    return torch.where(m, (x * _inv_std(moments, eps).to(values.device)).to(values.dtype), 0.0)


def _inv_std(moments: Tensor, eps: float) -> Tensor:
    """``1 / sqrt(var + eps)`` (0 when ``var + eps = 0``) with Bessel's variance from ``(count, sum, sumsq)``."""
    n, s1, s2 = moments.to(torch.float64).unbind()
    mean = s1 / torch.clamp(n, min=1)
    var = torch.clamp((s2 - s1 * mean) / torch.clamp(n - 1, min=1), min=0.0)
    return torch.where(var + eps > 0, torch.rsqrt(var + eps), 0.0)


def _whiten(x: Tensor, m: Tensor, moments: Tensor, eps: float) -> Tensor:
    """``(x - mu) / sqrt(var + eps)`` with Bessel's variance from ``(count, sum, sumsq)`` moments."""
    n, s1, _ = moments.to(device=x.device, dtype=torch.float64).unbind()
    inv = _inv_std(moments, eps).to(x.device)
    return torch.where(m, ((x.to(torch.float64) - s1 / torch.clamp(n, min=1)) * inv).to(x.dtype), 0.0)


@typechecked
def reinforce_pp_baseline_advantages(
    scores: Float[Tensor, "batch"],  # noqa: F821
    mask: PaddedMask,
    group_ids: Integer[Tensor, "batch"],  # noqa: F821
    *,
    kl: PaddedFloat | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
    batch_moments: Float[Tensor, "3"] | None = None,
) -> tuple[PaddedFloat, PaddedFloat]:
    """REINFORCE++-baseline: group-mean baseline on the outcome, then whitening over the batch.

    Row i (an episode, ``mask`` its trained tokens) in group g with outcome ``s_i``:
    ``G_it = (s_i - mean_g s) - kl_coef * sum_{t' >= t} kl_it'`` over the valid positions
    (``gamma = 1``; the KL term needs ``kl``, e.g. ``fnppo.losses.kl_penalty(logp, ref_logp, "k1")``), and
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
    fn = "fnppo.advantages.reinforce_pp_baseline_advantages"
    if isinstance(kl_coef, bool) or not (isinstance(kl_coef, (int, float)) and math.isfinite(kl_coef)):
        raise input_error(fn, "kl_coef", "a finite number", repr(kl_coef))
    if kl_coef != 0 and kl is None:
        raise input_error(fn, "kl", f"a per-token KL tensor since kl_coef={kl_coef!r}", "None")
    check_eps(fn, eps)
    check_token_inputs(fn, mask, kl=kl if kl_coef != 0 else None)
    check_finite(fn, "batch_moments", batch_moments)
    m = mask != 0
    row_valid = m.any(dim=-1)
    x, index, g, keep = seq_inputs(fn, scores, group_ids, row_valid)
    count, mean, _, _ = masked_group_stats(x, index, g, keep)
    centered = torch.where(keep & (count > 1), x - mean, 0.0)
    dtype = x.dtype
    returns = torch.where(m, centered[:, None].expand(m.shape), 0.0)
    if kl_coef != 0:
        k = torch.where(m, kl.detach().to(dtype), 0.0)
        returns = returns - kl_coef * torch.where(m, torch.flip(torch.cumsum(torch.flip(k, [-1]), -1), [-1]), 0.0)
    moments = masked_moments(returns, m) if batch_moments is None else batch_moments
    return _whiten(returns, m, moments, eps), returns
