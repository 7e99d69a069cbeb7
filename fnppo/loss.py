"""Policy-gradient losses for PPO-style training of language models (pure torch, no Megatron).

Everything here is a function of per-token tensors in the padded layout ``[batch, seq]`` (the packed
THD layout is ``[1, total]`` plus per-token sequence ids). Position ``t`` of every tensor refers to
the same target token: ``logprobs[b, t]`` is the log-probability of token ``t + 1`` given its prefix
and ``loss_mask[b, t]`` is 1 where that token is a trained response token.

The pieces, each usable alone:

* :class:`PolicyLossConfig` -- every knob, validated when constructed (frozen dataclass).
* :func:`ppo_loss` -- policy loss (chosen from the registry) + entropy bonus + KL penalty,
  optionally reweighted by truncated importance sampling, aggregated with ``loss_agg_mode``.
* :func:`register_policy_loss` / :func:`get_policy_loss` -- the policy-loss registry. Built in:
  ``ppo``, ``gspo``, ``cispo``, ``gpg``, ``reinforce``, ``gmpo``, ``sapo``, ``clip_cov``,
  ``kl_cov``.
* :func:`kl_penalty` -- per-token KL estimators k1, k2, k3, abs (and straight-through ``"+"``).
* :func:`compute_tis_weights` -- truncated importance weights against the rollout engine.
* :func:`value_loss` -- clipped value loss for PPO with a critic.
* :func:`loss_normalizer` -- the local denominator of a micro-batch, to be summed over the step.
* :func:`merge_metrics` / :func:`finalize_metrics` -- exact reduction of metrics over micro-batches
  and ranks.

Micro-batching. With ``normalizer=N`` (the denominator of the whole step: the sum of
:func:`loss_normalizer` over all micro-batches and data-parallel ranks), every micro-batch loss is
``numerator_i / N``, so the sum of the micro-batch losses is exactly the full-batch loss, whatever
the split (sequences are never split across micro-batches). The exceptions are ``clip_cov`` and
``kl_cov``, whose token selection uses statistics of the micro-batch they see (as in their paper).

Metrics. Every metric is a detached fp32 tensor of shape ``[2]``: ``(weighted_sum, weight)``. Sum
them elementwise over micro-batches and ranks (:func:`merge_metrics`, or an all-reduce), then divide
(:func:`finalize_metrics`). ``loss``, ``pg_loss``, ``entropy`` and ``kl_loss`` carry the aggregation
numerator and the local denominator, so the finalized ``loss`` equals the full-batch loss and
``loss == pg_loss - entropy_coeff * entropy + kl_coef * kl_loss``. Ratios and fractions
(``ppo_kl``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ...) are means over valid tokens.

Validation (mask is 0/1, no NaN/inf at trained positions, sequence ids in range, normalizer >= 0)
costs one device-to-host sync; it runs while call-time type checking is on (see
:mod:`fnppo.typing`) and is skipped together with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fnppo.typing import (
    Integer,
    PaddedFloat,
    PaddedMask,
    Scalar,
    Shaped,
    Tensor,
    TokenFloat,
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
    "Segments",
    "TISWeights",
    "ppo_loss",
    "register_policy_loss",
    "get_policy_loss",
    "registered_policy_losses",
    "kl_penalty",
    "compute_tis_weights",
    "value_loss",
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

_TIS_LEVELS = ("token", "sequence")


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
            ``gspo`` uses them on its sequence ratio (the paper uses ~3e-4 / 4e-4).
        clip_ratio_c: dual-clip bound for negative advantages (arXiv:1912.09729), ``> 1``;
            ``None`` disables it. Used by ``ppo`` and ``clip_cov``.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES` (see :func:`ppo_loss`).
        loss_scale_factor: the constant ``C`` of ``seq-mean-token-sum-norm`` (Dr. GRPO,
            arXiv:2503.20783; e.g. the maximum response length). Required for that mode, must be
            ``None`` otherwise. Being a constant, it keeps the loss split-invariant.
        entropy_coeff: weight of the entropy bonus (the loss gets ``- entropy_coeff * entropy``),
            ``>= 0`` (a negative value would silently turn the bonus into a penalty).
        kl_coef: weight of the KL penalty ``KL(policy || ref)`` (needs ``ref_logprobs``), ``>= 0``.
        kl_estimator: one of :data:`KL_ESTIMATORS` (see :func:`kl_penalty`).
        tis_cap: truncation cap of the importance weight against the rollout engine's log-probs
            (Yao et al. 2025); ``None``: no reweighting. Must be > 0.
        tis_level: ``"token"`` (per-token weight) or ``"sequence"`` (product over the sequence).
        tis_reject_low, tis_reject_high: optional rejection bounds on the untruncated weight:
            tokens (or sequences) whose weight lies outside ``[low, high]`` are dropped from the
            loss numerator (they still count in the denominator). ``None``: no bound.
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

    def __post_init__(self) -> None:
        fn = "fnppo.PolicyLossConfig"

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
        need(self.loss_agg_mode in LOSS_AGG_MODES, "loss_agg_mode", f"one of {list(LOSS_AGG_MODES)}")
        if self.loss_agg_mode == "seq-mean-token-sum-norm":
            need(num("loss_scale_factor") and self.loss_scale_factor > 0, "loss_scale_factor",
                 "a number > 0 (the constant C of 'seq-mean-token-sum-norm', e.g. the max response length)")
        else:
            need(self.loss_scale_factor is None, "loss_scale_factor",
                 "None unless loss_agg_mode='seq-mean-token-sum-norm'")
        for arg in ("entropy_coeff", "kl_coef"):
            need(num(arg) and getattr(self, arg) >= 0, arg, "a finite number >= 0")
        need(self.kl_estimator in KL_ESTIMATORS, "kl_estimator", f"one of {list(KL_ESTIMATORS)}")
        need(self.tis_cap is None or (num("tis_cap") and self.tis_cap > 0), "tis_cap", "a number > 0 or None")
        need(self.tis_level in _TIS_LEVELS, "tis_level", f"one of {list(_TIS_LEVELS)}")
        need(self.tis_reject_level is None or self.tis_reject_level in _TIS_LEVELS, "tis_reject_level",
             f"one of {list(_TIS_LEVELS)} or None")
        need(self.tis_reject_low is None or (num("tis_reject_low") and self.tis_reject_low >= 0), "tis_reject_low",
             "a number >= 0 or None")
        need(self.tis_reject_high is None or (num("tis_reject_high") and self.tis_reject_high > 0),
             "tis_reject_high", "a number > 0 or None")
        if self.tis_reject_low is not None and self.tis_reject_high is not None:
            need(self.tis_reject_low < self.tis_reject_high, "tis_reject_high",
                 f"a number > tis_reject_low={self.tis_reject_low!r}")
        need(num("log_ratio_clamp") and self.log_ratio_clamp > 0, "log_ratio_clamp", "a number > 0")
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

    @property
    def tis_active(self) -> bool:
        """Whether importance weights / rejection against the rollout log-probs are applied."""
        return self.tis_cap is not None or self.tis_reject_low is not None or self.tis_reject_high is not None


# =============================================================================================
# Sequence grouping
# =============================================================================================
class Segments(NamedTuple):
    """Which sequence each token belongs to, for per-sequence sums without Python loops.

    ``ids is None``: each row of ``[batch, seq]`` is one sequence (``num = batch``). Otherwise
    ``ids[b, t]`` is the sequence slot of the token in ``[0, num)``, or ``num`` (a discard slot)
    for tokens that belong to no sequence. In the packed layout ``num`` is the number of token
    positions, an upper bound of the number of sequences that needs no device sync; empty slots
    simply have zero tokens.
    """

    ids: Tensor | None
    num: int

    def sum(self, x: Tensor) -> Tensor:
        """Per-sequence sums ``[num]`` of a per-token tensor (mask it first)."""
        if self.ids is None:
            return x.sum(dim=-1)
        out = torch.zeros(self.num + 1, dtype=x.dtype, device=x.device)
        return out.index_add(0, self.ids.reshape(-1), x.reshape(-1))[: self.num]

    def gather(self, v: Tensor, like: Tensor) -> Tensor:
        """Broadcast per-sequence values ``[num]`` back to tokens (0 for tokens of no sequence)."""
        if self.ids is None:
            return v[:, None].expand_as(like)
        return torch.cat([v, v.new_zeros(1)])[self.ids]


def _segments(shape: torch.Size, seq_ids: Tensor | None) -> Segments:
    if seq_ids is None:
        return Segments(None, shape[0])
    num = seq_ids.numel()
    ids = torch.where(seq_ids >= 0, seq_ids.long(), torch.full_like(seq_ids, num, dtype=torch.long))
    return Segments(ids, num)


# =============================================================================================
# Metrics
# =============================================================================================
def weighted_metric(values: Tensor, weights: Tensor) -> Tensor:
    """``(sum(values * weights), sum(weights))`` as a detached fp32 ``[2]`` tensor.

    Positions with weight 0 are ignored even if ``values`` is NaN/inf there.
    """
    v = torch.where(weights != 0, values.detach(), torch.zeros((), dtype=values.dtype, device=values.device))
    w = weights.detach().to(v.dtype)
    return torch.stack([(v * w).sum(), w.sum()]).float()


def _pair(num: Tensor, den: Tensor) -> Tensor:
    return torch.stack([num.detach().float().reshape(()), den.detach().float().reshape(())])


def merge_metrics(metrics: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Combine metric dicts of micro-batches (or ranks) by elementwise summing.

    The result holds the union of the keys; a key missing from some dicts just contributes nothing.
    Inputs are not modified.
    """
    out: dict[str, Tensor] = {}
    for d in metrics:
        for key, value in d.items():
            out[key] = value.detach().clone() if key not in out else out[key] + value.detach()
    return out


def finalize_metrics(metrics: Mapping[str, Tensor]) -> dict[str, float]:
    """Turn ``(weighted_sum, weight)`` pairs into floats ``sum / weight`` (weight 0 -> 0.0).

    Derived entry: when ``tis_weight`` and ``tis_weight_sq`` are present, ``tis_ess`` is the
    normalized effective sample size of the importance weights,
    ``ESS / n = mean(w)^2 / mean(w^2)`` in ``(0, 1]`` (computed from the merged sums, so it is the
    exact ESS of the whole step).
    """
    if not metrics:
        return {}
    keys = list(metrics)
    rows = torch.stack([metrics[k].detach().float().reshape(2).cpu() for k in keys]).tolist()
    out = {k: (s / w if w != 0 else 0.0) for k, (s, w) in zip(keys, rows)}
    if "tis_weight" in out and "tis_weight_sq" in out:
        mean_w, mean_w2 = out["tis_weight"], out["tis_weight_sq"]
        out["tis_ess"] = mean_w * mean_w / mean_w2 if mean_w2 > 0 else 0.0
    return out


# =============================================================================================
# Policy-loss registry
# =============================================================================================
@dataclass(frozen=True)
class PolicyLossInputs:
    """What a registered policy loss receives (one object, so new fields never break user code).

    All tensors are ``[batch, seq]`` in the compute dtype (fp32, or fp64 if the inputs are fp64),
    and are 0 wherever ``mask`` is 0 (so nothing computed there can be inf/NaN).

    Attributes:
        logprobs: current policy log-probs; carries the gradient.
        old_logprobs: behaviour-policy log-probs (detached).
        advantages: per-token advantages (detached).
        mask: the float 0/1 loss mask.
        config: the :class:`PolicyLossConfig`.
        segments: token -> sequence grouping (``segments.sum``, ``segments.gather``).
        generator: optional ``torch.Generator`` for randomized losses (Clip-Cov).
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    config: PolicyLossConfig
    segments: Segments
    generator: torch.Generator | None = None

    def log_ratio(self) -> Tensor:
        """``clamp(logprobs - old_logprobs, -c, c)`` with ``c = config.log_ratio_clamp``."""
        c = self.config.log_ratio_clamp
        return torch.clamp(self.logprobs - self.old_logprobs, -c, c)

    def ratio(self) -> Tensor:
        """``exp`` of :meth:`log_ratio`."""
        return torch.exp(self.log_ratio())

    def seq_mean(self, x: Tensor) -> Tensor:
        """Per-sequence mean of ``x`` over valid tokens, broadcast back to tokens ``[batch, seq]``."""
        seg = self.segments
        count = seg.sum(self.mask)
        mean = seg.sum(x * self.mask) / torch.where(count > 0, count, torch.ones_like(count))
        return seg.gather(mean, x)

    def token_metric(self, values: Tensor) -> Tensor:
        """:func:`weighted_metric` of ``values`` over the valid tokens."""
        return weighted_metric(values, self.mask)


PolicyLossFn = Callable[[PolicyLossInputs], tuple[Tensor, dict[str, Tensor]]]
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name`` for ``PolicyLossConfig(policy_loss=name)``.

    The function takes one :class:`PolicyLossInputs` and returns ``(per_token_loss, metrics)``:

    * ``per_token_loss``: ``[batch, seq]``, the loss of each token *before* aggregation (to be
      minimized; a surrogate objective enters with a minus sign). Values where ``inputs.mask`` is 0
      are ignored. :func:`ppo_loss` multiplies it by the TIS weights and aggregates it with
      ``loss_agg_mode``; sequence-level losses broadcast their per-sequence value to the tokens
      of the sequence (``inputs.segments.gather``).
    * ``metrics``: ``dict[str, Tensor]`` of ``[2]`` tensors ``(weighted_sum, weight)``, e.g.
      ``{"pg_clipfrac": inputs.token_metric(clipped.float())}``. ``pg_clipfrac`` and
      ``pg_clipfrac_lower`` default to 0 when not returned.

    Example::

        @fnppo.register_policy_loss("my_reinforce")
        def my_reinforce(x: fnppo.PolicyLossInputs):
            return -x.advantages * x.logprobs, {}

    Re-registering an existing name raises unless ``override=True``.
    """
    if not isinstance(name, str) or not name:
        raise input_error("fnppo.register_policy_loss", "name", "a non-empty string", repr(name))

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _POLICY_LOSSES and not override:
            raise input_error("fnppo.register_policy_loss", "name", "a name not registered yet (or override=True)",
                              repr(name))
        _POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name``; raises :class:`InputError` listing the known names."""
    try:
        return _POLICY_LOSSES[name]
    except (KeyError, TypeError):
        raise input_error("fnppo.get_policy_loss", "name", f"one of {sorted(_POLICY_LOSSES)}", repr(name)) from None


def registered_policy_losses() -> tuple[str, ...]:
    """Names of all registered policy losses, sorted."""
    return tuple(sorted(_POLICY_LOSSES))


# ---------------------------------------------------------------------------------------------
# Built-in policy losses
# ---------------------------------------------------------------------------------------------
def _clipped_surrogate(ratio: Tensor, adv: Tensor, cfg: PolicyLossConfig, dual: bool) -> tuple[Tensor, Tensor, Tensor]:
    """PPO pessimistic surrogate; returns (loss, clipped, dual_clipped) per token."""
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    loss = torch.maximum(l1, l2)
    clipped = l2 > l1
    if dual and cfg.clip_ratio_c is not None:
        l3 = -adv * cfg.clip_ratio_c
        lower = (adv < 0) & (loss > l3)
        loss = torch.where(adv < 0, torch.minimum(loss, l3), loss)
    else:
        lower = torch.zeros_like(clipped)
    return loss, clipped, lower


@register_policy_loss("ppo")
def ppo_clip_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric and dual clipping.

    ``r = exp(logp - logp_old)``, ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` and, for
    ``A < 0``, ``l = min(l, -A c)`` (dual clip, ``c = clip_ratio_c``).

    References: PPO, arXiv:1707.06347; dual-clip PPO, arXiv:1912.09729; clip-higher (asymmetric
    bounds), DAPO, arXiv:2503.14476.
    """
    loss, clipped, lower = _clipped_surrogate(x.ratio(), x.advantages, x.config, dual=True)
    return loss, {"pg_clipfrac": x.token_metric(clipped.float()), "pg_clipfrac_lower": x.token_metric(lower.float())}


@register_policy_loss("gspo")
def gspo_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: clipped surrogate on the length-normalized sequence ratio (token-level form GSPO-token).

    ``log s_i = mean_t (logp_t - logp_old_t)`` over the valid tokens of sequence i and, per token,
    ``s_it = sg(s_i) * exp(logp_t - sg(logp_t))``: its value is ``s_i`` and its gradient is
    ``s_i * grad logp_t``. Loss ``max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high))``, no dual
    clip. With ``loss_agg_mode="seq-mean-token-mean"`` this is the paper's objective.
    Only the stopped part of the log-ratio is clamped, so gradients survive the clamp.

    Reference: Group Sequence Policy Optimization, arXiv:2507.18071.
    """
    c = x.config.log_ratio_clamp
    seq_log_ratio = x.seq_mean(x.logprobs.detach() - x.old_logprobs)
    log_s = torch.clamp(seq_log_ratio, -c, c) + x.logprobs - x.logprobs.detach()
    loss, clipped, _ = _clipped_surrogate(torch.exp(log_s), x.advantages, x.config, dual=False)
    return loss, {"pg_clipfrac": x.token_metric(clipped.float())}


@register_policy_loss("cispo")
def cispo_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE weighted by the clipped, stopped importance ratio.

    ``l = -sg(clip(r, 1 - eps_low^IS, 1 + eps_high^IS)) * A * logp`` with
    ``eps^IS = (cispo_clip_low, cispo_clip_high)``; every token keeps a gradient
    ``-clip(r) A grad logp``. (The loss value contains ``logp``; only its gradient is meaningful.)

    Reference: MiniMax-M1, arXiv:2506.13585.
    """
    cfg = x.config
    ratio = x.ratio().detach()
    weight = torch.clamp(ratio, 1.0 - cfg.cispo_clip_low, 1.0 + cfg.cispo_clip_high)
    clipped = weight != ratio
    return -weight * x.advantages * x.logprobs, {"pg_clipfrac": x.token_metric(clipped.float())}


def _reinforce(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain policy gradient ``l = -A * logp`` (on-policy; ``old_logprobs`` is not used).

    Registered as ``gpg`` (Group Policy Gradient, arXiv:2504.02546, whose advantage correction is
    left to the advantage estimator) and ``reinforce`` (Williams 1992).
    """
    return -x.advantages * x.logprobs, {}


register_policy_loss("gpg")(_reinforce)
register_policy_loss("reinforce")(_reinforce)


@register_policy_loss("gmpo")
def gmpo_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO: the geometric mean of token ratios, with token-level clipping in log space.

    Per token ``u_t = sgn(A) min(sgn(A) log r_t, sgn(A) clip(log r_t, -eps_low, eps_high))``;
    per sequence ``A_i = mean_t A_t`` and ``l_i = -A_i exp(mean_t u_t)`` (means over valid tokens),
    broadcast to the tokens of the sequence. With ``loss_agg_mode="seq-mean-token-mean"`` the loss
    is the paper's mean over sequences. ``clip_ratio_low/high`` are log-space bounds here (the paper
    uses 0.4).

    Reference: Geometric-Mean Policy Optimization, arXiv:2507.20673.
    """
    cfg = x.config
    log_ratio = x.log_ratio()
    sign = torch.sign(x.advantages)
    clipped_lr = torch.clamp(log_ratio, -cfg.clip_ratio_low, cfg.clip_ratio_high)
    u = sign * torch.minimum(sign * log_ratio, sign * clipped_lr)
    seq_adv = x.seq_mean(x.advantages)
    loss = -seq_adv * torch.exp(x.seq_mean(u))
    clipped = sign * log_ratio > sign * clipped_lr
    return loss, {"pg_clipfrac": x.token_metric(clipped.float())}


@register_policy_loss("sapo")
def sapo_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: a smooth sigmoid gate instead of the hard clip.

    ``l = -f(r) A`` with ``f(r) = (4 / tau) sigmoid(tau (r - 1))`` and ``tau = sapo_tau_pos`` for
    ``A > 0``, ``sapo_tau_neg`` otherwise. ``f'(r) = 4 sigmoid(1 - sigmoid)`` equals 1 at ``r = 1``
    (the on-policy gradient) and decays smoothly off-policy.

    Reference: Soft Adaptive Policy Optimization, arXiv:2511.20347.
    """
    cfg = x.config
    tau = torch.where(x.advantages > 0, x.advantages.new_tensor(cfg.sapo_tau_pos), x.advantages.new_tensor(cfg.sapo_tau_neg))
    gate = (4.0 / tau) * torch.sigmoid(tau * (x.ratio() - 1.0))
    return -gate * x.advantages, {}


def _select_first_k(keys: Tensor, eligible: Tensor, k: Tensor) -> Tensor:
    """Boolean mask of the ``k`` eligible entries with the largest ``keys`` (no host sync)."""
    flat_keys = torch.where(eligible, keys, torch.full_like(keys, -math.inf)).reshape(-1)
    flat_eligible = eligible.reshape(-1)
    order = torch.argsort(flat_keys, descending=True)
    rank_ok = torch.arange(order.numel(), device=keys.device) < k
    chosen_sorted = rank_ok & flat_eligible[order]
    chosen = torch.zeros_like(flat_eligible).scatter(0, order, chosen_sorted)
    return chosen.reshape(keys.shape)


def _covariance(x: PolicyLossInputs) -> tuple[Tensor, Tensor]:
    """Centered token covariance ``(A - mean A)(logp - mean logp)`` over valid tokens; and the count."""
    n = x.mask.sum()
    safe_n = torch.where(n > 0, n, torch.ones_like(n))
    lp = x.logprobs.detach()
    mean_a = (x.advantages * x.mask).sum() / safe_n
    mean_lp = (lp * x.mask).sum() / safe_n
    return (x.advantages - mean_a) * (lp - mean_lp), n


@register_policy_loss("clip_cov")
def clip_cov_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: PPO loss with the gradient of a few high-covariance tokens stopped.

    ``cov_t = (A_t - mean A)(logp_t - mean logp)`` over the valid tokens of the micro-batch. Among
    valid tokens not already clipped by PPO with ``clip_cov_lb < cov_t < clip_cov_ub``,
    ``k = max(floor(clip_cov_ratio * n_valid), 1)`` are drawn uniformly at random (``generator``
    of :func:`ppo_loss`) and their loss is detached (value kept, gradient 0). The rest is the PPO
    loss of ``ppo`` (asymmetric and dual clip). Not split-invariant: statistics are per micro-batch.

    Reference: The Entropy Mechanism of RL for Reasoning LMs, arXiv:2505.22617.
    """
    cfg = x.config
    loss, clipped, lower = _clipped_surrogate(x.ratio(), x.advantages, cfg, dual=True)
    cov, n = _covariance(x)
    valid = x.mask > 0
    eligible = valid & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    k = torch.clamp(torch.floor(cfg.clip_cov_ratio * n), min=1.0)
    keys = torch.rand(cov.shape, generator=x.generator, device=cov.device, dtype=cov.dtype)
    chosen = _select_first_k(keys, eligible, k)
    loss = torch.where(chosen, loss.detach(), loss)
    return loss, {
        "pg_clipfrac": x.token_metric(clipped.float()),
        "pg_clipfrac_lower": x.token_metric(lower.float()),
        "clip_cov_frac": x.token_metric(chosen.float()),
    }


@register_policy_loss("kl_cov")
def kl_cov_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: unclipped surrogate plus a KL penalty on the highest-covariance tokens.

    ``l_t = -A_t r_t + kl_cov_coef * |log r_t| * [t in top-k of cov]`` with
    ``cov_t = (A_t - mean A)(logp_t - mean logp)`` over the valid tokens of the micro-batch and
    ``k = max(floor(kl_cov_ratio * n_valid), 1)``. Not split-invariant (per micro-batch top-k).

    Reference: The Entropy Mechanism of RL for Reasoning LMs, arXiv:2505.22617.
    """
    cfg = x.config
    log_ratio = x.log_ratio()
    cov, n = _covariance(x)
    k = torch.clamp(torch.floor(cfg.kl_cov_ratio * n), min=1.0)
    chosen = _select_first_k(cov, x.mask > 0, k)
    loss = -x.advantages * torch.exp(log_ratio) + torch.where(chosen, cfg.kl_cov_coef * log_ratio.abs(), 0.0)
    return loss, {"kl_cov_frac": x.token_metric(chosen.float())}


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
    """
    if estimator not in KL_ESTIMATORS:
        raise input_error("fnppo.kl_penalty", "estimator", f"one of {list(KL_ESTIMATORS)}", repr(estimator))
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
# Truncated importance sampling
# =============================================================================================
class TISWeights(NamedTuple):
    """Result of :func:`compute_tis_weights`.

    Attributes:
        weights: ``[batch, seq]`` detached importance weights to multiply the policy loss with;
            0 at masked-out and rejected positions.
        keep: ``[batch, seq]`` float 0/1: valid and not rejected.
        metrics: ``tis_weight`` / ``tis_weight_sq`` (mean of the applied weight and of its square,
            per token or per sequence according to ``level``; :func:`finalize_metrics` derives
            ``tis_ess`` from them), ``tis_truncated_frac`` and ``tis_rejected_frac``.
    """

    weights: Tensor
    keep: Tensor
    metrics: dict[str, Tensor]


@typechecked
def compute_tis_weights(old_logprobs: PaddedFloat, rollout_logprobs: PaddedFloat, loss_mask: PaddedMask, *,
                        cap: float | None, level: str = "token", reject_low: float | None = None,
                        reject_high: float | None = None, reject_level: str | None = None,
                        seq_ids: Integer[Tensor, "batch seq"] | None = None,
                        log_ratio_clamp: float = 20.0) -> TISWeights:
    """Truncated importance weights correcting for the rollout engine's sampling distribution.

    Token level: ``w_t = exp(logp_old_t - logp_rollout_t)``; sequence level:
    ``w_i = exp(sum_t (logp_old_t - logp_rollout_t))`` (valid tokens of sequence i, broadcast to its
    tokens). Log-weights are clamped to ``[-log_ratio_clamp, log_ratio_clamp]``. The applied weight
    is ``min(w, cap)``, detached (``cap=None``: weight 1, only rejection). Optional rejection (at
    ``reject_level``, default ``level``): tokens or sequences whose untruncated weight is outside
    ``[reject_low, reject_high]`` get weight 0 and ``keep`` 0.

    Reference: F. Yao et al. (2025), "Your efficient RL framework secretly brings you off-policy RL
    training" (truncated importance sampling, TIS).
    """
    fn = "fnppo.compute_tis_weights"
    if cap is not None and not (_is_number(cap) and cap > 0):
        raise input_error(fn, "cap", "a number > 0 or None", repr(cap))
    for arg, value in (("level", level), ("reject_level", reject_level)):
        if value is not None and value not in _TIS_LEVELS:
            raise input_error(fn, arg, f"one of {list(_TIS_LEVELS)}", repr(value))
    for arg, value in (("reject_low", reject_low), ("reject_high", reject_high)):
        if value is not None and not (_is_number(value) and value >= 0):
            raise input_error(fn, arg, "a number >= 0 or None", repr(value))
    if typechecking_enabled():
        _validate(fn, loss_mask, {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs}, None, seq_ids)
    return _tis_weights(old_logprobs, rollout_logprobs, loss_mask != 0, cap, level, reject_low, reject_high,
                        level if reject_level is None else reject_level, _segments(loss_mask.shape, seq_ids),
                        log_ratio_clamp)


def _tis_weights(old: Tensor, rollout: Tensor, m: Tensor, cap: float | None, level: str,
                 reject_low: float | None, reject_high: float | None, reject_level: str, seg: Segments,
                 clamp: float) -> TISWeights:
    dtype = torch.promote_types(old.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old.device)
    mf = m.to(dtype)
    log_w_tok = torch.where(m, old.detach().to(dtype) - rollout.detach().to(dtype), zero)
    seq_valid = (seg.sum(mf) > 0).to(dtype)
    units = {"token": mf, "sequence": seq_valid}  # what a metric averages over, per level

    def raw_weight(lv: str) -> Tensor:  # per token [batch, seq] or per sequence [num]
        log_w = log_w_tok if lv == "token" else seg.sum(log_w_tok)
        return torch.exp(torch.clamp(log_w, -clamp, clamp))

    def to_tokens(v: Tensor, lv: str) -> Tensor:
        return v if lv == "token" else seg.gather(v, mf)

    w_raw = raw_weight(level)
    if cap is None:
        w, truncated = torch.ones_like(w_raw), torch.zeros_like(w_raw)
    else:
        w, truncated = torch.clamp(w_raw, max=cap), (w_raw > cap).to(dtype)
    rejected = torch.zeros_like(units[reject_level], dtype=torch.bool)
    if reject_low is not None or reject_high is not None:
        r_raw = w_raw if reject_level == level else raw_weight(reject_level)
        if reject_low is not None:
            rejected = rejected | (r_raw < reject_low)
        if reject_high is not None:
            rejected = rejected | (r_raw > reject_high)
    keep = mf * (1.0 - to_tokens(rejected.to(dtype), reject_level))
    # The applied weight per unit of `level`: 0 for a unit with no kept token.
    kept_unit = keep if level == "token" else (seg.sum(keep) > 0).to(dtype)
    w_applied = w * kept_unit
    metrics = {
        "tis_weight": weighted_metric(w_applied, units[level]),
        "tis_weight_sq": weighted_metric(w_applied * w_applied, units[level]),
        "tis_truncated_frac": weighted_metric(truncated, units[level]),
        "tis_rejected_frac": weighted_metric(rejected.to(dtype), units[reject_level]),
    }
    return TISWeights((to_tokens(w_applied, level) * keep).detach(), keep.detach(), metrics)


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
    if mode == "seq-mean-token-sum-norm":
        return mf / scale, n_seq
    raise input_error("fnppo.loss", "loss_agg_mode", f"one of {list(LOSS_AGG_MODES)}", repr(mode))


def _mode_and_scale(config: PolicyLossConfig | str, scale: float | None, fn: str) -> tuple[str, float | None]:
    if isinstance(config, PolicyLossConfig):
        return config.loss_agg_mode, config.loss_scale_factor
    if config not in LOSS_AGG_MODES:
        raise input_error(fn, "loss_agg_mode", f"one of {list(LOSS_AGG_MODES)}", repr(config))
    if config == "seq-mean-token-sum-norm" and not (_is_number(scale) and scale > 0):
        raise input_error(fn, "loss_scale_factor", "a number > 0 for 'seq-mean-token-sum-norm'", repr(scale))
    return config, scale


@typechecked
def loss_normalizer(loss_mask: PaddedMask, config: PolicyLossConfig | str, *,
                    seq_ids: Integer[Tensor, "batch seq"] | None = None) -> Scalar:
    """The local denominator of ``loss_agg_mode`` for one micro-batch (0-dim fp32).

    ``token-mean``: the number of valid tokens (``loss_mask == 1``); the ``seq-mean-*`` modes: the
    number of valid sequences (sequences with at least one valid token). Sum it over all
    micro-batches and data-parallel ranks of the step and pass the sum as ``normalizer`` to
    :func:`ppo_loss` / :func:`value_loss`. ``config`` may also be a mode name.
    """
    mode, scale = _mode_and_scale(config, 1.0, "fnppo.loss_normalizer")
    mf = (loss_mask != 0).float()
    return _agg_weights(mf, _segments(loss_mask.shape, seq_ids), mode, scale)[1].float()


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
              seq_ids: Tensor | None, mask_name: str = "loss_mask") -> None:
    m = mask != 0
    flags = []
    if mask.dtype != torch.bool:
        flags.append(((mask != 0) & (mask != 1)).any())
    for t in finite.values():
        if t is not None and t.is_floating_point():
            flags.append((~torch.isfinite(t) & m).any())
    if isinstance(normalizer, Tensor):
        flags.append(~torch.isfinite(normalizer) | (normalizer < 0))
    if seq_ids is not None:
        flags.append(((seq_ids < -1) | (seq_ids >= seq_ids.numel()) | ((seq_ids < 0) & m)).any())
    if normalizer is not None and not isinstance(normalizer, Tensor):
        if not (math.isfinite(normalizer) and normalizer >= 0):
            raise input_error(fn, "normalizer", "a finite number >= 0", repr(normalizer))
    if not flags or not bool(torch.stack([f.reshape(()) for f in flags]).any()):
        return
    # Something is wrong: find it (slow path, may sync several times).
    check_mask01(fn, mask_name, mask)
    for name, t in finite.items():
        check_finite(fn, name, t, where=mask)
    if isinstance(normalizer, Tensor) and not bool(torch.isfinite(normalizer) & (normalizer >= 0)):
        raise input_error(fn, "normalizer", "a finite number >= 0", f"{describe(normalizer)} = {normalizer.item()!r}")
    if seq_ids is not None:
        lo, hi = int(seq_ids.min()), int(seq_ids.max())
        raise input_error(fn, "seq_ids", f"values in [-1, {seq_ids.numel()}) and >= 0 wherever {mask_name} is 1",
                          f"{describe(seq_ids)} with values in [{lo}, {hi}]")


# =============================================================================================
# The loss
# =============================================================================================
@typechecked
def ppo_loss(
    logprobs: PaddedFloat,
    old_logprobs: PaddedFloat,
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
) -> tuple[Scalar, dict[str, Tensor]]:
    """Policy loss + entropy bonus + KL penalty, aggregated with ``config.loss_agg_mode``.

    Per token: ``l_t = w^TIS_t * pg_t - entropy_coeff * H_t + kl_coef * KL_t`` where ``pg_t`` is the
    registered policy loss ``config.policy_loss``, ``w^TIS`` the truncated importance weight
    (:func:`compute_tis_weights`, when ``config.tis_cap`` or a rejection bound is set; rejected
    tokens drop out of all three terms) and ``KL_t = kl_penalty(logprobs, ref_logprobs,
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
    valid token anywhere) gives a loss of exactly 0 with zero gradient; an empty tensor (a batch
    or sequence dimension of size 0) is refused. ``logprobs`` itself is not checked for NaN/inf: it
    is the model's output, and a non-finite loss makes :func:`fnppo.train_step` skip the update.

    Args:
        logprobs: ``[batch, seq]`` log-probs of the current policy (carries the gradient).
        old_logprobs: log-probs of the policy that generated the data (recomputed by the trainer).
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

    Returns:
        ``(loss, metrics)``: the 0-dim loss and ``dict[str, Tensor]`` of detached ``[2]`` metrics
        (see the module docstring): ``loss``, ``pg_loss``, ``ppo_kl`` (``mean(logp_old - logp)``),
        ``pg_clipfrac``, ``pg_clipfrac_lower``, ``entropy`` / ``kl_loss`` (when given), the TIS
        metrics, plus whatever the policy loss reports.
    """
    fn = "fnppo.ppo_loss"
    if logprobs.numel() == 0:
        raise input_error(fn, "logprobs", "a non-empty [batch, seq] tensor (an empty batch has no loss)", describe(logprobs))
    loss_fn = get_policy_loss(config.policy_loss)
    if config.entropy_coeff != 0 and entropy is None:
        raise input_error(fn, "entropy", f"a tensor since entropy_coeff={config.entropy_coeff!r}", "None")
    if config.kl_coef != 0 and ref_logprobs is None:
        raise input_error(fn, "ref_logprobs", f"a tensor since kl_coef={config.kl_coef!r}", "None")
    if config.tis_active and rollout_logprobs is None:
        raise input_error(fn, "rollout_logprobs", "a tensor since TIS (tis_cap / tis_reject_*) is configured", "None")
    if typechecking_enabled():
        _validate(fn, loss_mask, {"advantages": advantages, "old_logprobs": old_logprobs,
                                  "ref_logprobs": ref_logprobs, "rollout_logprobs": rollout_logprobs},
                  normalizer, seq_ids)

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    device = logprobs.device
    zero = torch.zeros((), dtype=dtype, device=device)
    m = loss_mask != 0
    mf = m.to(dtype)

    def clean(t: Tensor, detach: bool) -> Tensor:
        t = t.detach() if detach else t
        return torch.where(m, t.to(dtype), zero)

    lp = clean(logprobs, detach=False)
    old = clean(old_logprobs, detach=True)
    seg = _segments(loss_mask.shape, seq_ids)
    inputs = PolicyLossInputs(lp, old, clean(advantages, detach=True), mf, config, seg, generator)
    pg_tok, extra = loss_fn(inputs)
    if not isinstance(pg_tok, Tensor) or pg_tok.shape != lp.shape:
        raise input_error(fn, f"policy loss {config.policy_loss!r}", f"a per-token loss of shape {tuple(lp.shape)}",
                          describe(pg_tok))
    pg_tok = torch.where(m, pg_tok.to(dtype), zero)

    metrics: dict[str, Tensor] = {}
    keep = mf
    if rollout_logprobs is not None:
        rollout = clean(rollout_logprobs, detach=True)
        metrics["rollout_kl"] = weighted_metric(rollout - old, mf)
        if config.tis_active:
            tis = _tis_weights(old, rollout, m, config.tis_cap, config.tis_level, config.tis_reject_low,
                               config.tis_reject_high, config.tis_reject_level or config.tis_level, seg,
                               config.log_ratio_clamp)
            pg_tok = pg_tok * tis.weights.to(dtype)
            keep = tis.keep.to(dtype)
            metrics.update(tis.metrics)

    agg_w, local_den = _agg_weights(mf, seg, config.loss_agg_mode, config.loss_scale_factor)
    denom = _denominator(normalizer, local_den)
    pg_num = (pg_tok * agg_w).sum()
    total_num = pg_num
    metrics["pg_loss"] = _pair(pg_num, local_den)
    term_w = agg_w * keep
    if entropy is not None:
        ent_num = (clean(entropy, detach=config.entropy_coeff == 0) * term_w).sum()
        metrics["entropy"] = _pair(ent_num, local_den)
        if config.entropy_coeff != 0:
            total_num = total_num - config.entropy_coeff * ent_num
    if ref_logprobs is not None:
        kl_tok = kl_penalty(lp if config.kl_coef != 0 else lp.detach(), clean(ref_logprobs, detach=True),
                            config.kl_estimator,
                            log_ratio_clamp=config.log_ratio_clamp)
        kl_num = (torch.where(m, kl_tok, zero) * term_w).sum()
        metrics["kl_loss"] = _pair(kl_num, local_den)
        if config.kl_coef != 0:
            total_num = total_num + config.kl_coef * kl_num
    loss = total_num / denom
    metrics["loss"] = _pair(total_num, local_den)
    metrics["ppo_kl"] = weighted_metric(old - lp, mf)
    for key in ("pg_clipfrac", "pg_clipfrac_lower"):
        metrics.setdefault(key, _pair(zero, mf.sum()))
    for key, value in extra.items():
        metrics[key] = value.detach().float()
    return loss, metrics


# =============================================================================================
# Value loss
# =============================================================================================
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

    ``V_clip = old_V + clip(V - old_V, -clip_range, clip_range)`` and per token
    ``l_t = 1/2 max((V - R)^2, (V_clip - R)^2)`` (``clip_range=None``: ``1/2 (V - R)^2``),
    aggregated like :func:`ppo_loss` (``loss_agg_mode``, ``normalizer``, ``seq_ids``).

    Metrics: ``vf_loss`` (numerator, local denominator), ``vf_clipfrac`` (tokens where the clipped
    term is the larger one), ``vpred_mean``.

    Reference: PPO, arXiv:1707.06347 (value clipping as in the OpenAI baselines implementation).
    """
    fn = "fnppo.value_loss"
    if values.numel() == 0:
        raise input_error(fn, "values", "a non-empty [batch, seq] tensor (an empty batch has no loss)", describe(values))
    if clip_range is not None and not (_is_number(clip_range) and clip_range >= 0):
        raise input_error(fn, "clip_range", "a number >= 0 or None", repr(clip_range))
    mode, scale = _mode_and_scale(loss_agg_mode, loss_scale_factor, fn)
    if typechecking_enabled():
        _validate(fn, mask, {"values": values, "old_values": old_values, "returns": returns}, normalizer, seq_ids,
                  mask_name="mask")
    dtype = torch.promote_types(values.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    m = mask != 0
    mf = m.to(dtype)
    v = torch.where(m, values.to(dtype), zero)
    old = torch.where(m, old_values.detach().to(dtype), zero)
    ret = torch.where(m, returns.detach().to(dtype), zero)
    l1 = (v - ret) ** 2
    if clip_range is None:
        per_tok, clipped = 0.5 * l1, torch.zeros_like(m)
    else:
        v_clip = old + torch.clamp(v - old, -clip_range, clip_range)
        l2 = (v_clip - ret) ** 2
        per_tok, clipped = 0.5 * torch.maximum(l1, l2), l2 > l1
    seg = _segments(mask.shape, seq_ids)
    agg_w, local_den = _agg_weights(mf, seg, mode, scale)
    num = (per_tok * agg_w).sum()
    loss = num / _denominator(normalizer, local_den)
    return loss, {"vf_loss": _pair(num, local_den), "vf_clipfrac": weighted_metric(clipped.to(dtype), mf),
                  "vpred_mean": weighted_metric(v, mf)}

