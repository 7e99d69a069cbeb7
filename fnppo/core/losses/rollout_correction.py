"""Rollout correction: importance weights and rejection against the rollout engine (pure torch).

The rollout engine (vLLM, SGLang, ...) samples the responses with log-probs ``logp_rollout`` that
differ from the trainer's ``logp_train`` (other kernels, precision, MoE routing; or older
parameters with asynchronous rollouts). Per valid token of a sequence i, with

    d_t = clamp(logp_train_t - logp_rollout_t, -log_ratio_clamp, log_ratio_clamp),

where ``logp_train`` is the trainer's old log-probs (or, with ``bypass_old_logprobs``, the stopped
log-probs ``sg(logp)`` of the current policy), the corrections of a :class:`RolloutCorrection`
compose in this order:

1. **Importance weight** at ``level``: ``w_t = exp(d_t)`` (token) or ``w_i = exp(sum_t d_t)``
   (sequence), truncated from above, ``min(w, tis_cap)`` (TIS).
2. **Rejection on the weight**: units (tokens or sequences, ``reject_level``) whose untruncated
   weight lies outside ``[reject_low, reject_high]`` (masked IS, IcePop).
3. **Rejection on sequence statistics**: a sequence is rejected if any configured criterion fires
   (means over its valid tokens):

   * ``reject_seq_k2``: ``mean_t d_t^2 / 2 > threshold``;
   * ``reject_seq_k3``: ``mean_t (exp(d_t) - 1 - d_t) > threshold`` (k3 with samples from the
     rollout policy: an estimate of ``KL(pi_rollout || pi_train)``, >= 0);
   * ``reject_seq_mean_log_ratio = (low, high)``: ``mean_t d_t`` outside ``[low, high]`` (the log
     of the geometric-mean ratio);
   * ``reject_seq_max_abs_log_ratio``: ``max_t |d_t| > threshold``.

4. **Batch normalization** (``batch_normalize``): ``w~ = w / mean(w)``, the mean over the kept
   units (tokens, or sequences with at least one kept token) of the whole mini-batch: the pair
   ``(sum w, count)`` of every micro-batch is summed over micro-batches and data-parallel ranks
   before the schedule (:func:`fnppo.core.losses.rollout_weights.tis_batch_stats`, ``ppo_loss(..., tis_mean=)``).

Rejected tokens get weight 0 and leave the numerators of the policy, entropy and KL terms; they
stay in the loss denominator (a rejection never changes the scale of the other tokens' gradients).
Everything here is detached: the weights change the measure, not the objective.

Where fnppo deliberately differs from common practice (the table is ``docs/conventions.md``):

* rejected units stay in the denominator (verl removes them from the mask), for the reason above;
* the batch mean runs over the *kept* units only (a rejected unit's weight is never applied, so it
  does not set the scale; verl averages over all valid units), and over the mini-batch of one
  optimizer update, reduced exactly over micro-batches and DP ranks like the loss normalizer;
* k2 / k3 statistics are not capped; only ``d`` is clamped (to keep ``exp`` finite);
* bypass mode with a ratio-based loss refuses ``tis_cap`` instead of silently ignoring it, and
  refuses batch normalization (its weights would depend on the current parameters, known only
  inside each micro-batch's forward pass).

References: F. Yao et al. (2025), "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (TIS); J. Liu, Y. Li et al. (2025), "When Speed Kills Stability: Demystifying RL Collapse
from the Training-Inference Mismatch" (masked IS and rejection on sequence statistics,
https://richardli.xyz/rl-collapse); Ling Team (2025), "Every Step Evolves: Scaling Reinforcement
Learning for Trillion-Scale Thinking Model", arXiv:2510.18855 (IcePop: masking outside ``[a, b]``);
J. Schulman, "Approximating KL divergence" (2020) (k2, k3).

Here: :class:`RolloutCorrection` (the part ``LossConfig.correction`` holds, applied by
:func:`fnppo.core.losses.ppo.ppo_loss`), its checks, and :class:`Rules` (the settings of one call).
The computation is :mod:`fnppo.core.losses.rollout_weights`: :func:`~fnppo.core.losses.rollout_weights.compute_tis_weights`
(one micro-batch, validated), :func:`~fnppo.core.losses.rollout_weights.tis_batch_stats` (the local
``(sum, count)`` for batch normalization) and :func:`~fnppo.core.losses.rollout_weights.correction` (the
computation itself, trusting its inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from fnppo.core.errors import check_bool_fields
from fnppo.core.losses.checks import Checker, finite_number

__all__ = ["RolloutCorrection", "Rules", "TIS_LEVELS", "SEQ_REJECTION_CRITERIA"]

TIS_LEVELS = ("token", "sequence")
"""The levels of ``RolloutCorrection.level`` / ``reject_level``."""

SEQ_REJECTION_CRITERIA = ("reject_seq_k2", "reject_seq_k3", "reject_seq_mean_log_ratio", "reject_seq_max_abs_log_ratio")
"""The sequence-statistic rejection criteria (fields of :class:`RolloutCorrection`); each reports the
metric ``<name>_frac``."""


# =============================================================================================
# The rules, shared by RolloutCorrection, compute_tis_weights and from_flat (each names them its way)
# =============================================================================================
def check_weight_rules(c: Checker) -> None:
    """Check the importance-weight settings ``cap``, ``level``, ``reject_low``, ``reject_high`` and
    ``reject_level`` (rule names; ``c.label`` gives the names of the caller: ``tis_cap`` in
    :class:`RolloutCorrection`, ``tis_reject_low`` in ``from_flat``, ``cap`` in
    :func:`compute_tis_weights`). The one rule for all:

    * ``cap``: a finite number > 0 or None; ``level``: one of :data:`TIS_LEVELS`;
      ``reject_level``: one of them or None;
    * ``reject_low``: a finite number >= 0 or None; ``reject_high``: a finite number > 0 or None;
      both given: ``reject_low < reject_high`` (else every unit would be rejected, or, at equality,
      every unit whose weight is not exactly that number).

    Raises:
        InputError: naming the first value that breaks the rule (``reject_high`` for a pair out of order).
    """
    cap, low, high = c.get("cap"), c.get("reject_low"), c.get("reject_high")
    c.need(cap is None or (finite_number(cap) and cap > 0), "cap", "a number > 0 or None")
    c.need(c.get("level") in TIS_LEVELS, "level", f"one of {list(TIS_LEVELS)}")
    c.need(
        c.get("reject_level") is None or c.get("reject_level") in TIS_LEVELS,
        "reject_level",
        f"one of {list(TIS_LEVELS)} or None",
    )
    c.need(low is None or (finite_number(low) and low >= 0), "reject_low", "a number >= 0 or None")
    c.need(high is None or (finite_number(high) and high > 0), "reject_high", "a number > 0 or None")
    if low is not None and high is not None:
        c.need(low < high, "reject_high", f"a number > {c.label('reject_low')}={low!r}")


def check_clamp(c: Checker) -> None:
    """``log_ratio_clamp``: a finite number > 0."""
    c.number("log_ratio_clamp", 0, strict=True, expected="a number > 0")


def check_seq_rejection(c: Checker) -> tuple[float, float] | None:
    """Check the four ``reject_seq_*`` values; return the mean bounds as a tuple (or None).

    Raises:
        InputError: a threshold that is not a finite number > 0 (or None); mean bounds that are not
            two finite numbers ``low < high``.
    """
    for arg in ("reject_seq_k2", "reject_seq_k3", "reject_seq_max_abs_log_ratio"):
        value = c.get(arg)
        c.need(value is None or (finite_number(value) and value > 0), arg, "a finite number > 0 or None")
    bounds = c.get("reject_seq_mean_log_ratio")
    if bounds is None:
        return None
    ok = isinstance(bounds, (tuple, list)) and len(bounds) == 2 and all(finite_number(b) for b in bounds)
    c.need(
        ok and bounds[0] < bounds[1],
        "reject_seq_mean_log_ratio",
        "None or (low, high): two finite numbers with low < high",
    )
    return float(bounds[0]), float(bounds[1])


def check_correction(c: Checker) -> tuple[float, float] | None:
    """The rules of :class:`RolloutCorrection` (without the bool and non-empty checks); returns the
    mean bounds as a tuple. ``batch_normalize`` needs ``cap`` (the rule name of ``tis_cap``)."""
    check_weight_rules(c)
    bounds = check_seq_rejection(c)
    if c.get("batch_normalize"):
        c.need(c.get("cap") is not None, "cap", f"a number > 0 since {c.label('batch_normalize')}=True")
    return bounds


@dataclass(frozen=True)
class RolloutCorrection:
    """The rollout correction of the loss (``LossConfig.correction``). Frozen; validated when built.

    Attributes:
        tis_cap: truncation cap of the importance weight against the rollout engine's log-probs
            (Yao et al. 2025); ``None``: weight 1 (rejection only). Must be > 0. A weight exactly
            equal to the cap is not counted in ``tis_truncated_frac``.
        level: ``"token"`` (per-token weight) or ``"sequence"`` (product over the sequence).
        reject_low, reject_high: optional rejection bounds on the untruncated weight: tokens (or
            sequences) whose weight lies outside the closed interval ``[low, high]`` are dropped
            from the loss numerator (they still count in the denominator); a weight exactly on a
            bound is kept. ``None``: no bound. ``low >= 0``, ``high > 0``, ``low < high`` (the same
            rule as the arguments of :func:`compute_tis_weights`).
        reject_level: level of the rejection, ``"token"``, ``"sequence"``, or ``None`` (same as
            ``level``).
        batch_normalize: divide the weights by their mean over the kept units of the whole
            mini-batch (summed over micro-batches and DP ranks before the schedule; see
            :func:`tis_batch_stats`), so that they average to 1. Needs ``tis_cap``; refused in
            bypass mode (by ``LossConfig``: the weights would depend on parameters known only in
            the forward pass).
        reject_seq_k2, reject_seq_k3: reject a sequence whose mean over its valid tokens of
            ``d^2 / 2`` (k2), resp. ``exp(d) - 1 - d`` (k3, an estimate of
            ``KL(pi_rollout || pi_train)``), exceeds the threshold (see the module docstring).
            ``None``: off.
        reject_seq_mean_log_ratio: ``(low, high)``: reject a sequence whose mean ``d`` lies outside
            ``[low, high]`` (log of the geometric-mean ratio); a list becomes a tuple. ``None``: off.
        reject_seq_max_abs_log_ratio: reject a sequence with ``max_t |d_t|`` above it. ``None``: off.
            Each ``reject_seq_*`` criterion fires strictly above its threshold (resp. strictly
            outside ``[low, high]``): a statistic exactly at the threshold keeps its sequence.
            Rejected sequences leave every numerator and stay in the denominator (as
            ``reject_low/high``); metrics ``rollout_rejected_frac`` and ``<field>_frac``.
        m2_threshold: M2PO (:mod:`fnppo.core.losses.m2po`): reject the tokens with the largest ``d^2``
            until the mean ``d^2`` of the kept tokens of the *whole mini-batch* is below it (a
            cutoff the step computes over every micro-batch and data-parallel rank before the
            schedule, ``ppo_loss(m2_cutoff=...)``); rejected tokens leave the numerators and stay in
            the denominator; metric ``m2po_masked_frac``. ``None``: off. Refused in bypass mode
            (``d`` would depend on the current parameters).

    A correction always corrects something: at least one of ``tis_cap``, ``reject_low``,
    ``reject_high`` or a ``reject_seq_*`` criterion is set (no correction: ``LossConfig(correction=None)``).
    The loss then needs ``rollout_logprobs``.

    Raises:
        InputError: ``fnppo.losses.RolloutCorrection: argument '<field>' ...``: a value out of range
            (the rules of :func:`compute_tis_weights`), a non-bool ``batch_normalize``,
            ``batch_normalize`` without ``tis_cap``, nothing configured.
    """

    tis_cap: float | None = None
    level: str = "token"
    reject_low: float | None = None
    reject_high: float | None = None
    reject_level: str | None = None
    batch_normalize: bool = False
    reject_seq_k2: float | None = None
    reject_seq_k3: float | None = None
    reject_seq_mean_log_ratio: tuple[float, float] | None = None
    reject_seq_max_abs_log_ratio: float | None = None
    m2_threshold: float | None = None

    def __post_init__(self) -> None:
        fn = "fnppo.losses.RolloutCorrection"
        check_bool_fields(fn, self)
        name = {"cap": "tis_cap"}
        c = Checker(fn, lambda arg: getattr(self, name.get(arg, arg)), lambda arg: name.get(arg, arg))
        bounds = check_correction(c)
        object.__setattr__(self, "reject_seq_mean_log_ratio", bounds)  # a list becomes a tuple
        if self.m2_threshold is not None:
            c.number("m2_threshold", 0, strict=True, expected="a number > 0 or None")
        active = (
            self.tis_cap,
            self.reject_low,
            self.reject_high,
            self.m2_threshold,
            *(getattr(self, n) for n in SEQ_REJECTION_CRITERIA),
        )
        c.need(
            any(v is not None for v in active),
            "cap",
            "a number > 0, or one of reject_low, reject_high, reject_seq_* set (or m2_threshold; a correction without any: "
            "LossConfig(correction=None))",
        )

    @property
    def sequence_level(self) -> bool:
        """Whether the weights or the weight rejection act per sequence (``level`` or ``reject_level``
        is ``"sequence"``): the steps refuse it under context parallelism."""
        return "sequence" in (self.level, self.reject_level)


class Rules(NamedTuple):
    """The rollout-correction settings of one call (a :class:`RolloutCorrection` and the clamp)."""

    cap: float | None
    level: str = "token"
    reject_low: float | None = None
    reject_high: float | None = None
    reject_level: str = "token"
    seq_k2: float | None = None
    seq_k3: float | None = None
    seq_mean_log_ratio: tuple[float, float] | None = None
    seq_max_abs_log_ratio: float | None = None
    normalize: bool = False
    clamp: float = 20.0
    m2_threshold: float | None = None

    @classmethod
    def of(cls, corr: RolloutCorrection | None, clamp: float) -> Rules:
        """The rules of a correction (validated when it was built); None: weights 1, nothing rejected."""
        if corr is None:
            return cls(None, clamp=clamp)
        return cls(
            corr.tis_cap,
            corr.level,
            corr.reject_low,
            corr.reject_high,
            corr.reject_level or corr.level,
            corr.reject_seq_k2,
            corr.reject_seq_k3,
            corr.reject_seq_mean_log_ratio,
            corr.reject_seq_max_abs_log_ratio,
            corr.batch_normalize,
            clamp,
            corr.m2_threshold,
        )

    @property
    def seq_rules(self) -> bool:
        return any(
            v is not None for v in (self.seq_k2, self.seq_k3, self.seq_mean_log_ratio, self.seq_max_abs_log_ratio)
        )
