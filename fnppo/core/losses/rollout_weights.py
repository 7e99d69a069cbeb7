"""Rollout correction, the computation: importance weights, rejection and their batch statistics.

The formulas, the order the corrections compose in and where fnppo differs from common practice
are those of :mod:`fnppo.core.losses.rollout_correction` (which holds the settings,
:class:`~fnppo.core.losses.rollout_correction.RolloutCorrection`, and their checks). Here:
:func:`compute_tis_weights` (one micro-batch, validated), :func:`tis_batch_stats` (the local
``(sum, count)`` for batch normalization) and :func:`correction` (the computation itself, trusting
its inputs), used by :func:`fnppo.core.losses.ppo.ppo_loss`.

References: F. Yao et al. (2025), "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (TIS); J. Liu, Y. Li et al. (2025), "When Speed Kills Stability: Demystifying RL Collapse
from the Training-Inference Mismatch"; Ling Team (2025), arXiv:2510.18855 (IcePop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from fnppo.core.errors import input_error
from fnppo.core.losses.checks import Checker, describe_value, validate_inputs
from fnppo.core.losses.m2po import m2_values, m2po_cutoff
from fnppo.core.losses.rollout_correction import (
    RolloutCorrection,
    Rules,
    check_clamp,
    check_seq_rejection,
    check_weight_rules,
)
from fnppo.core.metrics import pair_metric, weighted_metric
from fnppo.core.segments import Segments, segments
from fnppo.core.typing import Integer, PaddedFloat, PaddedMask, Shaped, Tensor, typechecked, typechecking_enabled

__all__ = ["TISWeights", "compute_tis_weights", "tis_batch_stats", "correction", "CorrectedLoss"]


class TISWeights(NamedTuple):
    """Result of :func:`compute_tis_weights`.

    Attributes:
        weights: ``[batch, seq]`` detached importance weights to multiply the policy loss with;
            0 at masked-out and rejected positions.
        keep: ``[batch, seq]`` float 0/1: valid and not rejected.
        metrics: ``tis_weight`` / ``tis_weight_sq`` (mean of the applied weight and of its square,
            per token or per sequence according to ``level``; :func:`fnppo.core.metrics.finalize_metrics`
            derives ``tis_ess`` from them), ``tis_truncated_frac`` and ``tis_rejected_frac`` (the
            weight bounds); with sequence criteria ``rollout_rejected_frac`` (sequences rejected
            by any of them) and ``<criterion>_frac`` per criterion (fractions of valid sequences);
            with batch normalization ``tis_batch_mean`` (the mean weight divided by, over kept
            units, before normalization).
    """

    weights: Tensor
    keep: Tensor
    metrics: dict[str, Tensor]


# =============================================================================================
# the computation
# =============================================================================================
def _seq_max(seg: Segments, x: Tensor) -> Tensor:
    """Per-sequence maximum ``[num]`` of a per-token tensor ``x >= 0`` (0 for an empty sequence)."""
    if seg.ids is None:
        return x.amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[0])
    out = torch.zeros(seg.num + 1, dtype=x.dtype, device=x.device)
    return out.scatter_reduce(0, seg.ids.reshape(-1), x.reshape(-1), reduce="amax")[: seg.num]


def _seq_rejection(
    d: Tensor, mf: Tensor, seg: Segments, seq_valid: Tensor, r: Rules
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequences rejected by the sequence-statistic criteria (``[num]`` bool) and their metrics.

    ``d`` is the clamped per-token log-ratio, 0 off the mask. Only valid sequences (>= 1 valid
    token) can be rejected; each fraction is over the valid sequences.
    """
    count = seg.sum(mf)
    safe = torch.where(count > 0, count, torch.ones_like(count))

    def seq_mean(x: Tensor) -> Tensor:
        return seg.sum(x * mf) / safe

    fired: dict[str, Tensor] = {}
    if r.seq_k2 is not None:
        fired["reject_seq_k2"] = seq_mean(0.5 * d * d) > r.seq_k2
    if r.seq_k3 is not None:
        fired["reject_seq_k3"] = seq_mean(torch.exp(d) - 1.0 - d) > r.seq_k3
    if r.seq_mean_log_ratio is not None:
        low, high = r.seq_mean_log_ratio
        mean = seq_mean(d)
        fired["reject_seq_mean_log_ratio"] = (mean < low) | (mean > high)
    if r.seq_max_abs_log_ratio is not None:
        fired["reject_seq_max_abs_log_ratio"] = _seq_max(seg, d.abs() * mf) > r.seq_max_abs_log_ratio
    valid_f = seq_valid.to(mf.dtype)
    rejected = torch.zeros_like(seq_valid)
    metrics: dict[str, Tensor] = {}
    for name, hit in fired.items():
        hit = hit & seq_valid
        rejected = rejected | hit
        metrics[f"{name}_frac"] = weighted_metric(hit.to(mf.dtype), valid_f)
    metrics["rollout_rejected_frac"] = weighted_metric(rejected.to(mf.dtype), valid_f)
    return rejected, metrics


def _bound_rejection(w_raw: Tensor, raw_weight: Callable[[str], Tensor], r: Rules) -> Tensor:
    """Units of ``r.reject_level`` whose untruncated weight is outside ``[reject_low, reject_high]``."""
    r_raw = w_raw if r.reject_level == r.level else raw_weight(r.reject_level)
    rejected = torch.zeros_like(r_raw, dtype=torch.bool)
    if r.reject_low is not None:
        rejected = rejected | (r_raw < r.reject_low)
    if r.reject_high is not None:
        rejected = rejected | (r_raw > r.reject_high)
    return rejected


def correction(
    train: Tensor,
    rollout: Tensor,
    m: Tensor,
    seg: Segments,
    r: Rules,
    tis_mean: float | Tensor | None = None,
    m2_cutoff: float | Tensor | None = None,
) -> tuple[TISWeights, Tensor]:
    """The rollout correction of one micro-batch (see the module docstring), trusting its inputs.

    Args:
        train, rollout: ``[batch, seq]`` trainer-side and rollout log-probs (detached here).
        m: bool ``[batch, seq]``, the valid tokens. seg: their sequences.
        r: the :class:`Rules`.
        tis_mean: the global mean weight to divide by when ``r.normalize`` (None: this call's own
            mean; a mean <= 0, possible only without any kept unit, divides by 1).
        m2_cutoff: with ``r.m2_threshold``: the mini-batch's M2PO cutoff (:func:`~fnppo.core.losses.m2po.m2po_cutoff`
            of every valid token's ``d^2``); None: this call's own.

    Returns:
        ``(TISWeights, stats)`` with ``stats = (sum of the truncated weights, number)`` over the kept
        units at ``r.level``, before normalization (the pair :func:`tis_batch_stats` sums).
    """
    dtype = torch.promote_types(train.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=train.device)
    mf = m.to(dtype)
    log_w_tok = torch.where(m, train.detach().to(dtype) - rollout.detach().to(dtype), zero)
    seq_valid = seg.sum(mf) > 0
    units = {"token": mf, "sequence": seq_valid.to(dtype)}  # what a metric averages over, per level

    def raw_weight(lv: str) -> Tensor:  # per token [batch, seq] or per sequence [num]; clamped in log space
        log_w = log_w_tok if lv == "token" else seg.sum(log_w_tok)
        return torch.exp(torch.clamp(log_w, -r.clamp, r.clamp))

    def to_tokens(v: Tensor, lv: str) -> Tensor:
        return v if lv == "token" else seg.gather(v, mf)

    w_raw = raw_weight(r.level)
    if r.cap is None:
        w, truncated = torch.ones_like(w_raw), torch.zeros_like(w_raw)
    else:
        w, truncated = torch.clamp(w_raw, max=r.cap), (w_raw > r.cap).to(dtype)
    rejected = _bound_rejection(w_raw, raw_weight, r)
    keep = mf * (1.0 - to_tokens(rejected.to(dtype), r.reject_level))
    metrics: dict[str, Tensor] = {}
    if r.seq_rules:
        d_tok = torch.clamp(log_w_tok, -r.clamp, r.clamp)
        seq_rejected, metrics = _seq_rejection(d_tok, mf, seg, seq_valid, r)
        keep = keep * (1.0 - seg.gather(seq_rejected.to(dtype), mf))
    if r.m2_threshold is not None:
        sq = torch.clamp(train.detach().double() - rollout.detach().double(), -r.clamp, r.clamp) ** 2
        if m2_cutoff is None:
            m2_cutoff = m2po_cutoff(m2_values(train, rollout, m, r.clamp), r.m2_threshold)
        m2_masked = m & (sq >= torch.as_tensor(m2_cutoff, dtype=torch.float64, device=sq.device))
        metrics["m2po_masked_frac"] = weighted_metric(m2_masked.to(dtype), mf)
        keep = keep * (~m2_masked).to(dtype)
    # The applied weight per unit of `level`: 0 for a unit with no kept token.
    kept_unit = keep if r.level == "token" else (seg.sum(keep) > 0).to(dtype)
    w_applied = w * kept_unit
    stats = torch.stack([w_applied.sum(), kept_unit.sum()])
    if r.normalize:
        if tis_mean is None:
            mean = stats[0] / torch.where(stats[1] > 0, stats[1], torch.ones_like(stats[1]))
        else:
            mean = torch.as_tensor(tis_mean).to(device=train.device, dtype=dtype)
        w_applied = w_applied / torch.where(mean > 0, mean, torch.ones_like(mean))
        metrics["tis_batch_mean"] = pair_metric(stats[0], stats[1])
    metrics.update(
        {
            "tis_weight": weighted_metric(w_applied, units[r.level]),
            "tis_weight_sq": weighted_metric(w_applied * w_applied, units[r.level]),
            "tis_truncated_frac": weighted_metric(truncated, units[r.level]),
            "tis_rejected_frac": weighted_metric(rejected.to(dtype), units[r.reject_level]),
        }
    )
    return TISWeights((to_tokens(w_applied, r.level) * keep).detach(), keep.detach(), metrics), stats.detach()


# =============================================================================================
# The public wrappers, with validation
# =============================================================================================
@runtime_checkable
class CorrectedLoss(Protocol):
    """What :func:`tis_batch_stats` reads of a ``LossConfig``."""

    correction: RolloutCorrection | None
    bypass_old_logprobs: bool
    log_ratio_clamp: float


@typechecked
def compute_tis_weights(
    old_logprobs: PaddedFloat,
    rollout_logprobs: PaddedFloat,
    loss_mask: PaddedMask,
    *,
    cap: float | None,
    level: str = "token",
    reject_low: float | None = None,
    reject_high: float | None = None,
    reject_level: str | None = None,
    seq_ids: Integer[Tensor, "batch seq"] | None = None,
    log_ratio_clamp: float = 20.0,
    reject_seq_k2: float | None = None,
    reject_seq_k3: float | None = None,
    reject_seq_mean_log_ratio: tuple[float, float] | None = None,
    reject_seq_max_abs_log_ratio: float | None = None,
    batch_normalize: bool = False,
    tis_mean: float | int | Shaped[Tensor, ""] | None = None,
) -> TISWeights:
    """Truncated importance weights and rejection correcting for the rollout engine's sampling.

    Token level: ``w_t = exp(logp_old_t - logp_rollout_t)``; sequence level:
    ``w_i = exp(sum_t (logp_old_t - logp_rollout_t))`` (valid tokens of sequence i, broadcast to its
    tokens). Log-weights are clamped to ``[-log_ratio_clamp, log_ratio_clamp]``. The applied weight
    is ``min(w, cap)``, detached (``cap=None``: weight 1, only rejection); a weight exactly equal to
    ``cap`` is not counted in ``tis_truncated_frac``. Optional rejection (at ``reject_level``,
    default ``level``): tokens or sequences whose untruncated weight is outside the closed interval
    ``[reject_low, reject_high]`` get weight 0 and ``keep`` 0 (a weight exactly on a bound is kept:
    on-policy data, ``w = 1`` exactly, is kept with ``reject_low=1``); so do sequences rejected by
    the ``reject_seq_*`` criteria (k2, k3, mean and max-abs of the clamped log-ratio ``d``, see the
    module docstring; each fires strictly above its threshold, resp. strictly outside its closed
    interval). ``batch_normalize``: the kept weights are divided by ``tis_mean`` (the global mean
    from :func:`tis_batch_stats`; None: their mean in this call).

    Reference: F. Yao et al. (2025), "Your efficient RL framework secretly brings you off-policy RL
    training" (truncated importance sampling, TIS); rejection: Liu, Li et al. (2025), "When Speed
    Kills Stability" (masked IS, sequence statistics) and IcePop (arXiv:2510.18855).

    Args:
        old_logprobs, rollout_logprobs: ``[batch, seq]`` log-probs of the trainer's old policy and
            of the rollout engine.
        loss_mask: 0/1 mask of the trained tokens.
        cap, level, reject_low, reject_high, reject_level: see above (``level`` and
            ``reject_level``: ``"token"`` or ``"sequence"``).
        seq_ids: packed layout: per-token sequence index, -1 for no sequence.
        log_ratio_clamp: bound of the log-weights and of ``d``.
        reject_seq_k2, reject_seq_k3, reject_seq_mean_log_ratio, reject_seq_max_abs_log_ratio: as
            in :class:`RolloutCorrection`.
        batch_normalize, tis_mean: see above; ``tis_mean`` needs ``batch_normalize``.

    Returns:
        :class:`TISWeights` ``(weights, keep, metrics)``.

    Raises:
        InputError: the rule of :class:`RolloutCorrection`, applied to the arguments of the same
            name: a ``cap`` or ``reject_high`` that is not a finite number > 0, a ``reject_low`` that
            is not a finite number >= 0, ``reject_low >= reject_high`` (named ``reject_high``), an
            unknown ``level`` / ``reject_level``, a ``log_ratio_clamp`` that is not a finite number
            > 0; a bad ``reject_seq_*`` criterion; ``tis_mean`` without ``batch_normalize``; with
            checking on, a mask that is not 0/1, NaN/inf at valid positions (values where
            ``loss_mask`` is 0 are never read), ``seq_ids`` out of range, a negative or non-finite
            ``tis_mean``.
    """
    fn = "fnppo.losses.compute_tis_weights"
    given = {
        "cap": cap,
        "level": level,
        "reject_low": reject_low,
        "reject_high": reject_high,
        "reject_level": reject_level,
        "log_ratio_clamp": log_ratio_clamp,
        "reject_seq_k2": reject_seq_k2,
        "reject_seq_k3": reject_seq_k3,
        "reject_seq_mean_log_ratio": reject_seq_mean_log_ratio,
        "reject_seq_max_abs_log_ratio": reject_seq_max_abs_log_ratio,
    }
    c = Checker(fn, given.__getitem__)
    check_weight_rules(c)
    check_clamp(c)
    bounds = check_seq_rejection(c)
    if tis_mean is not None and not batch_normalize:
        raise input_error(fn, "tis_mean", "None since batch_normalize=False", describe_value(tis_mean))
    if typechecking_enabled():
        validate_inputs(
            fn,
            loss_mask,
            {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs},
            None,
            seq_ids,
            tis_mean=tis_mean,
        )
    rules = Rules(
        cap,
        level,
        reject_low,
        reject_high,
        level if reject_level is None else reject_level,
        reject_seq_k2,
        reject_seq_k3,
        bounds,
        reject_seq_max_abs_log_ratio,
        batch_normalize,
        log_ratio_clamp,
    )
    return correction(
        old_logprobs, rollout_logprobs, loss_mask != 0, segments(loss_mask.shape, seq_ids), rules, tis_mean
    )[0]


@typechecked
def tis_batch_stats(
    old_logprobs: PaddedFloat,
    rollout_logprobs: PaddedFloat,
    loss_mask: PaddedMask,
    config: CorrectedLoss,
    *,
    seq_ids: Integer[Tensor, "batch seq"] | None = None,
) -> Tensor:
    """``(sum of the TIS weights, number of units)`` over the kept units of one micro-batch.

    The units are those of ``config.correction.level``: kept tokens, or sequences with at least one
    kept token (rejected units, by ``reject_low/high`` or ``reject_seq_*``, are excluded); the
    weights are ``min(w, tis_cap)`` before normalization. Sum the pairs over all micro-batches and
    data-parallel ranks of a mini-batch and pass ``tis_mean = sum / count`` to
    :func:`fnppo.core.losses.ppo.ppo_loss` (``batch_normalize=True``): every weight is then divided
    by the exact mean of the whole mini-batch, whatever the split. :func:`fnppo.train_step` does
    this together with the loss normalizer (one all-reduce). The same pair is reported as the
    metric ``tis_batch_mean``. Without a correction every valid unit has weight 1.

    Reference: batch-normalized IS weights as in verl's ``rollout_is_batch_normalize`` (there over
    all valid units); TIS: Yao et al. (2025).

    Args:
        old_logprobs, rollout_logprobs, loss_mask: as in :func:`compute_tis_weights`.
        config: the ``LossConfig`` of the loss (its ``correction`` and ``log_ratio_clamp``).
        seq_ids: packed layout: per-token sequence index, -1 for no sequence.

    Returns:
        ``[2]`` tensor in ``promote_types(dtype, fp32)``, detached.

    Raises:
        InputError: a config in bypass mode (its weights need the current policy); with checking
            on, as :func:`compute_tis_weights`.
    """
    fn = "fnppo.losses.tis_batch_stats"
    if config.bypass_old_logprobs:
        raise input_error(
            fn,
            "config",
            "a LossConfig without bypass_old_logprobs (the weights would need the current policy's log-probs)",
            "bypass_old_logprobs=True",
        )
    if typechecking_enabled():
        validate_inputs(
            fn, loss_mask, {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs}, None, seq_ids
        )
    rules = Rules.of(config.correction, config.log_ratio_clamp)._replace(normalize=False)
    return correction(old_logprobs, rollout_logprobs, loss_mask != 0, segments(loss_mask.shape, seq_ids), rules)[1]
