"""Policy-gradient losses for PPO-style training of language models (pure torch, no Megatron).

Everything here is a function of per-token tensors in the padded layout ``[batch, seq]`` (the packed
THD layout is ``[1, total]`` plus per-token sequence ids). Position ``t`` of every tensor refers to
the same target token: ``logprobs[b, t]`` is the log-probability of token ``t + 1`` given its prefix
and ``loss_mask[b, t]`` is 1 where that token is a trained response token.

The pieces, each usable alone:

* :class:`PolicyLossConfig` -- every knob, validated when constructed (frozen dataclass).
* :func:`ppo_loss` -- policy loss (chosen from the registry) + entropy bonus + KL penalty,
  optionally reweighted by truncated importance sampling, aggregated with ``loss_agg_mode``.
* :func:`kl_penalty` -- per-token KL estimators k1, k2, k3, abs (and straight-through ``"+"``).
* :func:`compute_tis_weights` -- truncated importance weights and rejection against the rollout
  engine (the computation lives in :mod:`fnppo.core.rollout_correction`).
* :func:`tis_batch_stats` -- the local ``(sum, count)`` of the weights, for batch normalization.
* :func:`value_loss` -- clipped value loss for PPO with a critic (:class:`ValueLossConfig` for ``critic_step``).
* :func:`loss_normalizer` -- the local denominator of a micro-batch, to be summed over the step.

Beside it: :mod:`fnppo.core.policy_losses` (the registry and the built-in policy losses ``ppo``,
``gspo``, ``cispo``, ``gpg``, ``reinforce``, ``gmpo``, ``sapo``, ``clip_cov``, ``kl_cov``),
:mod:`fnppo.core.metrics` (metric pairs, their merge and reduction) and :mod:`fnppo.core.segments` (token ->
sequence grouping). Their public names are re-exported here, so ``from fnppo.core.loss import
register_policy_loss`` keeps working.

Micro-batching. With ``normalizer=N`` (the denominator of the whole step: the sum of
:func:`loss_normalizer` over all micro-batches and data-parallel ranks), every micro-batch loss is
``numerator_i / N``, so the sum of the micro-batch losses is exactly the full-batch loss, whatever
the split (sequences are never split across micro-batches). The exceptions are ``clip_cov`` and
``kl_cov``, whose token selection uses statistics of the micro-batch they see (as in their paper).

Metrics. Every metric is a detached fp32 tensor of shape ``[2]``: ``(weighted_sum, weight)``
(:mod:`fnppo.core.metrics`). ``loss``, ``pg_loss``, ``entropy`` and ``kl_loss`` carry the aggregation
numerator and the local denominator, so the finalized ``loss`` equals the full-batch loss and
``loss == pg_loss - entropy_coeff * entropy + kl_coef * kl_loss``. Ratios and fractions
(``ppo_kl``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ...) are means over valid tokens.

Validation (mask is 0/1, no NaN/inf at trained positions, sequence ids in range, normalizer >= 0)
costs one device-to-host sync. Positions where the mask is 0 are never read: whatever they hold,
NaN and inf included, the loss, its gradient and the metrics are those of any finite value there
(:func:`fnppo.collate_microbatch`, which builds the micro-batches of :func:`fnppo.train_step` from
samples, is stricter: it refuses NaN/inf at every response position). Validation runs while
call-time type checking is on (see :mod:`fnppo.core.typing`) and is skipped together with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fnppo.core.metrics import finalize_metrics, merge_metrics, pair_metric, weighted_metric
from fnppo.core.policy_losses import (  # noqa: F401 - the built-in losses stay importable from here
    _POLICY_LOSSES,
    _RATIO_FREE,
    PolicyLossFn,
    PolicyLossInputs,
    cispo_loss,
    clip_cov_loss,
    get_policy_loss,
    gmpo_loss,
    gspo_loss,
    kl_cov_loss,
    ppo_clip_loss,
    register_policy_loss,
    registered_policy_losses,
    sapo_loss,
)
from fnppo.core.rollout_correction import (
    SEQ_REJECTION_CRITERIA,
    Rules,
    TISWeights,
    check_seq_rejection,
    check_weight_rules,
    correction,
)
from fnppo.core.segments import Segments, segments
from fnppo.core.typing import (
    Integer,
    PaddedFloat,
    PaddedMask,
    Scalar,
    Shaped,
    Tensor,
    TokenFloat,
    check_bool_fields,
    check_finite,
    check_mask01,
    describe,
    input_error,
    typechecked,
    typechecking_enabled,
)

__all__ = [
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "PolicyLossConfig",
    "PolicyLossInputs",
    "PolicyLossFn",
    "Segments",
    "TISWeights",
    "ppo_loss",
    "register_policy_loss",
    "get_policy_loss",
    "registered_policy_losses",
    "kl_penalty",
    "compute_tis_weights",
    "tis_batch_stats",
    "SEQ_REJECTION_CRITERIA",
    "value_loss",
    "ValueLossConfig",
    "loss_normalizer",
    "weighted_metric",
    "merge_metrics",
    "finalize_metrics",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""The aggregation modes accepted by ``loss_agg_mode``."""

_KL_BASE = {"k1": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}
KL_ESTIMATORS = tuple(_KL_BASE) + tuple(name + "+" for name in _KL_BASE)
"""The KL estimator names accepted by :func:`kl_penalty` (``"+"``: straight-through k2 gradient)."""


# =============================================================================================
# Config
# =============================================================================================
def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class PolicyLossConfig:
    """Configuration of :func:`ppo_loss`. Frozen; every field is validated at construction.

    Attributes:
        policy_loss: name of a registered policy loss (see :func:`registered_policy_losses`).
            Register custom losses before constructing the config that names them.
        clip_ratio_low, clip_ratio_high: asymmetric clipping of the ratio to
            ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` (DAPO clip-higher, arXiv:2503.14476).
            ``gmpo`` reads them as log-space bounds ``[-clip_ratio_low, clip_ratio_high]``.
            ``gspo`` uses them on its sequence ratio (the paper uses ~3e-4 / 4e-4). A ratio exactly
            on a bound is not clipped (not counted in ``pg_clipfrac``, full gradient).
        clip_ratio_c: dual-clip bound for negative advantages (arXiv:1912.09729), ``> 1``;
            ``None`` disables it. Used by ``ppo`` and ``clip_cov``. A ratio exactly at
            ``clip_ratio_c`` is not clipped (not counted in ``pg_clipfrac_lower``, full gradient).
        loss_agg_mode: one of :data:`LOSS_AGG_MODES` (see :func:`ppo_loss`).
        loss_scale_factor: the constant ``C`` of ``seq-mean-token-sum-norm`` (Dr. GRPO,
            arXiv:2503.20783; e.g. the maximum response length). Required for that mode, must be
            ``None`` otherwise. Being a constant, it keeps the loss split-invariant.
        entropy_coeff: weight of the entropy bonus (the loss gets ``- entropy_coeff * entropy``),
            ``>= 0`` (a negative value would silently turn the bonus into a penalty).
        kl_coef: weight of the KL penalty ``KL(policy || ref)`` (needs ``ref_logprobs``), ``>= 0``.
        kl_estimator: one of :data:`KL_ESTIMATORS` (see :func:`kl_penalty`).
        tis_cap: truncation cap of the importance weight against the rollout engine's log-probs
            (Yao et al. 2025); ``None``: no reweighting. Must be > 0. A weight exactly equal to the
            cap is not counted in ``tis_truncated_frac``.
        tis_level: ``"token"`` (per-token weight) or ``"sequence"`` (product over the sequence).
        tis_reject_low, tis_reject_high: optional rejection bounds on the untruncated weight:
            tokens (or sequences) whose weight lies outside the closed interval ``[low, high]`` are
            dropped from the loss numerator (they still count in the denominator); a weight exactly
            on a bound is kept. ``None``: no bound. ``low >= 0``, ``high > 0``, ``low < high``
            (the same rule as the arguments of :func:`compute_tis_weights`).
        tis_reject_level: level of the rejection, ``"token"``, ``"sequence"``, or ``None`` (same as
            ``tis_level``).
        log_ratio_clamp: log-ratios are clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` before
            ``exp`` so that no inf/NaN appears.
        cispo_clip_low, cispo_clip_high: CISPO clips the (stopped) weight to
            ``[1 - cispo_clip_low, 1 + cispo_clip_high]``; MiniMax-M1 used no lower bound
            (``cispo_clip_low = 1``) and tuned the upper one.
        sapo_tau_pos, sapo_tau_neg: SAPO gate temperatures for positive / negative advantages.
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: Clip-Cov: fraction of tokens to detach and the
            covariance band they are drawn from.
        kl_cov_ratio, kl_cov_coef: KL-Cov: fraction of tokens (largest covariance) that get the
            ``kl_cov_coef * |log r|`` penalty.
        bypass_old_logprobs: bypass mode: the rollout engine's log-probs serve as the old
            log-probs (no separate old log-prob pass; ``old_logprobs`` may be None and is ignored).
            Ratios and clipping are then ``pi_theta / pi_rollout``, and the rollout correction
            compares ``sg(logp)`` with the rollout log-probs. ``tis_cap`` is refused for a loss that
            uses a ratio (the ratio already is the importance weight); a ratio-free loss (``gpg``,
            ``reinforce``) is weighted by ``min(sg(pi_theta / pi_rollout), tis_cap)``. (verl's
            ``bypass_mode``.)
        tis_batch_normalize: divide the TIS weights by their mean over the kept units of the whole
            mini-batch (summed over micro-batches and DP ranks before the schedule; see
            :func:`tis_batch_stats`), so that they average to 1. Needs ``tis_cap``; refused in
            bypass mode (the weights would depend on parameters known only in the forward pass).
        reject_seq_k2, reject_seq_k3: reject a sequence whose mean over its valid tokens of
            ``d^2 / 2`` (k2), resp. ``exp(d) - 1 - d`` (k3, an estimate of
            ``KL(pi_rollout || pi_train)``), exceeds the threshold, ``d = logp_train - logp_rollout``
            clamped to ``±log_ratio_clamp`` (see :mod:`fnppo.core.rollout_correction`). ``None``: off.
        reject_seq_mean_log_ratio: ``(low, high)``: reject a sequence whose mean ``d`` lies outside
            ``[low, high]`` (log of the geometric-mean ratio). ``None``: off.
        reject_seq_max_abs_log_ratio: reject a sequence with ``max_t |d_t|`` above it. ``None``: off.
            Each ``reject_seq_*`` criterion fires strictly above its threshold (resp. strictly
            outside ``[low, high]``): a statistic exactly at the threshold keeps its sequence.
            Rejected sequences leave every numerator and stay in the denominator (as
            ``tis_reject_*``); metrics ``rollout_rejected_frac`` and ``<field>_frac``.
    """

    policy_loss: str = "ppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    tis_cap: float | None = None
    tis_level: str = "token"
    tis_reject_low: float | None = None
    tis_reject_high: float | None = None
    tis_reject_level: str | None = None
    log_ratio_clamp: float = 20.0
    cispo_clip_low: float = 1.0
    cispo_clip_high: float = 0.28
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 1.0
    bypass_old_logprobs: bool = False
    tis_batch_normalize: bool = False
    reject_seq_k2: float | None = None
    reject_seq_k3: float | None = None
    reject_seq_mean_log_ratio: tuple[float, float] | None = None
    reject_seq_max_abs_log_ratio: float | None = None

    def __post_init__(self) -> None:
        fn = "fnppo.PolicyLossConfig"
        check_bool_fields(fn, self)

        def need(ok: bool, arg: str, expected: str) -> None:
            if not ok:
                raise input_error(fn, arg, expected, repr(getattr(self, arg)))

        def num(arg: str) -> bool:
            return _is_number(getattr(self, arg))

        need(isinstance(self.policy_loss, str) and self.policy_loss in _POLICY_LOSSES, "policy_loss",
             f"one of {sorted(_POLICY_LOSSES)} (register custom losses first)")
        for arg in ("clip_ratio_low", "clip_ratio_high"):
            need(num(arg) and getattr(self, arg) >= 0, arg, "a finite number >= 0")
        need(self.clip_ratio_c is None or (num("clip_ratio_c") and self.clip_ratio_c > 1), "clip_ratio_c",
             "a number > 1 or None")
        _check_agg_mode(fn, self.loss_agg_mode, self.loss_scale_factor, stray_scale_ok=False)
        for arg in ("entropy_coeff", "kl_coef"):
            need(num(arg) and getattr(self, arg) >= 0, arg, "a finite number >= 0")
        need(self.kl_estimator in KL_ESTIMATORS, "kl_estimator", f"one of {list(KL_ESTIMATORS)}")
        check_weight_rules(fn, lambda name: getattr(self, name if name == "log_ratio_clamp" else "tis_" + name), "tis_")
        need(num("cispo_clip_low") and 0 <= self.cispo_clip_low <= 1, "cispo_clip_low", "a number in [0, 1]")
        need(num("cispo_clip_high") and self.cispo_clip_high >= 0, "cispo_clip_high", "a number >= 0")
        for arg in ("sapo_tau_pos", "sapo_tau_neg"):
            need(num(arg) and getattr(self, arg) > 0, arg, "a number > 0")
        for arg in ("clip_cov_ratio", "kl_cov_ratio"):
            need(num(arg) and 0 <= getattr(self, arg) <= 1, arg, "a number in [0, 1]")
        need(num("clip_cov_lb"), "clip_cov_lb", "a finite number")
        need(num("clip_cov_ub") and self.clip_cov_ub > self.clip_cov_lb, "clip_cov_ub",
             f"a number > clip_cov_lb={self.clip_cov_lb!r}")
        need(num("kl_cov_coef") and self.kl_cov_coef >= 0, "kl_cov_coef", "a number >= 0")
        self._check_rollout_correction(fn, need)

    def _check_rollout_correction(self, fn: str, need: Any) -> None:
        """The bypass, batch-normalization and sequence-rejection fields, and how they combine."""
        bounds = check_seq_rejection(fn, lambda arg: getattr(self, arg))
        object.__setattr__(self, "reject_seq_mean_log_ratio", bounds)  # a list becomes a tuple
        if self.bypass_old_logprobs and self.policy_loss not in _RATIO_FREE:
            need(self.tis_cap is None, "tis_cap",
                 f"None with bypass_old_logprobs=True and the ratio-based policy loss {self.policy_loss!r} "
                 "(its ratio pi_theta / pi_rollout already is the importance weight)")
        if self.tis_batch_normalize:
            need(self.tis_cap is not None, "tis_cap", "a number > 0 since tis_batch_normalize=True")
            need(not self.bypass_old_logprobs, "tis_batch_normalize",
                 "False with bypass_old_logprobs=True (the weights would depend on the current parameters, "
                 "known only in the forward pass)")

    @property
    def tis_active(self) -> bool:
        """Whether importance weights / rejection against the rollout log-probs are applied."""
        return (self.tis_cap is not None or self.tis_reject_low is not None or self.tis_reject_high is not None
                or any(getattr(self, name) is not None for name in SEQ_REJECTION_CRITERIA))



# =============================================================================================
# KL estimators
# =============================================================================================
@typechecked
def kl_penalty(logprobs: TokenFloat, ref_logprobs: TokenFloat, estimator: str = "k3", *,
               log_ratio_clamp: float = 20.0) -> TokenFloat:
    """Per-token estimate of ``KL(policy || ref)`` from samples of the policy.

    With ``d = logp - logp_ref`` (clamped to ``[-log_ratio_clamp, log_ratio_clamp]``):

    * ``k1``: ``d`` (unbiased, high variance, can be negative);
    * ``k2`` / ``mse``: ``d^2 / 2``;
    * ``k3`` / ``low_var_kl``: ``exp(-d) - 1 + d`` (unbiased, >= 0, low variance);
    * ``abs``: ``|d|``.

    A trailing ``"+"`` (``"k1+"``, ``"k3+"``, ...) gives the straight-through variant: the value of
    the estimator with the gradient of k2, ``k2 + sg(k - k2)`` (whose gradient ``d * grad logp`` is
    an unbiased gradient of the KL).

    Reference: J. Schulman, "Approximating KL divergence" (2020), http://joschu.net/blog/kl-approx.html.

    Args:
        logprobs: ``[*tok]`` log-probs of the policy (carry the gradient).
        ref_logprobs: ``[*tok]`` log-probs of the reference policy.
        estimator: one of :data:`KL_ESTIMATORS`.
        log_ratio_clamp: bound of ``|d|`` (keeps ``exp`` finite), a finite number > 0. A ``|d|``
            exactly at the bound is kept as it is, with its gradient.

    Returns:
        ``[*tok]`` per-token estimates in the inputs' dtype.

    Raises:
        InputError: an unknown ``estimator``; a ``log_ratio_clamp`` that is not a finite number > 0.
    """
    if estimator not in KL_ESTIMATORS:
        raise input_error("fnppo.kl_penalty", "estimator", f"one of {list(KL_ESTIMATORS)}", repr(estimator))
    if not (_is_number(log_ratio_clamp) and log_ratio_clamp > 0):
        raise input_error("fnppo.kl_penalty", "log_ratio_clamp", "a number > 0", repr(log_ratio_clamp))
    straight_through = estimator.endswith("+")
    base = _KL_BASE[estimator.rstrip("+")]
    d = torch.clamp(logprobs - ref_logprobs, -log_ratio_clamp, log_ratio_clamp)
    if base == "k1":
        kl = d
    elif base == "k2":
        kl = 0.5 * d * d
    elif base == "k3":
        kl = torch.exp(-d) - 1.0 + d
    else:
        kl = d.abs()
    if straight_through:
        k2 = 0.5 * d * d
        kl = k2 + (kl - k2).detach()
    return kl



# =============================================================================================
# Rollout correction (truncated importance sampling, rejection, batch normalization)
# =============================================================================================
@typechecked
def compute_tis_weights(old_logprobs: PaddedFloat, rollout_logprobs: PaddedFloat, loss_mask: PaddedMask, *,
                        cap: float | None, level: str = "token", reject_low: float | None = None,
                        reject_high: float | None = None, reject_level: str | None = None,
                        seq_ids: Integer[Tensor, "batch seq"] | None = None,
                        log_ratio_clamp: float = 20.0,
                        reject_seq_k2: float | None = None, reject_seq_k3: float | None = None,
                        reject_seq_mean_log_ratio: tuple[float, float] | None = None,
                        reject_seq_max_abs_log_ratio: float | None = None,
                        batch_normalize: bool = False,
                        tis_mean: float | int | Shaped[Tensor, ""] | None = None) -> TISWeights:
    """Truncated importance weights and rejection correcting for the rollout engine's sampling.

    Token level: ``w_t = exp(logp_old_t - logp_rollout_t)``; sequence level:
    ``w_i = exp(sum_t (logp_old_t - logp_rollout_t))`` (valid tokens of sequence i, broadcast to its
    tokens). Log-weights are clamped to ``[-log_ratio_clamp, log_ratio_clamp]``. The applied weight
    is ``min(w, cap)``, detached (``cap=None``: weight 1, only rejection); a weight exactly equal to
    ``cap`` is not counted in ``tis_truncated_frac``. Optional rejection (at ``reject_level``,
    default ``level``): tokens or sequences whose untruncated weight is outside the closed interval
    ``[reject_low, reject_high]`` get weight 0 and ``keep`` 0 (a weight exactly on a bound is kept:
    on-policy data, ``w = 1`` exactly, is kept with ``reject_low=1``); so do sequences rejected by
    the ``reject_seq_*`` criteria (k2, k3, mean and max-abs of the clamped log-ratio ``d``, see
    :mod:`fnppo.core.rollout_correction`; each fires strictly above its threshold, resp. strictly
    outside its closed interval). ``batch_normalize``: the kept weights are divided by
    ``tis_mean`` (the global mean from :func:`tis_batch_stats`; None: their mean in this call).

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
            in :class:`PolicyLossConfig`.
        batch_normalize, tis_mean: see above; ``tis_mean`` needs ``batch_normalize``.

    Returns:
        :class:`TISWeights` ``(weights, keep, metrics)``.

    Raises:
        InputError: the rule of :class:`PolicyLossConfig` for its ``tis_*`` fields, applied to the
            arguments of the same name: a ``cap`` or ``reject_high`` that is not a finite number > 0,
            a ``reject_low`` that is not a finite number >= 0, ``reject_low >= reject_high`` (named
            ``reject_high``), an unknown ``level`` / ``reject_level``, a ``log_ratio_clamp`` that
            is not a finite number > 0; a bad ``reject_seq_*`` criterion; ``tis_mean`` without
            ``batch_normalize``; with checking on, a mask that is not 0/1, NaN/inf at valid
            positions (values where ``loss_mask`` is 0 are never read), ``seq_ids`` out of range,
            a negative or non-finite ``tis_mean``.
    """
    fn = "fnppo.compute_tis_weights"
    rules = {"cap": cap, "level": level, "reject_low": reject_low, "reject_high": reject_high,
             "reject_level": reject_level, "log_ratio_clamp": log_ratio_clamp}
    check_weight_rules(fn, rules.__getitem__)
    given = {"reject_seq_k2": reject_seq_k2, "reject_seq_k3": reject_seq_k3,
             "reject_seq_mean_log_ratio": reject_seq_mean_log_ratio,
             "reject_seq_max_abs_log_ratio": reject_seq_max_abs_log_ratio}
    bounds = check_seq_rejection(fn, given.__getitem__)
    if tis_mean is not None and not batch_normalize:
        raise input_error(fn, "tis_mean", "None since batch_normalize=False", _describe_value(tis_mean))
    if typechecking_enabled():
        _validate(fn, loss_mask, {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs}, None, seq_ids,
                  tis_mean=tis_mean)
    rules = Rules(cap, level, reject_low, reject_high, level if reject_level is None else reject_level,
                  reject_seq_k2, reject_seq_k3, bounds, reject_seq_max_abs_log_ratio, batch_normalize, log_ratio_clamp)
    return correction(old_logprobs, rollout_logprobs, loss_mask != 0, segments(loss_mask.shape, seq_ids), rules,
                      tis_mean)[0]


@typechecked
def tis_batch_stats(old_logprobs: PaddedFloat, rollout_logprobs: PaddedFloat, loss_mask: PaddedMask,
                    config: PolicyLossConfig, *, seq_ids: Integer[Tensor, "batch seq"] | None = None) -> Tensor:
    """``(sum of the TIS weights, number of units)`` over the kept units of one micro-batch.

    The units are those of ``config.tis_level``: kept tokens, or sequences with at least one kept
    token (rejected units, by ``tis_reject_*`` or ``reject_seq_*``, are excluded); the weights are
    ``min(w, tis_cap)`` before normalization. Sum the pairs over all micro-batches and
    data-parallel ranks of a mini-batch and pass ``tis_mean = sum / count`` to :func:`ppo_loss`
    (``tis_batch_normalize=True``): every weight is then divided by the exact mean of the whole
    mini-batch, whatever the split. :func:`fnppo.train_step` does this together with the loss
    normalizer (one all-reduce). The same pair is reported as the metric ``tis_batch_mean``.

    Reference: batch-normalized IS weights as in verl's ``rollout_is_batch_normalize`` (there over
    all valid units); TIS: Yao et al. (2025).

    Args:
        old_logprobs, rollout_logprobs, loss_mask: as in :func:`compute_tis_weights`.
        config: the :class:`PolicyLossConfig` of the loss (its TIS and rejection settings).
        seq_ids: packed layout: per-token sequence index, -1 for no sequence.

    Returns:
        ``[2]`` tensor in ``promote_types(dtype, fp32)``, detached.

    Raises:
        InputError: a config in bypass mode (its weights need the current policy); with checking
            on, as :func:`compute_tis_weights`.
    """
    fn = "fnppo.tis_batch_stats"
    if config.bypass_old_logprobs:
        raise input_error(fn, "config", "a PolicyLossConfig without bypass_old_logprobs (the weights would need the "
                          "current policy's log-probs)", "bypass_old_logprobs=True")
    if typechecking_enabled():
        _validate(fn, loss_mask, {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs}, None, seq_ids)
    rules = Rules.of(config)._replace(normalize=False)
    return correction(old_logprobs, rollout_logprobs, loss_mask != 0, segments(loss_mask.shape, seq_ids), rules)[1]


# =============================================================================================
# Aggregation
# =============================================================================================
def _agg_weights(mf: Tensor, seg: Segments, mode: str, scale: float | None) -> tuple[Tensor, Tensor]:
    """Per-token aggregation weights ``w`` and the local denominator, so that
    ``loss = sum(l * w) / denominator`` (denominator summed over micro-batches when split)."""
    if mode == "token-mean":
        return mf, mf.sum()
    count = seg.sum(mf)
    n_seq = (count > 0).to(mf.dtype).sum()
    if mode == "seq-mean-token-sum":
        return mf, n_seq
    if mode == "seq-mean-token-mean":
        inv = 1.0 / torch.where(count > 0, count, torch.ones_like(count))
        return mf * seg.gather(inv, mf), n_seq
    return mf / scale, n_seq  # seq-mean-token-sum-norm (modes are checked where they enter)


def _check_agg_mode(fn: str, mode: Any, scale: Any, *, stray_scale_ok: bool) -> None:
    """``mode`` is one of :data:`LOSS_AGG_MODES` and ``scale`` fits it (the one home of this check).

    ``seq-mean-token-sum-norm`` needs a constant ``scale > 0``; the other modes take ``None``
    (``stray_scale_ok``: a scale given with another mode is ignored instead of refused).

    Raises:
        InputError: naming ``loss_agg_mode`` or ``loss_scale_factor``.
    """
    if mode not in LOSS_AGG_MODES:
        raise input_error(fn, "loss_agg_mode", f"one of {list(LOSS_AGG_MODES)}", repr(mode))
    if mode == "seq-mean-token-sum-norm":
        if not (_is_number(scale) and scale > 0):
            raise input_error(fn, "loss_scale_factor",
                              "a number > 0 (the constant C of 'seq-mean-token-sum-norm', e.g. the max response length)",
                              repr(scale))
    elif scale is not None and not stray_scale_ok:
        raise input_error(fn, "loss_scale_factor", "None unless loss_agg_mode='seq-mean-token-sum-norm'", repr(scale))


def _mode_and_scale(config: PolicyLossConfig | str, scale: float | None, fn: str) -> tuple[str, float | None]:
    """``(loss_agg_mode, loss_scale_factor)`` of a config (validated when built) or a checked mode name."""
    if isinstance(config, PolicyLossConfig):
        return config.loss_agg_mode, config.loss_scale_factor
    _check_agg_mode(fn, config, scale, stray_scale_ok=True)
    return config, scale


@typechecked
def loss_normalizer(loss_mask: PaddedMask, config: PolicyLossConfig | str, *,
                    seq_ids: Integer[Tensor, "batch seq"] | None = None) -> Scalar:
    """The local denominator of ``loss_agg_mode`` for one micro-batch (0-dim fp32).

    ``token-mean``: the number of valid tokens (``loss_mask == 1``); the ``seq-mean-*`` modes: the
    number of valid sequences (sequences with at least one valid token). Sum it over all
    micro-batches and data-parallel ranks of the step and pass the sum as ``normalizer`` to
    :func:`ppo_loss` / :func:`value_loss`, which makes the sum of micro-batch losses the full-batch
    loss (see :func:`ppo_loss` for the modes and their papers).

    Args:
        loss_mask: ``[batch, seq]`` 0/1 mask.
        config: a :class:`PolicyLossConfig` or a mode name of :data:`LOSS_AGG_MODES`.
        seq_ids: packed layout: per-token sequence index, -1 for no sequence.

    Returns:
        The 0-dim fp32 count.

    Raises:
        InputError: an unknown mode name.
    """
    mode, scale = _mode_and_scale(config, 1.0, "fnppo.loss_normalizer")
    mf = (loss_mask != 0).float()
    return _agg_weights(mf, segments(loss_mask.shape, seq_ids), mode, scale)[1].float()


def _denominator(normalizer: float | int | Tensor | None, local: Tensor) -> Tensor | float:
    """The divisor: ``normalizer`` (or the local count), with 0 replaced by 1 (no host sync)."""
    if normalizer is None:
        n = local
    elif isinstance(normalizer, Tensor):
        n = normalizer.to(device=local.device, dtype=local.dtype)
    else:
        return float(normalizer) if normalizer > 0 else 1.0
    return torch.where(n > 0, n, torch.ones_like(n))



# =============================================================================================
# Validation (one host sync)
# =============================================================================================
def _validate(fn: str, mask: Tensor, finite: dict[str, Tensor | None], normalizer: Any,
              seq_ids: Tensor | None, mask_name: str = "loss_mask", *, tis_mean: Any = None) -> None:
    m = mask != 0
    scalars = {name: v for name, v in (("normalizer", normalizer), ("tis_mean", tis_mean)) if v is not None}
    flags = []
    if mask.dtype != torch.bool:
        flags.append(((mask != 0) & (mask != 1)).any())
    for t in finite.values():
        if t is not None and t.is_floating_point():
            flags.append((~torch.isfinite(t) & m).any())
    for name, v in scalars.items():
        if isinstance(v, Tensor):
            flags.append(~torch.isfinite(v) | (v < 0))
        elif not (math.isfinite(v) and v >= 0):
            raise input_error(fn, name, "a finite number >= 0", repr(v))
    if seq_ids is not None:
        flags.append(((seq_ids < -1) | (seq_ids >= seq_ids.numel()) | ((seq_ids < 0) & m)).any())
    if not flags or not bool(torch.stack([f.reshape(()) for f in flags]).any()):
        return
    # Something is wrong: find it (slow path, may sync several times).
    check_mask01(fn, mask_name, mask)
    for name, t in finite.items():
        check_finite(fn, name, t, where=mask)
    for name, v in scalars.items():
        if isinstance(v, Tensor) and not bool(torch.isfinite(v) & (v >= 0)):
            raise input_error(fn, name, "a finite number >= 0", f"{describe(v)} = {v.item()!r}")
    if seq_ids is not None:
        lo, hi = int(seq_ids.min()), int(seq_ids.max())
        raise input_error(fn, "seq_ids", f"values in [-1, {seq_ids.numel()}) and >= 0 wherever {mask_name} is 1",
                          f"{describe(seq_ids)} with values in [{lo}, {hi}]")


def _describe_value(x: Any) -> str:
    return describe(x) if isinstance(x, Tensor) else repr(x)



# =============================================================================================
# The loss
# =============================================================================================
class _Tokens(NamedTuple):
    """The valid tokens of one loss call: masks in the compute dtype and the sequence grouping.

    The compute dtype is fp32, or fp64 when the inputs are fp64 (``promote_types(dtype, fp32)``).
    """

    m: Tensor  # bool, True on valid tokens
    mf: Tensor  # the same as 0/1 in the compute dtype
    zero: Tensor  # 0-dim zero in the compute dtype
    seg: Segments

    @classmethod
    def of(cls, like: Tensor, mask: Tensor, seq_ids: Tensor | None) -> _Tokens:
        dtype = torch.promote_types(like.dtype, torch.float32)
        m = mask != 0
        return cls(m, m.to(dtype), torch.zeros((), dtype=dtype, device=like.device), segments(mask.shape, seq_ids))

    def clean(self, t: Tensor, detach: bool) -> Tensor:
        """``t`` in the compute dtype, 0 wherever the mask is 0 (so NaN/inf there cannot leak)."""
        t = t.detach() if detach else t
        return torch.where(self.m, t.to(self.zero.dtype), self.zero)


def _check_non_empty(fn: str, arg: str, t: Tensor) -> None:
    """An empty ``[batch, seq]`` tensor has no loss: refuse it (the one home of this check)."""
    if t.numel() == 0:
        raise input_error(fn, arg, "a non-empty [batch, seq] tensor (an empty batch has no loss)", describe(t))


def _check_loss_inputs(fn: str, config: PolicyLossConfig, old_logprobs: Tensor | None, entropy: Tensor | None,
                       ref_logprobs: Tensor | None, rollout_logprobs: Tensor | None, tis_mean: Any) -> None:
    """The optional inputs that ``config`` needs are given (and ``tis_mean`` only when it is used)."""
    if old_logprobs is None and not config.bypass_old_logprobs:
        raise input_error(fn, "old_logprobs", "a tensor (or PolicyLossConfig.bypass_old_logprobs=True)", "None")
    if config.entropy_coeff != 0 and entropy is None:
        raise input_error(fn, "entropy", f"a tensor since entropy_coeff={config.entropy_coeff!r}", "None")
    if config.kl_coef != 0 and ref_logprobs is None:
        raise input_error(fn, "ref_logprobs", f"a tensor since kl_coef={config.kl_coef!r}", "None")
    if config.bypass_old_logprobs and rollout_logprobs is None:
        raise input_error(fn, "rollout_logprobs", "a tensor since bypass_old_logprobs=True (they are the old log-probs)",
                          "None")
    if config.tis_active and rollout_logprobs is None:
        raise input_error(fn, "rollout_logprobs", "a tensor since rollout correction (tis_cap / tis_reject_* / "
                          "reject_seq_*) is configured", "None")
    if tis_mean is not None and not config.tis_batch_normalize:
        raise input_error(fn, "tis_mean", "None since tis_batch_normalize=False", _describe_value(tis_mean))


def _policy_term(fn: str, config: PolicyLossConfig, x: PolicyLossInputs, tok: _Tokens) -> tuple[Tensor, dict[str, Tensor]]:
    """The registered policy loss per token (0 off the mask) and its metrics; checks its output shape."""
    pg_tok, extra = get_policy_loss(config.policy_loss)(x)
    if not isinstance(pg_tok, Tensor) or pg_tok.shape != x.logprobs.shape:
        raise input_error(fn, f"policy loss {config.policy_loss!r}", f"a per-token loss of shape {tuple(x.logprobs.shape)}",
                          describe(pg_tok))
    return torch.where(tok.m, pg_tok.to(tok.zero.dtype), tok.zero), extra


def _importance(config: PolicyLossConfig, train: Tensor, rollout_logprobs: Tensor | None, tok: _Tokens,
                metrics: dict[str, Tensor], tis_mean: Any) -> tuple[Tensor | None, Tensor]:
    """TIS weights (None without TIS) and the kept tokens; adds ``rollout_kl`` and the TIS metrics.

    ``train`` is the trainer side of the correction: the old log-probs, or ``sg(logp)`` in bypass mode.
    """
    if rollout_logprobs is None:
        return None, tok.mf
    rollout = tok.clean(rollout_logprobs, detach=True)
    metrics["rollout_kl"] = weighted_metric(rollout - train, tok.mf)
    if not config.tis_active:
        return None, tok.mf
    tis, _ = correction(train, rollout, tok.m, tok.seg, Rules.of(config), tis_mean)
    metrics.update(tis.metrics)
    return tis.weights.to(tok.mf.dtype), tis.keep.to(tok.mf.dtype)


def _add_regularizers(total_num: Tensor, config: PolicyLossConfig, lp: Tensor, entropy: Tensor | None,
                      ref_logprobs: Tensor | None, tok: _Tokens, term_w: Tensor, local_den: Tensor,
                      metrics: dict[str, Tensor]) -> Tensor:
    """``total_num - entropy_coeff * H + kl_coef * KL`` (numerators); adds ``entropy`` / ``kl_loss``."""
    if entropy is not None:
        ent_num = (tok.clean(entropy, detach=config.entropy_coeff == 0) * term_w).sum()
        metrics["entropy"] = pair_metric(ent_num, local_den)
        if config.entropy_coeff != 0:
            total_num = total_num - config.entropy_coeff * ent_num
    if ref_logprobs is not None:
        kl_tok = kl_penalty(lp if config.kl_coef != 0 else lp.detach(), tok.clean(ref_logprobs, detach=True),
                            config.kl_estimator,
                            log_ratio_clamp=config.log_ratio_clamp)
        kl_num = (torch.where(tok.m, kl_tok, tok.zero) * term_w).sum()
        metrics["kl_loss"] = pair_metric(kl_num, local_den)
        if config.kl_coef != 0:
            total_num = total_num + config.kl_coef * kl_num
    return total_num


@typechecked
def ppo_loss(
    logprobs: PaddedFloat,
    old_logprobs: PaddedFloat | None,
    advantages: PaddedFloat,
    loss_mask: PaddedMask,
    config: PolicyLossConfig,
    *,
    entropy: PaddedFloat | None = None,
    ref_logprobs: PaddedFloat | None = None,
    rollout_logprobs: PaddedFloat | None = None,
    normalizer: float | int | Shaped[Tensor, ""] | None = None,
    seq_ids: Integer[Tensor, "batch seq"] | None = None,
    generator: torch.Generator | None = None,
    tis_mean: float | int | Shaped[Tensor, ""] | None = None,
) -> tuple[Scalar, dict[str, Tensor]]:
    """Policy loss + entropy bonus + KL penalty, aggregated with ``config.loss_agg_mode``.

    Per token: ``l_t = w^TIS_t * pg_t - entropy_coeff * H_t + kl_coef * KL_t`` where ``pg_t`` is the
    registered policy loss ``config.policy_loss``, ``w^TIS`` the truncated importance weight
    (:func:`compute_tis_weights`, when ``config.tis_cap``, a rejection bound or a ``reject_seq_*``
    criterion is set; rejected tokens drop out of all three terms but stay in ``N``; with
    ``tis_batch_normalize`` divided by ``tis_mean``) and ``KL_t = kl_penalty(logprobs, ref_logprobs,
    kl_estimator)``. The scalar loss is ``sum_t a_t l_t / N`` with, over valid tokens
    (``loss_mask == 1``) and sequences i (rows, or ``seq_ids`` groups):

    * ``token-mean``: ``a_t = 1``, ``N`` = number of valid tokens (DAPO, arXiv:2503.14476);
    * ``seq-mean-token-sum``: ``a_t = 1``, ``N`` = number of valid sequences;
    * ``seq-mean-token-mean``: ``a_t = 1 / |i|`` (valid tokens of t's sequence), ``N`` = number of
      valid sequences (GRPO, arXiv:2402.03300);
    * ``seq-mean-token-sum-norm``: ``a_t = 1 / C`` with the constant ``C = loss_scale_factor``,
      ``N`` = number of valid sequences (Dr. GRPO, arXiv:2503.20783).

    ``N`` is ``normalizer`` when given (the step-wide sum of :func:`loss_normalizer`, which makes
    the sum of micro-batch losses equal the full-batch loss), else the local count. ``N = 0`` (no
    valid token anywhere) gives a loss of exactly 0 with zero gradient. ``logprobs`` itself is not
    checked for NaN/inf: it is the model's output, and a non-finite loss makes
    :func:`fnppo.train_step` skip the update. Positions where ``loss_mask`` is 0 are never read, in
    any argument, whatever the policy loss and layout: NaN or inf there leaves the loss, the
    gradient and the metrics unchanged.

    Bypass mode (``config.bypass_old_logprobs``): ``rollout_logprobs`` replace ``old_logprobs``
    (which may be None and are ignored), so every ratio is ``pi_theta / pi_rollout``, and the
    rollout correction compares ``sg(logprobs)`` with ``rollout_logprobs``.

    Reference: PPO, arXiv:1707.06347 (the policy losses cite their own papers, see
    :mod:`fnppo.core.policy_losses`; rollout correction: :mod:`fnppo.core.rollout_correction`).

    Args:
        logprobs: ``[batch, seq]`` log-probs of the current policy (carries the gradient).
        old_logprobs: log-probs of the policy that generated the data (recomputed by the trainer);
            None (ignored) in bypass mode.
        advantages: per-token advantages.
        loss_mask: 0/1 mask of the trained tokens (bool, int or float).
        config: :class:`PolicyLossConfig`.
        entropy: per-token entropy (differentiated); needed when ``entropy_coeff != 0``.
        ref_logprobs: reference-policy log-probs; needed when ``kl_coef != 0``.
        rollout_logprobs: the rollout engine's log-probs; needed when TIS is configured. When
            given, ``rollout_kl`` (``mean(logp_rollout - logp_old)``) is reported.
        normalizer: the global denominator (see above).
        seq_ids: packed layout: per-token sequence index within the micro-batch, -1 for no sequence.
        generator: RNG for randomized losses (``clip_cov``).
        tis_mean: with ``tis_batch_normalize``: the global mean TIS weight (the pairs of
            :func:`tis_batch_stats` summed over the step, ``sum / count``); None: the mean of this
            call. A mean of 0 (no kept unit anywhere) divides by 1.

    Returns:
        ``(loss, metrics)``: the 0-dim loss and ``dict[str, Tensor]`` of detached ``[2]`` metrics
        (see the module docstring): ``loss``, ``pg_loss``, ``ppo_kl`` (``mean(logp_old - logp)``),
        ``pg_clipfrac``, ``pg_clipfrac_lower``, ``entropy`` / ``kl_loss`` (when given), the TIS
        metrics (and ``tis_batch_mean``, ``rollout_rejected_frac``, ``reject_seq_*_frac`` when
        configured), plus whatever the policy loss reports.

    Raises:
        ShapeError: shapes or dtypes that disagree (call-time check).
        InputError: an empty batch; an input the config needs left out (``old_logprobs`` outside
            bypass mode, ``rollout_logprobs`` in it); ``tis_mean`` without
            ``tis_batch_normalize``; with checking on, a mask that is not 0/1, NaN/inf in
            ``advantages``, ``old_logprobs``, ``ref_logprobs`` or ``rollout_logprobs`` at positions
            where ``loss_mask`` is 1 (only there), ``seq_ids`` out of range, a negative or
            non-finite ``normalizer`` or ``tis_mean``; a policy loss whose output is not per-token.
    """
    fn = "fnppo.ppo_loss"
    _check_non_empty(fn, "logprobs", logprobs)
    bypass = config.bypass_old_logprobs
    _check_loss_inputs(fn, config, old_logprobs, entropy, ref_logprobs, rollout_logprobs, tis_mean)
    if typechecking_enabled():
        _validate(fn, loss_mask, {"advantages": advantages, "old_logprobs": None if bypass else old_logprobs,
                                  "ref_logprobs": ref_logprobs, "rollout_logprobs": rollout_logprobs},
                  normalizer, seq_ids, tis_mean=tis_mean)
    tok = _Tokens.of(logprobs, loss_mask, seq_ids)
    lp = tok.clean(logprobs, detach=False)
    old = tok.clean(rollout_logprobs if bypass else old_logprobs, detach=True)
    inputs = PolicyLossInputs(lp, old, tok.clean(advantages, detach=True), tok.mf, config, tok.seg, generator)
    pg_tok, extra = _policy_term(fn, config, inputs, tok)
    metrics: dict[str, Tensor] = {}
    tis_w, keep = _importance(config, lp.detach() if bypass else old, rollout_logprobs, tok, metrics, tis_mean)
    if tis_w is not None:
        pg_tok = pg_tok * tis_w
    agg_w, local_den = _agg_weights(tok.mf, tok.seg, config.loss_agg_mode, config.loss_scale_factor)
    pg_num = (pg_tok * agg_w).sum()
    metrics["pg_loss"] = pair_metric(pg_num, local_den)
    total_num = _add_regularizers(pg_num, config, lp, entropy, ref_logprobs, tok, agg_w * keep, local_den, metrics)
    loss = total_num / _denominator(normalizer, local_den)
    metrics["loss"] = pair_metric(total_num, local_den)
    metrics["ppo_kl"] = weighted_metric(old - lp, tok.mf)
    for key in ("pg_clipfrac", "pg_clipfrac_lower"):
        metrics.setdefault(key, pair_metric(tok.zero, tok.mf.sum()))
    for key, value in extra.items():
        metrics[key] = value.detach().float()
    return loss, metrics


# =============================================================================================
# Value loss
# =============================================================================================
def _check_value_clip(fn: str, clip_range: Any) -> None:
    """``clip_range`` is a number >= 0 or None (the one home of this check)."""
    if clip_range is not None and not (_is_number(clip_range) and clip_range >= 0):
        raise input_error(fn, "clip_range", "a number >= 0 or None", repr(clip_range))


@dataclass(frozen=True)
class ValueLossConfig:
    """Configuration of the critic's :func:`value_loss` in :func:`fnppo.critic_step`. Frozen; validated when built.

    Attributes:
        clip_range: value clipping around the rollout-time values, ``>= 0``; ``None``: no clipping
            (then the samples need no ``values``).
        loss_agg_mode, loss_scale_factor: as in :class:`PolicyLossConfig`.
    """

    clip_range: float | None = 0.2
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None

    def __post_init__(self) -> None:
        fn = "fnppo.ValueLossConfig"
        _check_value_clip(fn, self.clip_range)
        _check_agg_mode(fn, self.loss_agg_mode, self.loss_scale_factor, stray_scale_ok=False)


@typechecked
def value_loss(
    values: PaddedFloat,
    old_values: PaddedFloat,
    returns: PaddedFloat,
    mask: PaddedMask,
    clip_range: float | None = 0.2,
    *,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    normalizer: float | int | Shaped[Tensor, ""] | None = None,
    seq_ids: Integer[Tensor, "batch seq"] | None = None,
) -> tuple[Scalar, dict[str, Tensor]]:
    """Clipped value loss of PPO with a critic.

    With ``d = V - old_V``: where ``|d| > clip_range`` (the clip is active),
    ``V_clip = old_V + clip(d, -clip_range, clip_range)``, elsewhere ``V_clip = V`` exactly; per
    token ``l_t = 1/2 max((V - R)^2, (V_clip - R)^2)`` (``clip_range=None``: ``1/2 (V - R)^2``),
    aggregated like :func:`ppo_loss` (``loss_agg_mode``, ``normalizer``, ``seq_ids``). Taking
    ``V_clip = V`` inside the clip range keeps fp32 rounding of ``old_V + d`` from ever choosing
    the clipped branch there, so ``vf_clipfrac`` counts exactly the tokens whose loss is the
    clipped term (the tokens with zero gradient).

    Reference: PPO, arXiv:1707.06347 (value clipping as in the OpenAI baselines implementation);
    explained variance ``1 - Var(R - V) / Var(R)`` as reported by baselines.

    Args:
        values: ``[batch, seq]`` predicted values (carry the gradient).
        old_values, returns: the values at rollout time and the targets (detached).
        mask: 0/1 mask of the trained tokens.
        clip_range: ``>= 0``, or ``None`` for no clipping.
        loss_agg_mode, loss_scale_factor: as in :class:`PolicyLossConfig`.
        normalizer, seq_ids: as in :func:`ppo_loss`.

    Returns:
        ``(loss, metrics)`` with ``vf_loss`` (numerator, local denominator), ``vf_clipfrac`` (the
        fraction of valid tokens whose loss is the clipped term), ``vpred_mean`` and the token means
        ``vf_returns``, ``vf_returns_sq``, ``vf_error``, ``vf_error_sq`` of ``R``, ``R^2``,
        ``R - V``, ``(R - V)^2``, from which :func:`~fnppo.core.metrics.finalize_metrics` derives the
        exact ``vf_explained_var`` of the whole step.

    Raises:
        InputError: an empty batch, a bad ``clip_range`` or mode; with checking on, as
            :func:`ppo_loss` for the mask, NaN/inf (in ``values``, ``old_values``, ``returns``
            where ``mask`` is 1; other positions are never read), ``seq_ids`` and ``normalizer``.
    """
    fn = "fnppo.value_loss"
    _check_non_empty(fn, "values", values)
    _check_value_clip(fn, clip_range)
    mode, scale = _mode_and_scale(loss_agg_mode, loss_scale_factor, fn)
    if typechecking_enabled():
        _validate(fn, mask, {"values": values, "old_values": old_values, "returns": returns}, normalizer, seq_ids,
                  mask_name="mask")
    tok = _Tokens.of(values, mask, seq_ids)
    v, old, ret = tok.clean(values, detach=False), tok.clean(old_values, detach=True), tok.clean(returns, detach=True)
    l1 = (v - ret) ** 2
    if clip_range is None:
        per_tok, clipped = 0.5 * l1, torch.zeros_like(tok.m)
    else:
        d = v - old
        active = d.abs() > clip_range
        v_clip = torch.where(active, old + torch.clamp(d, -clip_range, clip_range), v)
        l2 = (v_clip - ret) ** 2
        clipped = active & (l2 > l1)
        per_tok = 0.5 * torch.where(clipped, l2, l1)
    agg_w, local_den = _agg_weights(tok.mf, tok.seg, mode, scale)
    num = (per_tok * agg_w).sum()
    loss = num / _denominator(normalizer, local_den)
    err = (ret - v).detach()
    return loss, {"vf_loss": pair_metric(num, local_den), "vf_clipfrac": weighted_metric(clipped.to(tok.mf.dtype), tok.mf),
                  "vpred_mean": weighted_metric(v, tok.mf), "vf_returns": weighted_metric(ret, tok.mf),
                  "vf_returns_sq": weighted_metric(ret * ret, tok.mf), "vf_error": weighted_metric(err, tok.mf),
                  "vf_error_sq": weighted_metric(err * err, tok.mf)}
