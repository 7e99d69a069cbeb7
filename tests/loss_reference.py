"""The float64 loop references of the losses: one per built-in policy loss, written from its paper's
formula (not from fnppo's code), and the whole ``ppo_loss`` composed from them. Used by
tests/test_loss.py (every dtype, checking on and off), tests/test_float64_exact.py (1e-12, float32
default dtype), tests/test_rollout_correction.py and the extreme-ratio test.

A built-in loss (``fnppo.core.losses.builtins.BUILTIN_LOSSES``) without an entry in :data:`REFERENCES`
fails ``test_every_builtin_loss_has_a_reference``; adding a loss is its class and one entry here: a
loop over tokens and the parameters that exercise each of its branches on the tests' batches.

A reference receives the loss part (its parameters are the part's attributes) and a :class:`Rows`
view of one padded batch ``[b, s]`` (each row one sequence), and returns ``{(b, j): loss}``: 0-dim
float64 tensors of the trained tokens, differentiable in ``logprobs``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fnppo.core.losses import (
    Aggregation,
    LossConfig,
    cispo,
    clip_cov,
    dppo_kl,
    dppo_tv,
    dro,
    gmpo,
    gpg,
    gspo,
    icepop,
    ipo,
    kl_cov,
    kpop,
    loglinear_decoupled,
    ppo_clip,
    reinforce,
    sapo,
    topr,
)
from fnppo.core.losses.policy import bypass_only, uses_ratio
from tests.loss_helpers import aggregate

Pos = tuple[int, int]


def _exp(x: float) -> float:
    """``math.exp`` with inf on an overflow (the references run at extreme log-ratios too)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


@dataclasses.dataclass(frozen=True)
class Rows:
    """One padded batch as a reference reads it: the tensors, the clamp, the valid positions per row."""

    lp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    clamp: float

    @property
    def rows(self) -> list[list[Pos]]:
        b, s = self.lp.shape
        return [[(i, j) for j in range(s) if self.mask[i, j] != 0] for i in range(b)]

    @property
    def valid(self) -> list[Pos]:
        return [p for row in self.rows for p in row]

    def log_ratio(self, p: Pos) -> torch.Tensor:
        return torch.clamp(self.lp[p] - self.old[p], -self.clamp, self.clamp)

    def a(self, p: Pos) -> float:
        return float(self.adv[p])


def _surrogate(r: torch.Tensor, a: float, low: float, high: float, dual: float | None) -> torch.Tensor:
    """PPO's pessimistic surrogate of one token (arXiv:1707.06347), dual clip for ``A < 0`` (arXiv:1912.09729)."""
    loss = torch.maximum(-a * r, -a * torch.clamp(r, 1 - low, 1 + high))
    if dual is not None and a < 0:
        loss = torch.clamp(loss, max=-a * dual)
    return loss


def ref_ppo_clip(loss: Any, x: Rows) -> dict:
    return {
        p: _surrogate(torch.exp(x.log_ratio(p)), x.a(p), loss.clip_low, loss.clip_high, loss.dual_clip) for p in x.valid
    }


def ref_gspo(loss: Any, x: Rows) -> dict:
    """GSPO-token (arXiv:2507.18071): ``s_i = exp(mean_t log r_t)`` stopped, times ``pi / sg(pi)`` per token."""
    out = {}
    for row in x.rows:
        if not row:
            continue
        seq = sum(float(x.lp[p].detach() - x.old[p]) for p in row) / len(row)
        seq = min(max(seq, -x.clamp), x.clamp)
        for p in row:
            s = _exp(seq) * torch.exp(x.lp[p] - x.lp[p].detach())
            out[p] = _surrogate(s, x.a(p), loss.clip_low, loss.clip_high, None)
    return out


def ref_cispo(loss: Any, x: Rows) -> dict:
    """CISPO (arXiv:2506.13585): ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi``."""
    out = {}
    for p in x.valid:
        w = min(max(_exp(float(x.log_ratio(p).detach())), 1 - loss.clip_low), 1 + loss.clip_high)
        out[p] = -w * x.a(p) * x.lp[p]
    return out


def ref_reinforce(loss: Any, x: Rows) -> dict:
    """REINFORCE (Williams 1992) and GPG (arXiv:2504.02546): ``-A log pi``."""
    return {p: -x.a(p) * x.lp[p] for p in x.valid}


def ref_gmpo(loss: Any, x: Rows) -> dict:
    """GMPO (arXiv:2507.20673): ``-mean(A) exp(mean_t sgn(A) min(sgn(A) log r, sgn(A) clip(log r)))`` per sequence."""
    out = {}
    for row in x.rows:
        if not row:
            continue
        us = []
        for p in row:
            a, lr = x.a(p), x.log_ratio(p)
            clipped = torch.clamp(lr, -loss.clip_low, loss.clip_high)
            us.append(torch.minimum(lr, clipped) if a > 0 else torch.maximum(lr, clipped) if a < 0 else lr * 0)
        seq_loss = -(sum(x.a(p) for p in row) / len(row)) * torch.exp(sum(us) / len(row))
        out.update({p: seq_loss for p in row})
    return out


def ref_sapo(loss: Any, x: Rows) -> dict:
    """SAPO (arXiv:2511.20347): ``-A (4 / tau) sigmoid(tau (r - 1))``, ``tau`` by the sign of ``A``."""
    out = {}
    for p in x.valid:
        tau = loss.tau_pos if x.a(p) > 0 else loss.tau_neg
        out[p] = -x.a(p) * (4 / tau) * torch.sigmoid(tau * (torch.exp(x.log_ratio(p)) - 1))
    return out


def _covariances(x: Rows) -> dict:
    valid = x.valid
    mean_a = sum(x.a(p) for p in valid) / len(valid)
    mean_lp = sum(float(x.lp[p].detach()) for p in valid) / len(valid)
    return {p: (x.a(p) - mean_a) * (float(x.lp[p].detach()) - mean_lp) for p in valid}


def ref_clip_cov(loss: Any, x: Rows) -> dict:
    """Clip-Cov (arXiv:2505.22617): PPO's loss, detached on the unclipped tokens with ``lb < cov < ub``
    (every such token: the reference needs ``ratio`` large enough that the draw takes them all)."""
    assert loss.ratio * len(x.valid) >= len(x.valid), "the reference covers the deterministic case ratio = 1"
    cov, out = _covariances(x), {}
    for p in x.valid:
        a, r = x.a(p), torch.exp(x.log_ratio(p))
        pg = _surrogate(r, a, loss.clip_low, loss.clip_high, loss.dual_clip)
        was_clipped = float(-a * torch.clamp(r.detach(), 1 - loss.clip_low, 1 + loss.clip_high)) > float(
            -a * r.detach()
        )
        out[p] = pg.detach() if not was_clipped and loss.lb < cov[p] < loss.ub else pg
    return out


def ref_kl_cov(loss: Any, x: Rows) -> dict:
    """KL-Cov (arXiv:2505.22617): ``-A r + coef |log r|`` on the ``max(floor(ratio n), 1)`` largest covariances."""
    cov = _covariances(x)
    k = max(math.floor(loss.ratio * len(x.valid)), 1)
    chosen = set(sorted(x.valid, key=lambda p: -cov[p])[:k])
    return {
        p: -x.a(p) * torch.exp(x.log_ratio(p)) + (loss.coef * x.log_ratio(p).abs() if p in chosen else 0.0)
        for p in x.valid
    }


def _dppo(loss: Any, x: Rows, binary_kl: bool) -> dict:
    """DPPO (arXiv:2602.04879): ``-A sg(min(r, cap)) log pi`` inside the trust region on the sampled
    token's probability (TV: ``p - q``; KL: the binary KL ``q log(q/p) + (1-q) log((1-q)/(1-p))``), 0 outside."""
    out = {}
    for p in x.valid:
        a, pp, q = x.a(p), _exp(float(x.lp[p].detach())), _exp(float(x.old[p]))
        if not binary_kl:
            inside = pp - q <= loss.high if a > 0 else pp - q >= -loss.low
        else:
            tail = (1 - q + 1e-8) / (1 - pp + 1e-8)  # a "probability" p > 1 (log-prob > 0): NaN, never inside
            d = q * float(x.old[p] - x.lp[p].detach()) + (1 - q) * math.log(tail) if tail > 0 else math.nan
            inside = (d <= loss.high or pp <= q) if a > 0 else (d <= loss.low or pp >= q)
        w = min(_exp(float(x.log_ratio(p).detach())), loss.ratio_cap)
        out[p] = -a * w * x.lp[p] if inside else x.lp[p] * 0
    return out


def ref_dppo_tv(loss: Any, x: Rows) -> dict:
    return _dppo(loss, x, binary_kl=False)


def ref_dppo_kl(loss: Any, x: Rows) -> dict:
    return _dppo(loss, x, binary_kl=True)


def ref_ipo(loss: Any, x: Rows) -> dict:
    """IPO (prime-rl ``ipo_loss_fn``): ``-A r [|p - q| <= threshold] + kl_coef (log r)^2``."""
    out = {}
    for p in x.valid:
        moved = abs(_exp(float(x.lp[p].detach())) - _exp(float(x.old[p]))) > loss.threshold
        out[p] = (0.0 if moved else -x.a(p) * torch.exp(x.log_ratio(p))) + loss.kl_coef * x.log_ratio(p) ** 2
    return out


def ref_kpop(loss: Any, x: Rows) -> dict:
    """KPop (prime-rl ``kpop_loss_fn``): IPO with the band ``D_B(p||q), D_B(q||p) <= threshold``, ``D_B`` the
    binary KL of (this token, the rest), probabilities clamped to ``[1e-6, 1 - 1e-6]``."""

    def bkl(u: float, v: float) -> float:
        return u * math.log(u / v) + (1 - u) * math.log((1 - u) / (1 - v))

    out = {}
    for p in x.valid:
        pp = min(max(_exp(float(x.lp[p].detach())), 1e-6), 1 - 1e-6)
        q = min(max(_exp(float(x.old[p])), 1e-6), 1 - 1e-6)
        kept = bkl(pp, q) <= loss.threshold and bkl(q, pp) <= loss.threshold
        out[p] = (-x.a(p) * torch.exp(x.log_ratio(p)) if kept else 0.0) + loss.kl_coef * x.log_ratio(p) ** 2
    return out


def ref_icepop(loss: Any, x: Rows) -> dict:
    """IcePop (arXiv:2510.18855): ``-A r`` where ``low <= r <= high`` (the ratio itself, unclamped), else 0."""
    out = {}
    for p in x.valid:
        kept = loss.low <= _exp(float(x.lp[p].detach() - x.old[p])) <= loss.high
        out[p] = -x.a(p) * torch.exp(x.lp[p] - x.old[p]) if kept else x.lp[p] * 0
    return out


def ref_dro(loss: Any, x: Rows) -> dict:
    """DRO (tinker's ``dro``): ``-A log pi + beta / 2 (log pi - log pi_old)^2``."""
    return {p: -x.a(p) * x.lp[p] + 0.5 * loss.beta * (x.lp[p] - x.old[p]) ** 2 for p in x.valid}


def ref_loglinear_decoupled(loss: Any, x: Rows) -> dict:
    """Decoupled PPO with AReaL's log-linear proximal policy: ``alpha = (K - 1) / K``,
    ``logp_prox = logp_behav + alpha (sg(logp) - logp_behav)``, ``w = min(exp(logp_prox - logp_behav), cap)``,
    loss ``w inner(logp, logp_prox)`` (``x.old`` are the behaviour log-probs)."""
    k = loss.staleness
    alpha = (k - 1) / k if k > 1 else 0.0
    prox = x.old + alpha * (x.lp.detach() - x.old)
    inner = policy_terms(loss.inner, dataclasses.replace(x, old=prox))
    out = {}
    for p in x.valid:
        w = _exp(min(max(float(prox[p] - x.old[p]), -x.clamp), x.clamp))
        out[p] = (w if loss.weight_cap is None else min(w, loss.weight_cap)) * inner[p]
    return out


def ref_topr(loss: Any, x: Rows) -> dict:
    """TOPR (arXiv:2503.14286): ``-sg(w) A log pi``, ``w = 1`` for ``A >= 0`` and the trajectory ratio
    truncated to ``[0, 1]``, ``[prod_t pi_t / mu_t]_0^1``, for ``A < 0`` (the token's sequence)."""
    out = {}
    for row in x.rows:
        ratio = _exp(min(max(sum(float(x.lp[p].detach() - x.old[p]) for p in row), -x.clamp), x.clamp))
        for p in row:
            w = 1.0 if x.a(p) >= 0 else min(max(ratio, 0.0), 1.0)
            out[p] = -w * x.a(p) * x.lp[p]
    return out


class Reference(NamedTuple):
    """A loss's loop and the parameters that exercise its branches on the tests' batches."""

    terms: Callable[[Any, Rows], dict]
    params: dict


REFERENCES: dict[type, Reference] = {
    ppo_clip: Reference(ref_ppo_clip, dict(clip_low=0.1, clip_high=0.3, dual_clip=1.5)),
    gspo: Reference(ref_gspo, dict(clip_low=0.05, clip_high=0.08)),
    cispo: Reference(ref_cispo, dict(clip_low=0.2, clip_high=0.1)),
    gmpo: Reference(ref_gmpo, dict(clip_low=0.15, clip_high=0.25)),
    sapo: Reference(ref_sapo, dict(tau_pos=1.1, tau_neg=0.95)),
    gpg: Reference(ref_reinforce, {}),
    reinforce: Reference(ref_reinforce, {}),
    clip_cov: Reference(ref_clip_cov, dict(ratio=1.0, lb=0.0, ub=10.0, clip_low=0.1, clip_high=0.3, dual_clip=None)),
    kl_cov: Reference(ref_kl_cov, dict(ratio=0.3, coef=0.7)),
    # bounds that mask some tokens and truncate some ratios of the tests' batches (every branch runs)
    dppo_tv: Reference(ref_dppo_tv, dict(low=0.03, high=0.04, ratio_cap=1.15)),
    dppo_kl: Reference(ref_dppo_kl, dict(low=0.002, high=0.003, ratio_cap=1.15)),
    ipo: Reference(ref_ipo, dict(threshold=0.03, kl_coef=0.3)),
    kpop: Reference(ref_kpop, dict(threshold=0.0005, kl_coef=0.3)),
    icepop: Reference(ref_icepop, dict(low=0.8, high=1.25)),
    dro: Reference(ref_dro, dict(beta=0.7)),
    loglinear_decoupled: Reference(
        ref_loglinear_decoupled, dict(staleness=3, inner=ppo_clip(clip_low=0.1, clip_high=0.15), weight_cap=1.2)
    ),
    topr: Reference(ref_topr, {}),
}


def reference(cls: type) -> Reference:
    """The reference of the built-in loss ``cls`` (a loss without one fails here, by name)."""
    if cls not in REFERENCES:
        raise AssertionError(
            f"no float64 loop reference for the built-in loss {cls.__name__!r}: add one to REFERENCES in "
            "tests/loss_reference.py (a loop from its paper's formula and parameters that exercise its branches)"
        )
    return REFERENCES[cls]


def policy_terms(loss: Any, x: Rows) -> dict:
    """The per-token loss of the built-in ``loss`` by its reference."""
    return reference(type(loss)).terms(loss, x)


def example(cls: type) -> Any:
    """The loss ``cls`` with its reference's parameters."""
    return cls(**reference(cls).params)


# =============================================================================================
# The whole loss: weights, entropy and KL terms, aggregation
# =============================================================================================
def ref_kl(d: torch.Tensor, estimator: str) -> torch.Tensor:
    """One token's KL estimate from a 0-dim ``d = logp - ref`` (already clamped) (Schulman's k1, k2, k3;
    ``+``: the value of the estimator with the gradient of k2)."""
    base = estimator.rstrip("+")
    if base == "k1":
        k = d
    elif base in ("k2", "mse"):
        k = d * d / 2
    elif base in ("k3", "low_var_kl"):
        k = torch.exp(-d) - 1 + d
    else:
        k = d.abs()
    if estimator.endswith("+"):
        k2 = d * d / 2
        k = k2 + (k - k2).detach()
    return k


def ref_tis(train, rollout, mask, cap: float, level: str, clamp: float = 20.0) -> dict:
    """``min(exp(d), cap)`` per token, or ``min(exp(sum_t d_t), cap)`` per sequence, ``d = train - rollout``
    clamped (TIS, Yao et al. 2025)."""
    out = {}
    for b in range(train.shape[0]):
        row = [(b, j) for j in range(train.shape[1]) if mask[b, j] == 1]
        seq = sum(float(train[p] - rollout[p]) for p in row)
        for p in row:
            lw = seq if level == "sequence" else float(train[p] - rollout[p])
            out[p] = min(_exp(min(max(lw, -clamp), clamp)), cap)
    return out


def ref_ppo_loss(lp, old, adv, mask, cfg: LossConfig, entropy=None, ref=None, rollout=None) -> torch.Tensor:
    """``ppo_loss`` as loops: the policy term of the reference, times the TIS weight (``correction`` with
    ``tis_cap`` and ``level`` only), minus the entropy bonus, plus the KL penalty, aggregated."""
    base = rollout if cfg.bypass_old_logprobs else old
    pg = policy_terms(cfg.policy, Rows(lp, base, adv, mask, cfg.log_ratio_clamp))
    corr = cfg.correction
    w = {}
    if corr is not None:
        others = {f.name: getattr(corr, f.name) for f in dataclasses.fields(corr)} | {"tis_cap": None, "level": "token"}
        assert all(v in (None, False, "token") for v in others.values()), f"reference covers tis_cap and level: {corr}"
        train = lp.detach() if cfg.bypass_old_logprobs else old
        w = ref_tis(train, rollout, mask, corr.tis_cap, corr.level, cfg.log_ratio_clamp)
    seqs = []
    for b in range(lp.shape[0]):
        terms = []
        for j in range(lp.shape[1]):
            p = (b, j)
            if mask[p] != 1:
                continue
            term = pg[p] * w.get(p, 1.0)
            if cfg.entropy_coef:
                term = term - cfg.entropy_coef * entropy[p]
            if cfg.kl is not None and cfg.kl.coef:
                d = torch.clamp(lp[p] - ref[p], -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
                term = term + cfg.kl.coef * ref_kl(d, cfg.kl.estimator)
            terms.append(term)
        if terms:
            seqs.append(terms)
    if not seqs:
        return lp.sum() * 0
    return aggregate(seqs, cfg.agg.mode, cfg.agg.scale)


def config_of(
    loss: Any,
    mode: str = "token-mean",
    *,
    scale: float | None = None,
    entropy_coef: float = 0.0,
    kl: Any = None,
    correction: Any = None,
    clamp: float = 20.0,
) -> LossConfig:
    """The ``LossConfig`` of a test case built from parts: bypass mode for a ``bypass_only`` loss (whose
    ``old_logprobs`` are then the ``rollout_logprobs``; a TIS cap is dropped there for a ratio-based loss,
    which refuses it), a scale for ``seq-mean-token-sum-norm`` (4.0 unless given)."""
    bypass = bypass_only(loss)
    if bypass and uses_ratio(loss) and correction is not None:
        correction = None
    agg = Aggregation(mode, (4.0 if scale is None else scale) if mode == "seq-mean-token-sum-norm" else None)
    return LossConfig(loss, agg, entropy_coef, kl, correction, bypass, clamp)
