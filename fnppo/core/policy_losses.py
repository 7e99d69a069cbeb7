"""The policy-loss registry and the built-in policy losses (pure torch, no Megatron).

A policy loss maps one :class:`PolicyLossInputs` to ``(per_token_loss, metrics)``;
:func:`fnppo.core.loss.ppo_loss` weights, aggregates and combines it with the entropy bonus and the KL
penalty. ``PolicyLossConfig(policy_loss=name)`` picks one by name.

* :func:`register_policy_loss` / :func:`get_policy_loss` / :func:`registered_policy_losses` --
  the registry.
* Built in: ``ppo`` (clipped surrogate, dual clip, clip-higher), ``gspo``, ``cispo``, ``gpg`` and
  ``reinforce``, ``gmpo``, ``sapo``, ``clip_cov``, ``kl_cov`` (each function's docstring gives
  its formula and paper).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fnppo.core.metrics import weighted_metric
from fnppo.core.segments import Segments
from fnppo.core.typing import Tensor, input_error

if TYPE_CHECKING:
    from fnppo.core.loss import PolicyLossConfig

__all__ = [
    "PolicyLossInputs",
    "PolicyLossFn",
    "register_policy_loss",
    "get_policy_loss",
    "registered_policy_losses",
]


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
        old_logprobs: behaviour-policy log-probs (detached); the rollout engine's log-probs when
            ``config.bypass_old_logprobs`` is set.
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
_RATIO_FREE: set[str] = set()
"""Names of the registered losses that never read ``old_logprobs`` (``uses_ratio=False``)."""


def register_policy_loss(name: str, *, override: bool = False,
                         uses_ratio: bool = True) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name`` for ``PolicyLossConfig(policy_loss=name)``.

    The function takes one :class:`PolicyLossInputs` and returns ``(per_token_loss, metrics)``:

    * ``per_token_loss``: ``[batch, seq]``, the loss of each token *before* aggregation (to be
      minimized; a surrogate objective enters with a minus sign). Values where ``inputs.mask`` is 0
      are ignored. :func:`fnppo.core.loss.ppo_loss` multiplies it by the TIS weights and aggregates it with
      ``loss_agg_mode``; sequence-level losses broadcast their per-sequence value to the tokens
      of the sequence (``inputs.segments.gather``).
    * ``metrics``: ``dict[str, Tensor]`` of ``[2]`` tensors ``(weighted_sum, weight)``, e.g.
      ``{"pg_clipfrac": inputs.token_metric(clipped.float())}``. ``pg_clipfrac`` and
      ``pg_clipfrac_lower`` default to 0 when not returned.

    Example::

        @fnppo.register_policy_loss("my_reinforce")
        def my_reinforce(x: fnppo.PolicyLossInputs):
            return -x.advantages * x.logprobs, {}

    Args:
        name: the name ``PolicyLossConfig.policy_loss`` refers to.
        override: replace a loss already registered under ``name``.
        uses_ratio: whether the loss reads ``old_logprobs`` (an importance ratio). ``False`` for a
            REINFORCE-like loss: with ``bypass_old_logprobs`` it may then take TIS weights
            ``min(pi_theta / pi_rollout, tis_cap)``, which a ratio-based loss refuses (its ratio
            already is that weight).

    Returns:
        The decorator (it returns the function unchanged).

    Raises:
        InputError: an empty name; a name already registered without ``override=True``.
    """
    if not isinstance(name, str) or not name:
        raise input_error("fnppo.register_policy_loss", "name", "a non-empty string", repr(name))

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _POLICY_LOSSES and not override:
            raise input_error("fnppo.register_policy_loss", "name", "a name not registered yet (or override=True)",
                              repr(name))
        _POLICY_LOSSES[name] = fn
        if uses_ratio:
            _RATIO_FREE.discard(name)
        else:
            _RATIO_FREE.add(name)
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name``.

    Raises:
        InputError: an unknown name (the message lists the registered ones).
    """
    try:
        return _POLICY_LOSSES[name]
    except (KeyError, TypeError):
        raise input_error("fnppo.get_policy_loss", "name", f"one of {sorted(_POLICY_LOSSES)}", repr(name)) from None


def registered_policy_losses() -> tuple[str, ...]:
    """Names of all registered policy losses, sorted."""
    return tuple(sorted(_POLICY_LOSSES))


# =============================================================================================
# Built-in policy losses
# =============================================================================================
def _clipped_surrogate(ratio: Tensor, adv: Tensor, cfg: PolicyLossConfig, dual: bool) -> tuple[Tensor, Tensor, Tensor]:
    """PPO pessimistic surrogate; returns (loss, clipped, dual_clipped) per token.

    A token is clipped only where the clipped term is strictly larger (resp. the dual bound
    strictly smaller); on a bound (equal terms) it is not clipped and keeps the unclipped gradient
    (``torch.where``, not ``torch.minimum``, whose gradient a tie would split in half).
    """
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    clipped = l2 > l1
    loss = torch.where(clipped, l2, l1)
    if dual and cfg.clip_ratio_c is not None:
        l3 = -adv * cfg.clip_ratio_c
        lower = (adv < 0) & (loss > l3)
        loss = torch.where(lower, l3, loss)
    else:
        lower = torch.zeros_like(clipped)
    return loss, clipped, lower


@register_policy_loss("ppo")
def ppo_clip_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric and dual clipping.

    ``r = exp(logp - logp_old)``, ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` and, for
    ``A < 0``, ``l = min(l, -A c)`` (dual clip, ``c = clip_ratio_c``). ``pg_clipfrac`` counts the
    tokens where the clipped term is strictly larger, ``pg_clipfrac_lower`` those where ``-A c`` is
    strictly smaller; a ratio exactly on ``1 - eps_low``, ``1 + eps_high`` or ``c`` is not clipped
    and keeps the gradient of ``-A r``.

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

    With ``bypass_old_logprobs`` and ``tis_cap`` it is the REINFORCE estimator of rollout
    correction: ``l = -min(sg(pi_theta / pi_rollout), tis_cap) A logp``.

    Registered as ``gpg`` (Group Policy Gradient, arXiv:2504.02546, whose advantage correction is
    left to the advantage estimator) and ``reinforce`` (Williams 1992).
    """
    return -x.advantages * x.logprobs, {}


register_policy_loss("gpg", uses_ratio=False)(_reinforce)
register_policy_loss("reinforce", uses_ratio=False)(_reinforce)


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
    # the temperatures take the inputs' dtype (two Python floats in torch.where would make fp32)
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
    of :func:`fnppo.core.loss.ppo_loss`) and their loss is detached (value kept, gradient 0). The rest is the PPO
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
