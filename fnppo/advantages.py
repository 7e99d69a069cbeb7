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

from fnppo.segments import Segments, segments
from fnppo.typing import (
    Float,
    Integer,
    PaddedFloat,
    PaddedMask,
    Tensor,
    check_finite,
    check_mask01,
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
    :class:`fnppo.segments.Segments`, shared with the losses.

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
