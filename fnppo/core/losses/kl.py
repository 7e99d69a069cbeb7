"""The KL penalty to a reference policy: per-token estimators and the :class:`KLPenalty` part (pure torch).

* :func:`kl_penalty` -- per-token KL estimators k1, k2, k3, abs (and straight-through ``"+"``).
* :class:`KLPenalty` -- the coefficient and estimator of ``LossConfig.kl`` (validated when built);
  a KL controller (:mod:`fnppo.core.losses.kl_control`) replaces its ``coef``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from fnppo.core.errors import input_error
from fnppo.core.losses.checks import Checker, finite_number
from fnppo.core.typing import TokenFloat, typechecked

__all__ = ["KL_ESTIMATORS", "KLPenalty", "kl_penalty", "check_kl"]

_KL_BASE = MappingProxyType({"k1": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"})
KL_ESTIMATORS = tuple(_KL_BASE) + tuple(name + "+" for name in _KL_BASE)
"""The KL estimator names accepted by :func:`kl_penalty` (``"+"``: straight-through k2 gradient)."""


def check_kl(c: Checker) -> None:
    """``coef``: a finite number >= 0; ``estimator``: one of :data:`KL_ESTIMATORS`."""
    c.number("coef", 0)
    c.need(c.get("estimator") in KL_ESTIMATORS, "estimator", f"one of {list(KL_ESTIMATORS)}")


@dataclass(frozen=True)
class KLPenalty:
    """The KL penalty ``coef * KL(policy || ref)`` of the loss (needs ``ref_logprobs`` when ``coef != 0``).

    Attributes:
        coef: the weight, a finite number ``>= 0``. ``0``: no penalty, only the ``kl_loss`` metric
            (with this estimator) when ``ref_logprobs`` are given.
        estimator: one of :data:`KL_ESTIMATORS` (see :func:`kl_penalty`).

    Raises:
        InputError: ``fnppo.losses.KLPenalty: argument '<field>' ...`` for a value out of range.
    """

    coef: float
    estimator: str = "k3"

    def __post_init__(self) -> None:
        check_kl(Checker.of(self, "fnppo.losses.KLPenalty"))


@typechecked
def kl_penalty(
    logprobs: TokenFloat, ref_logprobs: TokenFloat, estimator: str = "k3", *, log_ratio_clamp: float = 20.0
) -> TokenFloat:
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
        raise input_error("fnppo.losses.kl_penalty", "estimator", f"one of {list(KL_ESTIMATORS)}", repr(estimator))
    if not (finite_number(log_ratio_clamp) and log_ratio_clamp > 0):
        raise input_error("fnppo.losses.kl_penalty", "log_ratio_clamp", "a number > 0", repr(log_ratio_clamp))
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
