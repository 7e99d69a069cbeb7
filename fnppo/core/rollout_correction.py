"""Rollout correction: importance weights and rejection against the rollout engine (pure torch).

The rollout engine (vLLM, SGLang, ...) samples the responses with log-probs ``logp_rollout`` that
differ from the trainer's ``logp_train`` (other kernels, precision, MoE routing; or older
parameters with asynchronous rollouts). Per valid token of a sequence i, with

    d_t = clamp(logp_train_t - logp_rollout_t, -log_ratio_clamp, log_ratio_clamp),

where ``logp_train`` is the trainer's old log-probs (or, with ``bypass_old_logprobs``, the stopped
log-probs ``sg(logp)`` of the current policy), the corrections compose in this order:

1. **Importance weight** at ``tis_level``: ``w_t = exp(d_t)`` (token) or ``w_i = exp(sum_t d_t)``
   (sequence), truncated from above, ``min(w, tis_cap)`` (TIS).
2. **Rejection on the weight**: units (tokens or sequences, ``tis_reject_level``) whose untruncated
   weight lies outside ``[tis_reject_low, tis_reject_high]`` (masked IS, IcePop).
3. **Rejection on sequence statistics**: a sequence is rejected if any configured criterion fires
   (means over its valid tokens):

   * ``reject_seq_k2``: ``mean_t d_t^2 / 2 > threshold``;
   * ``reject_seq_k3``: ``mean_t (exp(d_t) - 1 - d_t) > threshold`` (k3 with samples from the
     rollout policy: an estimate of ``KL(pi_rollout || pi_train)``, >= 0);
   * ``reject_seq_mean_log_ratio = (low, high)``: ``mean_t d_t`` outside ``[low, high]`` (the log
     of the geometric-mean ratio);
   * ``reject_seq_max_abs_log_ratio``: ``max_t |d_t| > threshold``.

4. **Batch normalization** (``tis_batch_normalize``): ``w~ = w / mean(w)``, the mean over the kept
   units (tokens, or sequences with at least one kept token) of the whole mini-batch: the pair
   ``(sum w, count)`` of every micro-batch is summed over micro-batches and data-parallel ranks
   before the schedule (:func:`fnppo.core.loss.tis_batch_stats`, ``ppo_loss(..., tis_mean=)``).

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

The public wrappers with validation are :func:`fnppo.core.loss.compute_tis_weights` and
:func:`fnppo.core.loss.tis_batch_stats`; :func:`fnppo.core.loss.ppo_loss` applies all of it from the
:class:`~fnppo.core.loss.PolicyLossConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fnppo.core.metrics import pair_metric, weighted_metric
from fnppo.core.segments import Segments
from fnppo.core.typing import Tensor, input_error

__all__ = ["TISWeights", "TIS_LEVELS", "SEQ_REJECTION_CRITERIA"]

TIS_LEVELS = ("token", "sequence")
"""The levels of ``tis_level`` / ``tis_reject_level``."""

SEQ_REJECTION_CRITERIA = ("reject_seq_k2", "reject_seq_k3", "reject_seq_mean_log_ratio", "reject_seq_max_abs_log_ratio")
"""The sequence-statistic rejection criteria; each reports the metric ``<name>_frac``."""


class TISWeights(NamedTuple):
    """Result of :func:`fnppo.core.loss.compute_tis_weights`.

    Attributes:
        weights: ``[batch, seq]`` detached importance weights to multiply the policy loss with;
            0 at masked-out and rejected positions.
        keep: ``[batch, seq]`` float 0/1: valid and not rejected.
        metrics: ``tis_weight`` / ``tis_weight_sq`` (mean of the applied weight and of its square,
            per token or per sequence according to ``level``; :func:`fnppo.core.loss.finalize_metrics`
            derives ``tis_ess`` from them), ``tis_truncated_frac`` and ``tis_rejected_frac`` (the
            weight bounds); with sequence criteria ``rollout_rejected_frac`` (sequences rejected
            by any of them) and ``<criterion>_frac`` per criterion (fractions of valid sequences);
            with batch normalization ``tis_batch_mean`` (the mean weight divided by, over kept
            units, before normalization).
    """

    weights: Tensor
    keep: Tensor
    metrics: dict[str, Tensor]


class Rules(NamedTuple):
    """The rollout-correction settings of one call (the fields of ``PolicyLossConfig`` that matter)."""

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

    @classmethod
    def of(cls, config: Any) -> Rules:
        """The rules of a :class:`~fnppo.core.loss.PolicyLossConfig` (validated when it was built)."""
        return cls(config.tis_cap, config.tis_level, config.tis_reject_low, config.tis_reject_high,
                   config.tis_reject_level or config.tis_level, config.reject_seq_k2, config.reject_seq_k3,
                   config.reject_seq_mean_log_ratio, config.reject_seq_max_abs_log_ratio,
                   config.tis_batch_normalize, config.log_ratio_clamp)

    @property
    def seq_rules(self) -> bool:
        return any(v is not None for v in (self.seq_k2, self.seq_k3, self.seq_mean_log_ratio,
                                           self.seq_max_abs_log_ratio))


# =============================================================================================
# validation shared by the config and compute_tis_weights
# =============================================================================================
def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_weight_rules(fn: str, get: Callable[[str], Any], prefix: str = "") -> None:
    """Check the importance-weight settings, read by ``get(name)``; ``prefix`` names them in the message.

    The names are ``cap``, ``level``, ``reject_low``, ``reject_high``, ``reject_level`` and
    ``log_ratio_clamp``; the config calls its fields ``tis_cap`` ... ``tis_reject_level``
    (``prefix="tis_"``; ``log_ratio_clamp`` is never prefixed), :func:`fnppo.core.loss.compute_tis_weights`
    its arguments by the bare names. The one rule for both:

    * ``cap``: a finite number > 0 or None; ``level``: one of :data:`TIS_LEVELS`;
      ``reject_level``: one of them or None;
    * ``reject_low``: a finite number >= 0 or None; ``reject_high``: a finite number > 0 or None;
      both given: ``reject_low < reject_high`` (else every unit would be rejected, or, at equality,
      every unit whose weight is not exactly that number);
    * ``log_ratio_clamp``: a finite number > 0.

    Raises:
        InputError: naming the first value that breaks the rule (``reject_high`` for a pair out of order).
    """
    def need(ok: bool, name: str, expected: str) -> None:
        if not ok:
            raise input_error(fn, name if name == "log_ratio_clamp" else prefix + name, expected, repr(get(name)))

    cap, low, high = get("cap"), get("reject_low"), get("reject_high")
    need(cap is None or (_finite(cap) and cap > 0), "cap", "a number > 0 or None")
    need(get("level") in TIS_LEVELS, "level", f"one of {list(TIS_LEVELS)}")
    need(get("reject_level") is None or get("reject_level") in TIS_LEVELS, "reject_level",
         f"one of {list(TIS_LEVELS)} or None")
    need(low is None or (_finite(low) and low >= 0), "reject_low", "a number >= 0 or None")
    need(high is None or (_finite(high) and high > 0), "reject_high", "a number > 0 or None")
    if low is not None and high is not None:
        need(low < high, "reject_high", f"a number > {prefix}reject_low={low!r}")
    clamp = get("log_ratio_clamp")
    need(_finite(clamp) and clamp > 0, "log_ratio_clamp", "a number > 0")


def check_seq_rejection(fn: str, get: Callable[[str], Any]) -> tuple[float, float] | None:
    """Check the four ``reject_seq_*`` values (``get(name)`` reads one); return the mean bounds as a tuple.

    Raises:
        InputError: a threshold that is not a finite number > 0 (or None); mean bounds that are not
            two finite numbers ``low < high``.
    """
    for arg in ("reject_seq_k2", "reject_seq_k3", "reject_seq_max_abs_log_ratio"):
        value = get(arg)
        if value is not None and not (_finite(value) and value > 0):
            raise input_error(fn, arg, "a finite number > 0 or None", repr(value))
    bounds = get("reject_seq_mean_log_ratio")
    if bounds is None:
        return None
    ok = isinstance(bounds, (tuple, list)) and len(bounds) == 2 and all(_finite(b) for b in bounds)
    if not ok or not bounds[0] < bounds[1]:
        raise input_error(fn, "reject_seq_mean_log_ratio", "None or (low, high): two finite numbers with low < high",
                          repr(bounds))
    return float(bounds[0]), float(bounds[1])


# =============================================================================================
# the computation
# =============================================================================================
def _seq_max(seg: Segments, x: Tensor) -> Tensor:
    """Per-sequence maximum ``[num]`` of a per-token tensor ``x >= 0`` (0 for an empty sequence)."""
    if seg.ids is None:
        return x.amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[0])
    out = torch.zeros(seg.num + 1, dtype=x.dtype, device=x.device)
    return out.scatter_reduce(0, seg.ids.reshape(-1), x.reshape(-1), reduce="amax")[: seg.num]


def _seq_rejection(d: Tensor, mf: Tensor, seg: Segments, seq_valid: Tensor, r: Rules) -> tuple[Tensor, dict[str, Tensor]]:
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


def correction(train: Tensor, rollout: Tensor, m: Tensor, seg: Segments, r: Rules,
               tis_mean: float | Tensor | None = None) -> tuple[TISWeights, Tensor]:
    """The rollout correction of one micro-batch (see the module docstring), trusting its inputs.

    Args:
        train, rollout: ``[batch, seq]`` trainer-side and rollout log-probs (detached here).
        m: bool ``[batch, seq]``, the valid tokens. seg: their sequences.
        r: the :class:`Rules`.
        tis_mean: the global mean weight to divide by when ``r.normalize`` (None: this call's own
            mean; a mean <= 0, possible only without any kept unit, divides by 1).

    Returns:
        ``(TISWeights, stats)`` with ``stats = (sum of the truncated weights, number)`` over the kept
        units at ``r.level``, before normalization (the pair :func:`fnppo.core.loss.tis_batch_stats` sums).
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
    metrics.update({
        "tis_weight": weighted_metric(w_applied, units[r.level]),
        "tis_weight_sq": weighted_metric(w_applied * w_applied, units[r.level]),
        "tis_truncated_frac": weighted_metric(truncated, units[r.level]),
        "tis_rejected_frac": weighted_metric(rejected.to(dtype), units[r.reject_level]),
    })
    return TISWeights((to_tokens(w_applied, r.level) * keep).detach(), keep.detach(), metrics), stats.detach()
