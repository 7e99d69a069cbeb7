"""The per-token policy losses: what a policy loss receives and the built-in ones (pure torch).

A policy loss is any callable ``loss(x: PolicyInputs) -> (per_token_loss, metrics)``
(:class:`PolicyLoss`); there is no registry: pass the callable itself as
``LossConfig(policy=...)``. :func:`fnppo.core.losses.ppo.ppo_loss` weights it, aggregates it and
adds the entropy bonus and the KL penalty.

* :class:`PolicyInputs` -- the tensors of one call, cleaned (0 where the mask is 0).
* Built in, each a frozen dataclass with its own parameters, validated when built (also by
  ``dataclasses.replace``): :func:`ppo_clip` (clipped surrogate, dual clip, clip-higher),
  :func:`gspo`, :func:`cispo`, :func:`gmpo`, :func:`sapo`, :func:`gpg` and :func:`reinforce`
  (each class's docstring gives its formula and paper); the covariance-based ``clip_cov`` and
  ``kl_cov`` are in :mod:`fnppo.core.losses.covariance`.
* :func:`uses_ratio` -- whether a policy loss reads ``old_logprobs`` (attribute ``uses_ratio``,
  default True; False for REINFORCE-like losses, which may then take TIS weights in bypass mode).
* :func:`bypass_only` -- whether it needs them to be the behaviour policy's (attribute
  ``bypass_only``, default False; True for ``loglinear_decoupled``: refused outside bypass mode);
  :func:`reads_probabilities` -- whether it reads ``exp(old_logprobs)`` as a probability (then
  old log-probs above 0 are refused).

Each part's rule is a module-level ``check_*`` function over a :class:`~fnppo.core.losses.checks.Checker`,
so that :func:`fnppo.core.losses.flat.from_flat` applies the same rule under the flat names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

import torch

from fnppo.core.losses.checks import Checker
from fnppo.core.metrics import weighted_metric
from fnppo.core.segments import Segments
from fnppo.core.typing import Tensor

__all__ = ["ppo_clip", "gspo", "cispo", "gmpo", "sapo", "gpg", "reinforce"]
"""The built-in losses of this module (a new one: its class here and its name in this list; the rest is derived)."""


@dataclass(frozen=True)
class PolicyInputs:
    """What a policy loss receives (one object, so new fields never break user code).

    All tensors are ``[batch, seq]`` in the compute dtype (fp32, or fp64 if the inputs are fp64),
    and are 0 wherever ``mask`` is 0 (so nothing computed there can be inf/NaN).

    Attributes:
        logprobs: current policy log-probs; carries the gradient.
        old_logprobs: the proximal policy's log-probs (detached), the anchor of the trust region: the
            trainer's recompute of the policy at the start of the update (``fnppo.compute_logprobs``);
            with ``LossConfig.bypass_old_logprobs`` the rollout engine's log-probs, the behaviour
            policy, which then is the proximal one (``docs/conventions.md``, "which log-probs are which").
        advantages: per-token advantages (detached).
        mask: the float 0/1 loss mask.
        segments: token -> sequence grouping (``segments.sum``, ``segments.gather``).
        log_ratio_clamp: the bound of :meth:`log_ratio` (``LossConfig.log_ratio_clamp``).
        generator: optional ``torch.Generator`` for randomized losses (Clip-Cov).
        staleness: optional per-token age of the behaviour policy in versions (whole numbers
            ``>= 0``, detached, 0 off the mask; partial rollouts, ``Sample.staleness``); None: the
            batch carries none, and a loss whose formula depends on the age uses its own scalar.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    segments: Segments
    log_ratio_clamp: float = 20.0
    generator: torch.Generator | None = None
    staleness: Tensor | None = None

    def log_ratio(self) -> Tensor:
        """``clamp(logprobs - old_logprobs, -c, c)`` with ``c = log_ratio_clamp``."""
        c = self.log_ratio_clamp
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


class PolicyLoss(Protocol):
    """Any callable with this signature is a policy loss (no registration).

    It returns ``(per_token_loss, metrics)``:

    * ``per_token_loss``: ``[batch, seq]``, the loss of each token *before* aggregation (to be
      minimized; a surrogate objective enters with a minus sign). Values where ``x.mask`` is 0 are
      ignored. :func:`fnppo.core.losses.ppo.ppo_loss` multiplies it by the TIS weights and
      aggregates it with ``LossConfig.agg``; sequence-level losses broadcast their per-sequence
      value to the tokens of the sequence (``x.segments.gather``).
    * ``metrics``: ``dict[str, Tensor]`` of ``[2]`` tensors ``(weighted_sum, weight)``, e.g.
      ``{"pg_clipfrac": x.token_metric(clipped.float())}``. A metric the loss does not return is
      absent from the step's metrics (a loss without a clip reports no ``pg_clipfrac``, not 0).

    Optional attribute ``uses_ratio: bool`` (default True when absent): whether the loss reads
    ``old_logprobs`` (an importance ratio). ``False`` for a REINFORCE-like loss: with
    ``bypass_old_logprobs`` it may then take TIS weights ``min(pi_theta / pi_rollout, tis_cap)``,
    which a ratio-based loss refuses (its ratio already is that weight). Example::

        def my_reinforce(x: PolicyInputs):
            return -x.advantages * x.logprobs, {}
        my_reinforce.uses_ratio = False
        config = LossConfig(policy=my_reinforce)

    Optional attribute ``uses_staleness: bool`` (default False when absent): whether the loss's
    formula depends on each token's age (``x.staleness``, partial rollouts); ``train_step`` then
    refuses samples that carry per-token versions but no ages (``Staleness.prepare`` gives them).
    """

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]: ...


def uses_ratio(loss: Any) -> bool:
    """The ``uses_ratio`` attribute of a policy loss, True when it has none."""
    return getattr(loss, "uses_ratio", True)


def bypass_only(loss: Any) -> bool:
    """The ``bypass_only`` attribute of a policy loss, False when it has none: True for a loss whose
    ``old_logprobs`` must be the behaviour policy's, the rollout engine's log-probs
    (``LossConfig(bypass_old_logprobs=True)``); outside bypass mode they would be the trainer's
    recomputed ones, and the loss would take the proximal policy for the behaviour policy."""
    return getattr(loss, "bypass_only", False)


def reads_probabilities(loss: Any) -> bool:
    """The ``reads_probabilities`` attribute of a policy loss, False when it has none: True for a loss
    that turns ``old_logprobs`` into probabilities (``exp``: DPPO's and IPO's trust regions), for
    which :func:`~fnppo.core.losses.ppo.ppo_loss` and the step refuse old (in bypass mode: rollout)
    log-probs above 0, a probability above 1."""
    return getattr(loss, "reads_probabilities", False)


def loss_name(loss: Any) -> str:
    """How messages name a policy loss: a function by its name, a built-in part by its ``repr``."""
    name = getattr(loss, "__name__", None)
    return name if isinstance(name, str) else repr(loss)


# =============================================================================================
# The rules of the parameters (shared with from_flat, which names them by their flat names)
# =============================================================================================
def check_clip_bounds(c: Checker) -> None:
    """``clip_low`` and ``clip_high``: finite numbers >= 0."""
    for arg in ("clip_low", "clip_high"):
        c.number(arg, 0)


def check_dual_clip(c: Checker) -> None:
    """``dual_clip``: a number > 1 or None."""
    v = c.get("dual_clip")
    c.need(
        v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 1),
        "dual_clip",
        "a number > 1 or None",
    )


def check_ppo_clip(c: Checker) -> None:
    check_clip_bounds(c)
    check_dual_clip(c)


def check_cispo(c: Checker) -> None:
    c.number("clip_low", 0, high=1, expected="a number in [0, 1]")
    c.number("clip_high", 0, expected="a number >= 0")


def check_sapo(c: Checker) -> None:
    for arg in ("tau_pos", "tau_neg"):
        c.number(arg, 0, strict=True, expected="a number > 0")


# =============================================================================================
# Built-in policy losses
# =============================================================================================
class Builtin:
    """What a built-in policy loss declares once, in its class (everything else is derived from it).

    A built-in loss is one frozen dataclass with a lowercase name, written and called like a
    function: ``ppo_clip(clip_high=0.28)`` builds it (validated), its ``repr`` is that expression,
    and ``fnppo.losses.ppo_clip`` is its one public name. Its class attributes:

    * ``flat_name``: its ``policy_loss`` name in :func:`fnppo.core.losses.flat.from_flat` (a class
      without one is not reachable by a flat name);
    * ``flat_fields``: ``{flat field: attribute}``, the flat fields it reads; the flat defaults are
      its dataclass field defaults (:data:`fnppo.core.losses.flat.DEFAULTS`);
    * ``rule``: the rule of its parameters over a :class:`~fnppo.core.losses.checks.Checker`, run when
      built (also by ``dataclasses.replace``) and by ``from_flat`` under the flat names;
    * ``uses_ratio`` (:func:`uses_ratio`), ``bypass_only`` (:func:`bypass_only`) and
      ``reads_probabilities`` (:func:`reads_probabilities`): what it reads and how;
    * ``split_invariant``: False for a loss whose per-token value depends on statistics of the
      micro-batch it sees (``clip_cov``, ``kl_cov``), so that the step's loss depends on the split;
    * ``per_sequence``: True for a loss whose token reads a statistic of its whole sequence (a
      sequence ratio or mean: ``gspo``, ``gmpo``), which context parallelism (a rank holds part of
      every sequence) refuses.

    A new built-in loss is its class and its name in its module's ``__all__``: the package's exports,
    the flat tables and the tests' list (:data:`fnppo.core.losses.builtins.BUILTIN_LOSSES`) derive from it.
    """

    flat_name: ClassVar[str | None] = None
    flat_fields: ClassVar[Mapping[str, str]] = MappingProxyType({})
    bypass_only: ClassVar[bool] = False
    reads_probabilities: ClassVar[bool] = False
    split_invariant: ClassVar[bool] = True
    per_sequence: ClassVar[bool] = False

    @staticmethod
    def rule(c: Checker) -> None:
        """No parameters to check."""

    def __post_init__(self) -> None:
        self.rule(Checker.of(self, f"fnppo.losses.{type(self).__name__}"))


_CLIP = MappingProxyType({"clip_ratio_low": "clip_low", "clip_ratio_high": "clip_high"})
_DUAL = MappingProxyType({**_CLIP, "clip_ratio_c": "dual_clip"})


def exp_where(log_ratio: Tensor, used: Tensor) -> Tensor:
    """``exp(log_ratio)`` where ``used``, 1 elsewhere: the entries a ``torch.where`` will not select are
    computed on a safe input (0), so that an overflow there (``exp`` -> inf) cannot reach the gradient
    as ``0 * inf = NaN``. The rule of every masked branch of the built-in losses."""
    return torch.exp(torch.where(used, log_ratio, torch.zeros_like(log_ratio)))


def clipped_surrogate(
    log_ratio: Tensor, adv: Tensor, low: float, high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO pessimistic surrogate of ``r = exp(log_ratio)``; returns (loss, clipped, dual_clipped) per token.

    A token is clipped only where the clipped term is strictly larger (resp. the dual bound
    strictly smaller); on a bound (equal terms) it is not clipped and keeps the unclipped gradient
    (``torch.where``, not ``torch.minimum``, whose gradient a tie would split in half). The clipped
    terms are constants where they are selected (the clamp is active there), and the unclipped term
    is evaluated only where it is selected (:func:`exp_where`), so a ratio that overflows on a
    clipped token, or on a token with ``A = 0`` (loss 0), gives no NaN gradient.
    """
    ratio = torch.exp(log_ratio.detach())  # the comparisons (inf on an overflow is fine there)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipped = l2 > l1
    if dual_clip is not None:
        l3 = -adv * dual_clip
        lower = (adv < 0) & ~clipped & (l1 > l3)
    else:
        l3, lower = l2, torch.zeros_like(clipped)
    kept = ~clipped & ~lower & (adv != 0)
    unclipped = -adv * exp_where(log_ratio, kept)
    return torch.where(clipped, l2, torch.where(lower, l3, unclipped)), clipped, lower


@dataclass(frozen=True)
class ppo_clip(Builtin):
    """PPO clipped surrogate with asymmetric and dual clipping (:func:`ppo_clip`).

    ``r = exp(logp - logp_old)``, ``l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` and,
    for ``A < 0``, ``l = min(l, -A c)`` (dual clip, ``c = dual_clip``; None: off). ``pg_clipfrac``
    counts the tokens where the clipped term is strictly larger, ``pg_clipfrac_lower`` those where
    ``-A c`` is strictly smaller; a ratio exactly on ``1 - clip_low``, ``1 + clip_high`` or ``c``
    is not clipped and keeps the gradient of ``-A r``.

    References: PPO, arXiv:1707.06347; dual-clip PPO, arXiv:1912.09729; clip-higher (asymmetric
    bounds), DAPO, arXiv:2503.14476.
    """

    flat_name: ClassVar[str] = "ppo"
    flat_fields: ClassVar[Mapping[str, str]] = _DUAL
    rule = staticmethod(check_ppo_clip)

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = 3.0

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        loss, clipped, lower = clipped_surrogate(
            x.log_ratio(), x.advantages, self.clip_low, self.clip_high, self.dual_clip
        )
        return loss, {
            "pg_clipfrac": x.token_metric(clipped.float()),
            "pg_clipfrac_lower": x.token_metric(lower.float()),
        }


@dataclass(frozen=True)
class gspo(Builtin):
    """GSPO: clipped surrogate on the length-normalized sequence ratio (token-level form GSPO-token).

    ``log s_i = mean_t (logp_t - logp_old_t)`` over the valid tokens of sequence i and, per token,
    ``s_it = sg(s_i) * exp(logp_t - sg(logp_t))``: its value is ``s_i`` and its gradient is
    ``s_i * grad logp_t``. Loss ``max(-A s_it, -A clip(s_it, 1 - clip_low, 1 + clip_high))``, no
    dual clip (the paper uses bounds ~3e-4 / 4e-4). With ``Aggregation("seq-mean-token-mean")``
    this is the paper's objective. Only the stopped part of the log-ratio is clamped, so gradients
    survive the clamp.

    Reference: Group Sequence Policy Optimization, arXiv:2507.18071.
    """

    flat_name: ClassVar[str] = "gspo"
    flat_fields: ClassVar[Mapping[str, str]] = _CLIP
    rule = staticmethod(check_clip_bounds)
    per_sequence: ClassVar[bool] = True

    clip_low: float = 0.2
    clip_high: float = 0.2

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        c = x.log_ratio_clamp
        seq_log_ratio = x.seq_mean(x.logprobs.detach() - x.old_logprobs)
        log_s = torch.clamp(seq_log_ratio, -c, c) + x.logprobs - x.logprobs.detach()
        loss, clipped, _ = clipped_surrogate(log_s, x.advantages, self.clip_low, self.clip_high, None)
        return loss, {"pg_clipfrac": x.token_metric(clipped.float())}


@dataclass(frozen=True)
class cispo(Builtin):
    """CISPO: REINFORCE weighted by the clipped, stopped importance ratio.

    ``l = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp``; every token keeps a gradient
    ``-clip(r) A grad logp``. (The loss value contains ``logp``; only its gradient is meaningful.)
    MiniMax-M1 used no lower bound (``clip_low = 1``) and tuned the upper one.

    Reference: MiniMax-M1, arXiv:2506.13585.
    """

    flat_name: ClassVar[str] = "cispo"
    flat_fields: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"cispo_clip_low": "clip_low", "cispo_clip_high": "clip_high"}
    )
    rule = staticmethod(check_cispo)

    clip_low: float = 1.0
    clip_high: float = 0.28

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        ratio = x.ratio().detach()
        weight = torch.clamp(ratio, 1.0 - self.clip_low, 1.0 + self.clip_high)
        clipped = weight != ratio
        return -weight * x.advantages * x.logprobs, {"pg_clipfrac": x.token_metric(clipped.float())}


@dataclass(frozen=True)
class gmpo(Builtin):
    """GMPO: the geometric mean of token ratios, with token-level clipping in log space.

    Per token ``u_t = sgn(A) min(sgn(A) log r_t, sgn(A) clip(log r_t, -clip_low, clip_high))``;
    per sequence ``A_i = mean_t A_t`` and ``l_i = -A_i exp(mean_t u_t)`` (means over valid tokens),
    broadcast to the tokens of the sequence. With ``Aggregation("seq-mean-token-mean")`` the loss is
    the paper's mean over sequences. The bounds are log-space bounds here (the paper uses 0.4).

    Reference: Geometric-Mean Policy Optimization, arXiv:2507.20673.
    """

    flat_name: ClassVar[str] = "gmpo"
    flat_fields: ClassVar[Mapping[str, str]] = _CLIP
    rule = staticmethod(check_clip_bounds)
    per_sequence: ClassVar[bool] = True

    clip_low: float = 0.2
    clip_high: float = 0.2

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        log_ratio = x.log_ratio()
        sign = torch.sign(x.advantages)
        clipped_lr = torch.clamp(log_ratio, -self.clip_low, self.clip_high)
        u = sign * torch.minimum(sign * log_ratio, sign * clipped_lr)
        seq_adv = x.seq_mean(x.advantages)
        loss = -seq_adv * torch.exp(x.seq_mean(u))
        clipped = sign * log_ratio > sign * clipped_lr
        return loss, {"pg_clipfrac": x.token_metric(clipped.float())}


@dataclass(frozen=True)
class sapo(Builtin):
    """SAPO: a smooth sigmoid gate instead of the hard clip.

    ``l = -f(r) A`` with ``f(r) = (4 / tau) sigmoid(tau (r - 1))`` and ``tau = tau_pos`` for
    ``A > 0``, ``tau_neg`` otherwise. ``f'(r) = 4 sigmoid(1 - sigmoid)`` equals 1 at ``r = 1``
    (the on-policy gradient) and decays smoothly off-policy.

    Reference: Soft Adaptive Policy Optimization, arXiv:2511.20347.
    """

    flat_name: ClassVar[str] = "sapo"
    flat_fields: ClassVar[Mapping[str, str]] = MappingProxyType({"sapo_tau_pos": "tau_pos", "sapo_tau_neg": "tau_neg"})
    rule = staticmethod(check_sapo)

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        adv = x.advantages
        # the temperatures take the inputs' dtype (two Python floats in torch.where would make fp32)
        tau = torch.where(adv > 0, adv.new_tensor(self.tau_pos), adv.new_tensor(self.tau_neg))
        # beyond r = 1 + 40 / tau the gate is 1 exactly (sigmoid(40) rounds to 1 in fp32 and fp64) and its
        # gradient 0: the log-ratio is capped there, so an overflowing ratio gives no 0 * inf = NaN gradient
        log_ratio, cap = x.log_ratio(), torch.log1p(40.0 / tau)
        ratio = torch.exp(torch.where(log_ratio > cap, cap, log_ratio))
        gate = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
        return -gate * adv, {}


def _plain_policy_gradient(x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
    return -x.advantages * x.logprobs, {}


@dataclass(frozen=True)
class reinforce(Builtin):
    """Plain policy gradient ``l = -A * logp`` (on-policy; ``old_logprobs`` is not used).

    With ``bypass_old_logprobs`` and ``tis_cap`` it is the REINFORCE estimator of rollout
    correction: ``l = -min(sg(pi_theta / pi_rollout), tis_cap) A logp``.

    Reference: Williams (1992), "Simple statistical gradient-following algorithms for connectionist
    reinforcement learning".
    """

    flat_name: ClassVar[str] = "reinforce"
    uses_ratio: ClassVar[bool] = False

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        return _plain_policy_gradient(x)


@dataclass(frozen=True)
class gpg(Builtin):
    """Group Policy Gradient: the plain policy gradient ``l = -A * logp`` of :class:`reinforce`
    (GPG's advantage correction is left to the advantage estimator, ``gpg_advantages``).

    Reference: GPG, arXiv:2504.02546.
    """

    flat_name: ClassVar[str] = "gpg"
    uses_ratio: ClassVar[bool] = False

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        return _plain_policy_gradient(x)
