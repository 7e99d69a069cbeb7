"""The covariance-based policy losses Clip-Cov and KL-Cov (pure torch).

Both act on the few tokens whose centered covariance ``cov_t = (A_t - mean A)(logp_t - mean logp)``
(over the valid tokens of the micro-batch) is largest, the tokens that drive the collapse of the
policy's entropy: Clip-Cov stops their gradient, KL-Cov adds a KL penalty to them. Neither is
split-invariant (the statistics are per micro-batch), as in their paper.

Reference: The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models, arXiv:2505.22617.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import torch

from fnppo.core.losses.checks import Checker
from fnppo.core.losses.policy import _DUAL, Builtin, PolicyInputs, check_ppo_clip, clipped_surrogate, exp_where
from fnppo.core.typing import Tensor

__all__ = ["clip_cov", "kl_cov"]
"""The built-in losses of this module (a new one: its class here and its name in this list; the rest is derived)."""


def check_cov_ratio(c: Checker) -> None:
    c.number("ratio", 0, high=1, expected="a number in [0, 1]")


def check_clip_cov(c: Checker) -> None:
    check_ppo_clip(c)
    check_cov_ratio(c)
    c.number("lb")
    lb = c.get("lb")
    c.number("ub", lb, strict=True, expected=f"a number > {c.label('lb')}={lb!r}")


def check_kl_cov(c: Checker) -> None:
    check_cov_ratio(c)
    c.number("coef", 0, expected="a number >= 0")


def _select_first_k(keys: Tensor, eligible: Tensor, k: Tensor) -> Tensor:
    """Boolean mask of the ``k`` eligible entries with the largest ``keys`` (no host sync)."""
    flat_keys = torch.where(eligible, keys, torch.full_like(keys, -math.inf)).reshape(-1)
    flat_eligible = eligible.reshape(-1)
    order = torch.argsort(flat_keys, descending=True)
    rank_ok = torch.arange(order.numel(), device=keys.device) < k
    chosen_sorted = rank_ok & flat_eligible[order]
    chosen = torch.zeros_like(flat_eligible).scatter(0, order, chosen_sorted)
    return chosen.reshape(keys.shape)


def _covariance(x: PolicyInputs) -> tuple[Tensor, Tensor]:
    """Centered token covariance ``(A - mean A)(logp - mean logp)`` over valid tokens; and the count."""
    n = x.mask.sum()
    safe_n = torch.where(n > 0, n, torch.ones_like(n))
    lp = x.logprobs.detach()
    mean_a = (x.advantages * x.mask).sum() / safe_n
    mean_lp = (lp * x.mask).sum() / safe_n
    return (x.advantages - mean_a) * (lp - mean_lp), n


@dataclass(frozen=True)
class clip_cov(Builtin):
    """Clip-Cov: PPO loss with the gradient of a few high-covariance tokens stopped.

    ``cov_t = (A_t - mean A)(logp_t - mean logp)`` over the valid tokens of the micro-batch. Among
    valid tokens not already clipped by PPO with ``lb < cov_t < ub``,
    ``k = max(floor(ratio * n_valid), 1)`` are drawn uniformly at random (the ``generator`` of
    :func:`fnppo.core.losses.ppo.ppo_loss`) and their loss is detached (value kept, gradient 0). The
    rest is the loss of :class:`~fnppo.core.losses.policy.ppo_clip` (``clip_low``, ``clip_high``, ``dual_clip``). Not
    split-invariant: statistics are per micro-batch.

    Reference: The Entropy Mechanism of RL for Reasoning LMs, arXiv:2505.22617.
    """

    flat_name: ClassVar[str] = "clip_cov"
    flat_fields: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"clip_cov_ratio": "ratio", "clip_cov_lb": "lb", "clip_cov_ub": "ub", **_DUAL}
    )
    rule = staticmethod(check_clip_cov)
    split_invariant: ClassVar[bool] = False

    ratio: float = 2e-4
    lb: float = 1.0
    ub: float = 5.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = 3.0

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        loss, clipped, lower = clipped_surrogate(
            x.log_ratio(), x.advantages, self.clip_low, self.clip_high, self.dual_clip
        )
        cov, n = _covariance(x)
        valid = x.mask > 0
        eligible = valid & ~clipped & (cov > self.lb) & (cov < self.ub)
        k = torch.clamp(torch.floor(self.ratio * n), min=1.0)
        keys = torch.rand(cov.shape, generator=x.generator, device=cov.device, dtype=cov.dtype)
        chosen = _select_first_k(keys, eligible, k)
        loss = torch.where(chosen, loss.detach(), loss)
        return loss, {
            "pg_clipfrac": x.token_metric(clipped.float()),
            "pg_clipfrac_lower": x.token_metric(lower.float()),
            "clip_cov_frac": x.token_metric(chosen.float()),
        }


@dataclass(frozen=True)
class kl_cov(Builtin):
    """KL-Cov: unclipped surrogate plus a KL penalty on the highest-covariance tokens.

    ``l_t = -A_t r_t + coef * |log r_t| * [t in top-k of cov]`` with
    ``cov_t = (A_t - mean A)(logp_t - mean logp)`` over the valid tokens of the micro-batch and
    ``k = max(floor(ratio * n_valid), 1)``. Not split-invariant (per micro-batch top-k).

    Reference: The Entropy Mechanism of RL for Reasoning LMs, arXiv:2505.22617.
    """

    flat_name: ClassVar[str] = "kl_cov"
    flat_fields: ClassVar[Mapping[str, str]] = MappingProxyType({"kl_cov_ratio": "ratio", "kl_cov_coef": "coef"})
    rule = staticmethod(check_kl_cov)
    split_invariant: ClassVar[bool] = False

    ratio: float = 2e-4
    coef: float = 1.0

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        log_ratio = x.log_ratio()
        cov, n = _covariance(x)
        k = torch.clamp(torch.floor(self.ratio * n), min=1.0)
        chosen = _select_first_k(cov, x.mask > 0, k)
        surrogate = -x.advantages * exp_where(log_ratio, x.advantages != 0)  # A = 0: 0, whatever the ratio
        loss = surrogate + torch.where(chosen, self.coef * log_ratio.abs(), 0.0)
        return loss, {"kl_cov_frac": x.token_metric(chosen.float())}
