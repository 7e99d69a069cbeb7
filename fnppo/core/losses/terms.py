"""The terms of an objective beside the policy loss: the parts and the rules across them (pure Python).

An objective is the policy-gradient loss (``LossConfig.policy``, with its entropy bonus and KL
penalty: :func:`fnppo.core.losses.ppo.ppo_loss`) plus any of three terms, each a field of
:class:`~fnppo.core.losses.config.LossConfig`::

    LossConfig(policy=ppo_clip(), distill=ReverseKL(coef=1.0), ce=CrossEntropy(coef=0.1), ref_kl=RefKL(0.01))
    LossConfig(policy=None, distill=ReverseKL())          # pure distillation: no advantages needed

* ``distill``: a :class:`~fnppo.core.losses.distill.Distill` part (reverse or forward KL to a teacher);
* ``ce``: :class:`CrossEntropy` -- the negative log-likelihood of given tokens (SFT);
* ``ref_kl``: :class:`RefKL` -- a KL estimator to the reference policy as a term of its own.

Each term is ``coef * sum_t a_t l_t / N`` over its own tokens: with ``normalizer="own"`` (the
default, as prime-rl normalizes each of its loss terms by its own token count) ``a_t`` and ``N``
are those of the term's own :class:`~fnppo.core.losses.aggregate.Aggregation` (``token-mean`` by
default), ``N`` summed over the whole step; with ``"shared"`` they are the policy loss's
(``LossConfig.agg``, its normalizer). Computed by :func:`fnppo.core.losses.objective.terms_loss`;
:func:`check_terms` holds the rules between the terms and the rest of the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fnppo.core.errors import check_bool_fields
from fnppo.core.losses.aggregate import Aggregation
from fnppo.core.losses.checks import Checker
from fnppo.core.losses.distill import Distill, check_term
from fnppo.core.losses.kl import KL_ESTIMATORS

__all__ = ["CrossEntropy", "RefKL", "TERMS", "check_terms", "terms_of", "term_agg"]

TERMS = ("distill", "ce", "ref_kl")
"""The term fields of ``LossConfig`` (besides the policy loss), in the order they are added."""


@dataclass(frozen=True)
class CrossEntropy:
    """``coef * (-log p(token))`` on given tokens (supervised fine-tuning), as a term of the objective.

    The tokens are those of ``Sample.ce_mask`` (a 0/1 mask over the response) where the samples
    carry one, else the response tokens of ``loss_mask``: a batch can mix demonstrations (``ce_mask``
    1, ``response_mask`` 0: no policy or distillation loss on them) with rollouts. The log-probs are
    the step's (at ``StepConfig.temperature``).

    Attributes:
        coef: the weight, a finite number >= 0.
        agg: the term's :class:`Aggregation` (None: ``token-mean``, or ``LossConfig.agg`` when shared).
        normalizer: ``"own"`` (default) or ``"shared"``.

    Raises:
        InputError: a field out of range.
    """

    coef: float = 1.0
    agg: Aggregation | None = None
    normalizer: str = "own"

    def __post_init__(self) -> None:
        check_bool_fields("fnppo.losses.CrossEntropy", self)
        check_term(Checker.of(self, "fnppo.losses.CrossEntropy"))


@dataclass(frozen=True)
class RefKL:
    """``coef * KL(policy || ref)`` per token (the estimator of :func:`fnppo.core.losses.kl.kl_penalty`
    on ``ref_logprobs``), as a term with its own normalizer; ``LossConfig.kl`` is the same penalty
    inside the policy loss (shared normalizer). One of the two at a time.

    Attributes:
        coef: the weight, a finite number >= 0.
        estimator: one of :data:`~fnppo.core.losses.kl.KL_ESTIMATORS` (default ``"k3"``).
        agg, normalizer: as :class:`CrossEntropy`.

    Raises:
        InputError: a field out of range.
    """

    coef: float
    estimator: str = "k3"
    agg: Aggregation | None = None
    normalizer: str = "own"

    def __post_init__(self) -> None:
        check_bool_fields("fnppo.losses.RefKL", self)
        c = Checker.of(self, "fnppo.losses.RefKL")
        check_term(c)
        c.need(self.estimator in KL_ESTIMATORS, "estimator", f"one of {list(KL_ESTIMATORS)}")


_TYPES = {
    "distill": (Distill, "a ReverseKL or ForwardKL part or None"),
    "ce": (CrossEntropy, "a CrossEntropy or None"),
    "ref_kl": (RefKL, "a RefKL or None"),
}


def terms_of(config: Any) -> dict[str, Any]:
    """The terms a config sets, by field name (in :data:`TERMS` order)."""
    return {name: getattr(config, name) for name in TERMS if getattr(config, name, None) is not None}


def term_agg(part: Any, config: Any) -> Aggregation:
    """The aggregation of a term: its own (``token-mean`` when None), or ``config.agg`` when shared."""
    if part.normalizer == "shared":
        return config.agg
    return part.agg if part.agg is not None else Aggregation()


def check_terms(c: Checker) -> None:
    """The rules of the terms in a loss config read through ``c`` (paths ``policy``, ``distill``,
    ``ce``, ``ref_kl``, ``entropy_coef``, ``kl``, ``correction``, ``bypass_old_logprobs``):

    * each term is its part's type or None;
    * without a policy loss (``policy=None``, a pure distillation or SFT objective) at least one term,
      and none of the policy loss's own parts: no entropy bonus, KL penalty, rollout correction or
      bypass mode (they are parts of the policy term; ``ref_kl`` is the KL without it);
    * ``ref_kl`` and a non-zero ``kl.coef`` are not both set (one KL to the reference).
    """
    for name in TERMS:
        kind, what = _TYPES[name]
        c.need(c.get(name) is None or isinstance(c.get(name), kind), name, what)
    kl = c.get("kl")
    if c.get("policy") is None:
        c.need(
            any(c.get(name) is not None for name in TERMS),
            "policy",
            "a policy loss, or None together with a term (distill, ce or ref_kl): an objective needs a term",
        )
        why = "(a part of the policy term; without a policy loss it has nothing to act on)"
        c.need(c.get("entropy_coef") == 0, "entropy_coef", f"0 with policy=None {why}")
        c.need(kl is None or kl.coef == 0, "kl", f"None with policy=None (use ref_kl=RefKL(...)) {why}")
        c.need(c.get("correction") is None, "correction", f"None with policy=None {why}")
        c.need(not c.get("bypass_old_logprobs"), "bypass_old_logprobs", f"False with policy=None {why}")
    if c.get("ref_kl") is not None:
        c.need(
            kl is None or kl.coef == 0,
            "kl",
            "None (or coef 0) with ref_kl set: one KL to the reference (kl inside the policy term, ref_kl as a term)",
        )
