"""Policy losses for stale and mismatched rollouts: DPPO (TV, KL), IPO, DRO and decoupled PPO with a
log-linear proximal policy (pure torch).

Each is a built-in part like those of :mod:`fnppo.core.losses.policy` (a frozen dataclass, its own
factory, a flat name for :func:`~fnppo.core.losses.flat.from_flat`), aggregated, weighted and
split-invariant exactly like them: every one is a per-token function of its own token's log-probs
and advantage, so the sum over micro-batches with the step's ``normalizer`` is the full-batch loss.

Which log-probs play which role (see ``docs/conventions.md``): ``x.old_logprobs`` is the policy the
trust region is measured against. Outside bypass mode that is the trainer's recomputed old
log-probs (the *proximal* policy of decoupled PPO, while ``rollout_logprobs`` are the *behaviour*
policy that the rollout correction weights against); with ``LossConfig(bypass_old_logprobs=True)``
it is the inference engine's log-probs (behaviour = proximal, no old-log-prob forward): IPO and
prime-rl's DPPO are meant to run this way.

Masked tokens (outside the trust region) get loss 0 and no gradient but stay in the denominator
``N`` of the aggregation (as in verl and prime-rl, where the mask multiplies the per-token loss).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from fnppo.core.losses.checks import Checker, finite_number
from fnppo.core.losses.policy import Builtin, PolicyInputs, exp_where, ppo_clip, reads_probabilities
from fnppo.core.typing import Tensor

__all__ = ["dppo_tv", "dppo_kl", "ipo", "kpop", "icepop", "dro", "loglinear_decoupled", "topr"]
"""The built-in losses of this module (a new one: its class here and its name in this list; the rest is derived)."""


def check_dppo(c: Checker) -> None:
    for arg in ("low", "high"):  # the rule of the flat clip_ratio_low/high they share with ppo: >= 0
        c.number(arg, 0)
    c.number("ratio_cap", 0, strict=True, expected="a number > 0 (the truncation of the stopped ratio)")


def check_ipo(c: Checker) -> None:
    c.number("threshold", 0, strict=True, expected="a number > 0")
    c.number("kl_coef", 0)


def check_dro(c: Checker) -> None:
    c.number("beta", 0)


def _dppo(x: PolicyInputs, valid: Tensor, ratio_cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """``-A sg(min(r, ratio_cap)) logp`` on the tokens inside the trust region, 0 elsewhere."""
    ratio = x.ratio().detach()
    weight = torch.clamp(ratio, max=ratio_cap)
    loss = torch.where(valid, -x.advantages * weight * x.logprobs, torch.zeros_like(x.logprobs))
    return loss, {
        "pg_clipfrac": x.token_metric((~valid).float()),
        "pg_clipfrac_lower": x.token_metric(((ratio > ratio_cap) & valid).float()),
    }


_DPPO_FIELDS = MappingProxyType({"clip_ratio_low": "low", "clip_ratio_high": "high", "dppo_ratio_cap": "ratio_cap"})


@dataclass(frozen=True)
class dppo_tv(Builtin):
    """DPPO-Binary-TV: a trust region on the total-variation step of the sampled token's probability.

    With ``p = exp(logp)``, ``q = exp(logp_old)`` and ``r = p / q``: a token is inside the region when
    ``p - q <= high`` (``A > 0``) or ``p - q >= -low`` (``A <= 0``), and then
    ``l = -A sg(min(r, ratio_cap)) logp`` (gradient ``-A min(r, ratio_cap) grad logp``); outside,
    ``l = 0``. ``pg_clipfrac``: the fraction outside; ``pg_clipfrac_lower``: inside with
    ``r > ratio_cap``. (The value of ``l`` contains ``logp``; only its gradient is meaningful.)

    Reference: DPPO, arXiv:2602.04879; verl ``compute_policy_loss_dppo_tv`` (PR #5397; verl reads
    ``clip_ratio_low/high`` as the bounds and ``clip_ratio_c`` as the cap, 3.0 by default in its
    ``ActorConfig``; fnppo's ``ratio_cap`` defaults to 20: pass ``ratio_cap=3.0`` for verl's).
    """

    flat_name: ClassVar[str] = "dppo_tv"
    flat_fields: ClassVar[Mapping[str, str]] = _DPPO_FIELDS
    rule = staticmethod(check_dppo)
    reads_probabilities: ClassVar[bool] = True

    low: float = 0.2
    high: float = 0.2
    ratio_cap: float = 20.0

    def inside(self, x: PolicyInputs) -> Tensor:
        """The tokens inside the trust region: the probability step within the bound the advantage's sign picks."""
        diff = torch.exp(x.logprobs.detach()) - torch.exp(x.old_logprobs)
        return torch.where(x.advantages > 0, diff <= self.high, diff >= -self.low)

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        return _dppo(x, self.inside(x), self.ratio_cap)


@dataclass(frozen=True)
class dppo_kl(dppo_tv):
    """DPPO-Binary-KL: the trust region on the binary KL of the sampled token's probability.

    ``D = q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))`` (``p``, ``q`` as in
    :class:`dppo_tv`); inside when ``D <= high or p <= q`` (``A > 0``) or ``D <= low or p >= q``
    (``A <= 0``): a token is masked only when its probability moved in the direction its advantage
    pushes, by more than the bound. The loss and metrics are those of :class:`dppo_tv`.

    Reference: DPPO, arXiv:2602.04879; verl ``compute_policy_loss_dppo_kl`` (PR #5397).
    """

    flat_name: ClassVar[str] = "dppo_kl"
    flat_fields: ClassVar[Mapping[str, str]] = _DPPO_FIELDS

    def inside(self, x: PolicyInputs) -> Tensor:
        """The tokens inside: the binary KL within the bound, or moved against the advantage's push."""
        lp = x.logprobs.detach()
        p, q = torch.exp(lp), torch.exp(x.old_logprobs)
        kl = q * (x.old_logprobs - lp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        return torch.where(x.advantages > 0, (kl <= self.high) | (p <= q), (kl <= self.low) | (p >= q))


@dataclass(frozen=True)
class ipo(Builtin):
    """IPO (prime-rl's ``ipo_loss_fn``): a symmetric trust region on the probability step, the
    importance-weighted policy gradient and a squared-log-ratio regularizer. (prime-rl's default loss
    at the revision cited is DPPO-TV plus a KL term, not IPO.)

    With ``r = exp(logp - logp_old)``: ``l = -A r [|p - q| <= threshold] + kl_coef (log r)^2``; the
    regularizer acts on every trained token, masked or not (prime-rl's ``kl_tau``; its ``adv_tau``
    scaling of the advantages is the estimator's business here). ``pg_clipfrac``: the masked fraction.
    Meant for bypass mode (``LossConfig(policy=ipo(), bypass_old_logprobs=True)``): ``logp_old`` is
    then the inference engine's log-probs, the behaviour policy, and no old-log-prob forward runs.

    Reference: prime-rl ``ipo_loss_fn`` (PR #2798).
    """

    flat_name: ClassVar[str] = "ipo"
    flat_fields: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"ipo_threshold": "threshold", "ipo_kl_coef": "kl_coef"}
    )
    rule = staticmethod(check_ipo)
    reads_probabilities: ClassVar[bool] = True

    threshold: float = 0.1
    kl_coef: float = 1e-3

    def masked(self, x: PolicyInputs) -> Tensor:
        """The tokens outside the trust region: ``|p - q| > threshold``."""
        return (torch.exp(x.logprobs.detach()) - torch.exp(x.old_logprobs)).abs() > self.threshold

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        log_ratio = x.log_ratio()
        masked = self.masked(x)
        kept = ~masked & (x.advantages != 0)  # a masked token's ratio is never exponentiated (no 0 * inf)
        pg = torch.where(kept, -x.advantages * exp_where(log_ratio, kept), torch.zeros_like(log_ratio))
        return pg + self.kl_coef * log_ratio * log_ratio, {"pg_clipfrac": x.token_metric(masked.float())}


_P_EPS = 1e-6  # KPop's clamp of the token probabilities: the complement terms stay finite


def _binary_kl(p: Tensor, q: Tensor) -> Tensor:
    """``D_B(p || q) = p log(p/q) + (1 - p) log((1 - p)/(1 - q))``: the KL of the two-event partition
    (this token, every other token)."""
    return p * (torch.log(p) - torch.log(q)) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))


@dataclass(frozen=True)
class kpop(ipo):
    """KPop: IPO with a binary-KL trust region instead of a probability-difference band.

    With ``p = exp(sg(logp))``, ``q = exp(logp_old)`` (both clamped to ``[1e-6, 1 - 1e-6]``) and
    ``r = exp(logp - logp_old)``: a token is kept iff ``D_B(p || q) <= threshold`` and
    ``D_B(q || p) <= threshold`` (the band is wide in ratio terms for rare tokens, tight for confident
    ones); ``l = -A r [kept] + kl_coef (log r)^2``, the regularizer on every trained token.
    ``pg_clipfrac``: the masked fraction. For bypass mode, like :class:`ipo`.

    Reference: KPop (Guo et al., Ant Group); prime-rl ``kpop_loss_fn`` (PR #3283), AReaL #1405.
    """

    flat_name: ClassVar[str] = "kpop"
    flat_fields: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"kpop_threshold": "threshold", "kpop_kl_coef": "kl_coef"}
    )

    def masked(self, x: PolicyInputs) -> Tensor:
        """The tokens outside the trust region: the binary KL above ``threshold`` either way."""
        p = torch.exp(x.logprobs.detach()).clamp(_P_EPS, 1 - _P_EPS)
        q = torch.exp(x.old_logprobs).clamp(_P_EPS, 1 - _P_EPS)
        return (_binary_kl(p, q) > self.threshold) | (_binary_kl(q, p) > self.threshold)


def check_icepop(c: Checker) -> None:
    c.number("low", 0, strict=True, expected="a number > 0 (the lowest kept ratio)")
    c.number("high", 0, strict=True, expected="a number > 0 (the highest kept ratio)")
    c.need(c.get("low") < c.get("high"), "high", f"a number above low={c.get('low')!r}")


@dataclass(frozen=True)
class icepop(Builtin):
    """IcePop as a loss: the importance-weighted policy gradient on the tokens whose ratio lies in an
    inclusive band, the others dropped (not clipped), no KL term.

    ``r = exp(logp - logp_old)``; ``l = -A r`` if ``low <= r <= high``, else 0 (the test is made on
    ``log r``, and a dropped token's ratio is never exponentiated, so an extreme one gives no
    ``0 * inf``). ``pg_clipfrac``: the dropped fraction. With bypass mode ``logp_old`` is the
    inference engine's log-probs. (:class:`~fnppo.core.losses.rollout_correction.RolloutCorrection`'s
    ``reject_low`` / ``reject_high`` is the same mask as a correction of another loss.)

    Reference: Ring-1T (arXiv:2510.18855) and INTELLECT-3 (arXiv:2512.16144) eq. 1; prime-rl's
    ``icepop`` loss (PR #3526: band [0.2, 5.0]).
    """

    flat_name: ClassVar[str] = "icepop"
    flat_fields: ClassVar[Mapping[str, str]] = MappingProxyType({"icepop_low": "low", "icepop_high": "high"})
    rule = staticmethod(check_icepop)

    low: float = 0.2
    high: float = 5.0

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        log_ratio = x.logprobs - x.old_logprobs
        lr = log_ratio.detach()
        kept = (lr >= math.log(self.low)) & (lr <= math.log(self.high))
        pg = torch.where(kept, -x.advantages * exp_where(log_ratio, kept), torch.zeros_like(log_ratio))
        return pg, {"pg_clipfrac": x.token_metric((~kept).float())}


@dataclass(frozen=True)
class dro(Builtin):
    """DRO: the plain policy gradient with a quadratic trust region around the behaviour policy.

    ``l = -A logp + (beta / 2) (logp - logp_old)^2``; the penalty acts on every trained token
    (``loss_mask`` excludes positions, which tinker's version cannot, tinker-cookbook #907).
    (The value contains ``logp``; its gradient ``-(A - beta (logp - logp_old)) grad logp`` is the point.)

    Reference: tinker's ``dro`` loss (tinker docs, tinker-cookbook #600/#907); verl
    ``compute_policy_loss_dro`` (#7245).
    """

    flat_name: ClassVar[str] = "dro"
    flat_fields: ClassVar[Mapping[str, str]] = MappingProxyType({"dro_beta": "beta"})
    rule = staticmethod(check_dro)

    beta: float = 0.05

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        d = x.logprobs - x.old_logprobs
        return -x.advantages * x.logprobs + 0.5 * self.beta * d * d, {}


def check_decoupled(c: Checker) -> None:
    v = c.get("staleness")
    c.need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, "staleness", "an int >= 0")
    inner = c.get("inner")
    c.need(
        callable(inner) and not isinstance(inner, type),
        "inner",
        "a policy loss (a callable taking PolicyInputs; a built loss such as ppo_clip(), not its class)",
    )
    cap = c.get("weight_cap")
    c.need(cap is None or (finite_number(cap) and cap > 0), "weight_cap", "a number > 0 or None")


@dataclass(frozen=True)
class loglinear_decoupled(Builtin):
    """Decoupled PPO with the proximal policy interpolated, not recomputed (AReaL's
    ``prox_logp_method="loglinear"``): no old-log-prob forward. For bypass mode, where
    ``x.old_logprobs`` are the behaviour (rollout engine's) log-probs.

    The behaviour policy is ``K`` versions behind the current one and the proximal policy one
    version behind, so ``alpha = (K - 1) / K`` (0 for ``K <= 1``) and
    ``logp_prox = logp_behav + alpha (sg(logp) - logp_behav)``. The loss is
    ``w inner(logp, logp_prox)`` with the behaviour weight ``w = sg(exp(logp_prox - logp_behav))``
    (``min(w, weight_cap)`` when set): ``inner`` (default PPO's clip) anchors its trust region on the
    proximal policy, ``w`` corrects the sampling. ``K`` is each token's own age where the inputs carry
    per-token ages (``PolicyInputs.staleness``: partial rollouts, from
    :meth:`~fnppo.core.losses.staleness.Staleness.prepare`, as AReaL reads one version per token),
    else ``staleness`` for every token; :class:`~fnppo.core.losses.staleness.Staleness` refuses
    older samples and tokens.

    Reference: AReaL ``_compute_approx_prox_logp`` / ``ppo_actor_loss_fn`` (decoupled PPO,
    arXiv:2505.24298).
    """

    rule = staticmethod(check_decoupled)
    bypass_only: ClassVar[bool] = True
    uses_staleness: ClassVar[bool] = True

    staleness: int = 1
    inner: Any = ppo_clip()
    weight_cap: float | None = None

    @property
    def reads_probabilities(self) -> bool:  # type: ignore[override]
        """As its inner loss: the behaviour log-probs pass into it through the proximal ones."""
        return reads_probabilities(self.inner)

    @property
    def per_sequence(self) -> bool:  # type: ignore[override]
        """As its inner loss (the weight ``w`` is per token)."""
        return bool(getattr(self.inner, "per_sequence", False))

    def alpha(self, x: PolicyInputs) -> Tensor:
        """``(K - 1) / K`` per token (0 where ``K <= 1``): ``K`` the token's age, or ``staleness``."""
        k = x.staleness if x.staleness is not None else torch.full_like(x.old_logprobs, float(self.staleness))
        k = k.to(x.old_logprobs.dtype)
        return torch.where(k > 1, (k - 1) / torch.clamp(k, min=1), torch.zeros_like(k))

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        alpha = self.alpha(x)
        behav = x.old_logprobs
        prox = behav + alpha * (x.logprobs.detach() - behav)
        log_w = torch.clamp(prox - behav, -x.log_ratio_clamp, x.log_ratio_clamp)
        w = torch.exp(log_w) if self.weight_cap is None else torch.clamp(torch.exp(log_w), max=self.weight_cap)
        loss, metrics = self.inner(dataclasses.replace(x, old_logprobs=prox))
        return w * loss, {**metrics, "behaviour_weight": x.token_metric(w)}


@dataclass(frozen=True)
class topr(Builtin):
    """TOPR, Tapered Off-Policy REINFORCE: plain REINFORCE where the advantage is >= 0, REINFORCE
    weighted by the truncated importance ratio of the whole sequence where it is negative.

    With ``s_i = sum_t (logp_t - logp_old_t)`` over the valid tokens of sequence i (the log of the
    trajectory ratio ``pi(tau) / mu(tau)``, a product over its tokens; clamped to
    ``±log_ratio_clamp``), per token of sequence i ``l_t = -sg(w_t) A_t logp_t`` with ``w_t = 1``
    where ``A_t >= 0`` and ``w_t = [exp(s_i)]_0^1 = min(exp(s_i), 1)`` where ``A_t < 0``: the
    paper's ``grad J = sum_{R >= 0} mu R grad log pi + sum_{R < 0} mu [pi / mu]_0^1 R grad log pi``,
    with sequence-level advantages (GRPO, RLOO: one per sequence) as its ``R``. The ratio is never
    above 1, so nothing overflows. (The value contains ``logp``; only its gradient is meaningful.)
    ``mu`` is ``x.old_logprobs``: in bypass mode the rollout engine's, the paper's behaviour policy.
    ``pg_clipfrac``: the fraction of tokens whose weight was truncated (``A < 0`` and a ratio above 1).

    Reference: Le Roux, Bellemare et al., Tapered Off-Policy REINFORCE, arXiv:2503.14286 (the TOPR
    gradient, section 3).
    """

    flat_name: ClassVar[str] = "topr"
    per_sequence: ClassVar[bool] = True

    def __call__(self, x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
        seg = x.segments
        log_ratio = x.logprobs.detach() - x.old_logprobs  # 0 where the mask is 0
        seq = seg.gather(seg.sum(log_ratio), log_ratio)
        negative = x.advantages < 0
        weight = torch.where(negative, torch.exp(torch.clamp(seq, -x.log_ratio_clamp, 0.0)), torch.ones_like(seq))
        return -weight * x.advantages * x.logprobs, {"pg_clipfrac": x.token_metric((negative & (seq > 0)).float())}
