"""The loss configuration: :class:`LossConfig`, a frozen composition of parts (pure Python).

A loss is built from parts, each a small frozen dataclass validated when built::

    LossConfig(policy=cispo(clip_high=0.28), agg=Aggregation("seq-mean-token-mean"), entropy_coef=0.01,
               kl=KLPenalty(0.05, "low_var_kl"), correction=RolloutCorrection(tis_cap=2.0))

The parts live beside it: the policy losses in :mod:`fnppo.core.losses.policy` (any callable
``PolicyInputs -> (per_token_loss, metrics)`` will do), :class:`~fnppo.core.losses.aggregate.Aggregation`,
:class:`~fnppo.core.losses.kl.KLPenalty` and :class:`~fnppo.core.losses.rollout_correction.RolloutCorrection`.
The rules across parts (bypass mode with a ratio-based loss, batch normalization in bypass mode) live
in :func:`check_cross`, shared with :func:`fnppo.core.losses.flat.from_flat`, which applies them under
the flat names.
"""

from __future__ import annotations

from dataclasses import dataclass

from fnppo.core.errors import check_bool_fields, input_error
from fnppo.core.losses.aggregate import Aggregation
from fnppo.core.losses.checks import Checker
from fnppo.core.losses.distill import Distill
from fnppo.core.losses.kl import KLPenalty
from fnppo.core.losses.policy import PolicyLoss, bypass_only, loss_name, ppo_clip, uses_ratio
from fnppo.core.losses.rollout_correction import RolloutCorrection
from fnppo.core.losses.terms import CrossEntropy, RefKL, check_terms

__all__ = ["LossConfig", "check_cross"]


def check_cross(c: Checker, policy: PolicyLoss) -> None:
    """The rules across parts, read by the paths ``bypass_old_logprobs``, ``correction.tis_cap`` and
    ``correction.batch_normalize`` (None where there is no correction):

    * in bypass mode a ratio-based policy loss takes no ``tis_cap`` (its ratio
      ``pi_theta / pi_rollout`` already is the importance weight);
    * batch normalization is refused in bypass mode (the weights would depend on the current
      parameters, known only in the forward pass);
    * a policy loss that is ``bypass_only`` (:func:`~fnppo.core.losses.policy.bypass_only`:
      ``loglinear_decoupled``) needs bypass mode: its ``old_logprobs`` must be the behaviour
      policy's, the rollout engine's log-probs, not the trainer's recomputed ones.
    """
    if not c.get("bypass_old_logprobs"):
        c.need(
            not bypass_only(policy),
            "bypass_old_logprobs",
            f"True with the policy loss {loss_name(policy)!r}: it reads old_logprobs as the behaviour policy's "
            "(the rollout engine's) log-probs, which bypass mode passes; outside it they are the trainer's "
            "recomputed ones and the loss would take the proximal policy for the behaviour policy",
        )
        return
    if uses_ratio(policy):
        c.need(
            c.get("correction.tis_cap") is None,
            "correction.tis_cap",
            f"None with {c.label('bypass_old_logprobs')}=True and the ratio-based policy loss "
            f"{loss_name(policy)!r} (its ratio pi_theta / pi_rollout already is the importance weight)",
        )
    c.need(
        c.get("correction.m2_threshold") is None,
        "correction.m2_threshold",
        f"None with {c.label('bypass_old_logprobs')}=True (M2PO's d = logp_old - logp_rollout would depend on the "
        "current parameters, known only in the forward pass)",
    )
    c.need(
        not c.get("correction.batch_normalize"),
        "correction.batch_normalize",
        f"False with {c.label('bypass_old_logprobs')}=True (the weights would depend on the current parameters, "
        "known only in the forward pass)",
    )


@dataclass(frozen=True)
class LossConfig:
    """Configuration of :func:`fnppo.core.losses.ppo.ppo_loss` (``StepConfig.loss``). Frozen, hashable;
    validated when built (also by ``dataclasses.replace``).

    Attributes:
        policy: the per-token policy loss, any callable ``PolicyInputs -> (per_token_loss, metrics)``
            (:class:`~fnppo.core.losses.policy.PolicyLoss`); default :func:`~fnppo.core.losses.policy.ppo_clip`.
        agg: the :class:`~fnppo.core.losses.aggregate.Aggregation` of the per-token losses.
        entropy_coef: weight of the entropy bonus (the loss gets ``- entropy_coef * entropy``),
            ``>= 0`` (a negative value would silently turn the bonus into a penalty).
        kl: the :class:`~fnppo.core.losses.kl.KLPenalty` ``KL(policy || ref)`` (needs ``ref_logprobs``
            when its ``coef != 0``); ``None``: no penalty. Either way, when ``ref_logprobs`` are given
            the ``kl_loss`` metric is reported (with the estimator of ``kl``, ``"k3"`` when ``kl`` is
            None).
        correction: the :class:`~fnppo.core.losses.rollout_correction.RolloutCorrection` against the rollout
            engine's log-probs (truncated importance weights, rejection, batch normalization);
            ``None``: none.
        bypass_old_logprobs: bypass mode: the rollout engine's log-probs serve as the old
            log-probs (no separate old log-prob pass; ``old_logprobs`` may be None and is ignored).
            Ratios and clipping are then ``pi_theta / pi_rollout``, and the rollout correction
            compares ``sg(logp)`` with the rollout log-probs. ``correction.tis_cap`` is refused for a
            policy loss that uses a ratio (the ratio already is the importance weight); a ratio-free
            loss (``uses_ratio=False``: ``gpg``, ``reinforce``) is weighted by
            ``min(sg(pi_theta / pi_rollout), tis_cap)``. ``correction.batch_normalize`` is refused.
            (verl's ``bypass_mode``.)
        log_ratio_clamp: log-ratios (policy, KL and rollout correction) are clamped to
            ``[-log_ratio_clamp, log_ratio_clamp]`` before ``exp`` so that no inf/NaN appears.
        distill, ce, ref_kl: terms of the objective beside the policy loss, each None (default) or
            its part: a distillation term (:class:`~fnppo.core.losses.distill.ReverseKL`,
            :class:`~fnppo.core.losses.distill.ForwardKL`), a cross-entropy on given tokens
            (:class:`~fnppo.core.losses.terms.CrossEntropy`), a KL to the reference with its own
            normalizer (:class:`~fnppo.core.losses.terms.RefKL`). ``policy=None`` with a term is an
            objective without a policy loss (pure distillation or SFT: no advantages or old
            log-probs needed). :mod:`fnppo.core.losses.terms` states the rules.

    Raises:
        InputError: ``fnppo.losses.LossConfig: argument '<field>' ...``: a part of the wrong type, a
            bad number or bool, or parts that do not combine (see :func:`check_cross`).
    """

    policy: PolicyLoss | None = ppo_clip()
    agg: Aggregation = Aggregation()
    entropy_coef: float = 0.0
    kl: KLPenalty | None = None
    correction: RolloutCorrection | None = None
    bypass_old_logprobs: bool = False
    log_ratio_clamp: float = 20.0
    distill: Distill | None = None
    ce: CrossEntropy | None = None
    ref_kl: RefKL | None = None

    def __post_init__(self) -> None:
        fn = "fnppo.losses.LossConfig"
        check_bool_fields(fn, self)
        c = Checker.of(self, fn)
        if isinstance(self.policy, type):
            raise input_error(
                fn,
                "policy",
                f"a policy loss instance: the loss built, e.g. {self.policy.__name__}() "
                "(a class is callable, but calling it builds a loss, it computes none)",
                f"the class {self.policy.__module__}.{self.policy.__qualname__}",
            )
        if self.policy is not None and not callable(self.policy):
            raise input_error(
                fn,
                "policy",
                "a policy loss: a callable taking PolicyInputs (e.g. fnppo.losses.ppo_clip(), or a plain function)",
                repr(self.policy),
            )
        c.need(
            isinstance(uses_ratio(self.policy), bool),
            "policy",
            "a policy loss whose attribute uses_ratio (if any) is a bool",
        )
        c.need(isinstance(self.agg, Aggregation), "agg", "an Aggregation (e.g. Aggregation('token-mean'))")
        c.number("entropy_coef", 0)
        c.need(self.kl is None or isinstance(self.kl, KLPenalty), "kl", "a KLPenalty or None")
        c.need(
            self.correction is None or isinstance(self.correction, RolloutCorrection),
            "correction",
            "a RolloutCorrection or None",
        )
        c.number("log_ratio_clamp", 0, strict=True, expected="a number > 0")
        check_terms(c)
        corr = self.correction
        check_cross(
            Checker(
                fn,
                {
                    "bypass_old_logprobs": self.bypass_old_logprobs,
                    "correction.tis_cap": None if corr is None else corr.tis_cap,
                    "correction.batch_normalize": corr is not None and corr.batch_normalize,
                    "correction.m2_threshold": None if corr is None else corr.m2_threshold,
                }.__getitem__,
            ),
            self.policy,
        )

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the loss reads the trainer's old log-probs: outside bypass mode, a policy loss that
        uses the ratio (:func:`~fnppo.core.losses.policy.uses_ratio`) or a rollout correction (its
        weights compare them with the rollout log-probs). ``gpg`` / ``reinforce`` without a
        correction read none (their ``ppo_kl`` metric is then not reported)."""
        return not self.bypass_old_logprobs and (uses_ratio(self.policy) or self.correction is not None)

    @property
    def needs_rollout_logprobs(self) -> bool:
        """Whether the loss needs the rollout engine's log-probs (bypass mode or a rollout correction)."""
        return self.bypass_old_logprobs or self.correction is not None
