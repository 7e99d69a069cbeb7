"""Every loss and estimator, in float64, against plain-loop float64 references at 1e-12.

A constant that enters a loss as a float32 tensor (e.g. ``torch.where(cond, 1.0, 1.05)``, which
makes a float32 tensor from two Python floats) rounds ``1.05`` to ``1.0499999523``: a relative
error of ~5e-8, invisible at the usual 1e-5 tolerances. Here the default dtype stays float32 (so
such a constant really is float32), all inputs are float64 values that float32 cannot represent,
and every result must equal a plain Python-loop reference to 1e-12 relative.

Covered: every built-in policy loss (a new entry of ``fnppo.core.losses.flat.POLICY_LOSSES`` without
a reference fails :func:`test_every_builtin_policy_loss_has_a_reference`), with entropy, KL and TIS terms, in
all aggregation modes; every KL estimator (value and gradient); GAE, GRPO, RLOO, REINFORCE++,
``broadcast_to_tokens``, ``discounted_scan``; ``value_loss``; ``compute_tis_weights``.
"""

from __future__ import annotations

import math

import pytest
import torch

from fnppo.core.advantages import (
    broadcast_to_tokens,
    discounted_scan,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from fnppo.core.losses import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    compute_tis_weights,
    from_flat,
    kl_penalty,
    ppo_loss,
    value_loss,
)
from tests.loss_helpers import aggregate, flat_view, read_by

F64 = torch.float64
RTOL = 1e-12


@pytest.fixture(autouse=True)
def _float32_default():
    """The library's constants must not depend on the default dtype: keep it float32 here."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(previous)


def assert_exact(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.dtype == F64, f"{what}: dtype {got.dtype}, expected float64"
    ref = ref.to(F64)
    err = (got.detach() - ref.detach()).abs().max().item() if got.numel() else 0.0
    scale = max(1.0, ref.detach().abs().max().item() if ref.numel() else 0.0)
    assert err <= RTOL * scale, f"{what}: max error {err:.3e} (scale {scale:.3g})"


def _data(seed: int, b: int = 3, s: int = 5):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    old = -torch.rand(b, s, generator=g, dtype=F64) * 3
    lp = old + 0.3 * rnd(b, s)
    adv = rnd(b, s)
    mask = (torch.rand(b, s, generator=g) < 0.75).to(F64)
    mask[0, 0] = 1.0
    ent = torch.rand(b, s, generator=g, dtype=F64)
    ref = old + 0.3 * rnd(b, s)
    rollout = old + 0.3 * rnd(b, s)
    return lp, old, adv, mask, ent, ref, rollout


# =============================================================================================
# Reference: per-token loop over the documented formulas
# =============================================================================================
def ref_kl(d: torch.Tensor, estimator: str) -> torch.Tensor:
    """One token's KL estimate from a 0-dim ``d = logp - ref`` (already clamped)."""
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


def _covariances(lp, adv, valid):
    n = len(valid)
    mean_a = sum(float(adv[p]) for p in valid) / n
    mean_lp = sum(float(lp[p].detach()) for p in valid) / n
    return {p: (float(adv[p]) - mean_a) * (float(lp[p]) - mean_lp) for p in valid}


def ref_policy_terms(name: str, lp, old, adv, mask, cfg) -> dict:
    """``{(b, j): per-token policy loss}`` (0-dim float64 tensors, differentiable in ``lp``); ``cfg`` is the
    :func:`~tests.loss_helpers.flat_view` of the flat settings (so are the ``cfg`` of the references below)."""
    c, lo, hi = cfg.log_ratio_clamp, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high
    rows = [[(b, j) for j in range(lp.shape[1]) if mask[b, j] == 1] for b in range(lp.shape[0])]
    valid = [p for row in rows for p in row]
    out = {}

    def log_ratio(p):
        return torch.clamp(lp[p] - old[p], -c, c)

    def clipped_surrogate(r, a, dual):
        loss = torch.maximum(-a * r, -a * torch.clamp(r, lo, hi))
        if dual and cfg.clip_ratio_c is not None and a < 0:
            loss = torch.clamp(loss, max=-a * cfg.clip_ratio_c)
        return loss

    cov = _covariances(lp, adv, valid) if name in ("clip_cov", "kl_cov") else {}
    chosen: set = set()
    if name == "kl_cov":
        k = max(math.floor(cfg.kl_cov_ratio * len(valid)), 1)
        chosen = set(sorted(valid, key=lambda p: -cov[p])[:k])
    for row in rows:
        n = len(row)
        if name == "gspo":
            seq_lr = min(max(sum(float(lp[p].detach() - old[p]) for p in row) / max(n, 1), -c), c)
        if name == "gmpo" and n:
            us = []
            for p in row:
                a, lr = float(adv[p]), log_ratio(p)
                clipped = torch.clamp(lr, -cfg.clip_ratio_low, cfg.clip_ratio_high)
                us.append(torch.minimum(lr, clipped) if a > 0 else torch.maximum(lr, clipped) if a < 0 else lr * 0)
            seq_loss = -(sum(float(adv[p]) for p in row) / n) * torch.exp(sum(us) / n)
        for p in row:
            a, r = float(adv[p]), torch.exp(log_ratio(p))
            if name == "ppo":
                out[p] = clipped_surrogate(r, a, True)
            elif name == "gspo":
                out[p] = clipped_surrogate(math.exp(seq_lr) * torch.exp(lp[p] - lp[p].detach()), a, False)
            elif name == "cispo":
                w = min(max(float(r.detach()), 1 - cfg.cispo_clip_low), 1 + cfg.cispo_clip_high)
                out[p] = -w * a * lp[p]
            elif name in ("gpg", "reinforce"):
                out[p] = -a * lp[p]
            elif name == "gmpo":
                out[p] = seq_loss
            elif name == "sapo":
                tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
                out[p] = -a * (4 / tau) * torch.sigmoid(tau * (r - 1))
            elif name == "clip_cov":
                loss = clipped_surrogate(r, a, True)
                was_clipped = float(-a * torch.clamp(r.detach(), lo, hi)) > float(-a * r.detach())
                # clip_cov_ratio = 1 below: every eligible token is detached (no random draw)
                eligible = not was_clipped and cfg.clip_cov_lb < cov[p] < cfg.clip_cov_ub
                out[p] = loss.detach() if eligible else loss
            elif name == "kl_cov":
                out[p] = -a * r + (cfg.kl_cov_coef * log_ratio(p).abs() if p in chosen else 0.0)
            elif name in ("dppo_tv", "dppo_kl"):  # DPPO, arXiv:2602.04879 (the paper's binary divergences)
                pp, q = math.exp(float(lp[p])), math.exp(float(old[p]))
                if name == "dppo_tv":
                    inside = pp - q <= cfg.clip_ratio_high if a > 0 else pp - q >= -cfg.clip_ratio_low
                else:
                    tail = (1 - q + 1e-8) / (1 - pp + 1e-8)  # a "probability" p > 1 (log-prob > 0): NaN, never inside
                    d = q * math.log(q / pp) + (1 - q) * math.log(tail) if tail > 0 else math.nan
                    inside = (d <= cfg.clip_ratio_high or pp <= q) if a > 0 else (d <= cfg.clip_ratio_low or pp >= q)
                w = min(float(r.detach()), cfg.dppo_ratio_cap)
                out[p] = -a * w * lp[p] if inside else lp[p] * 0
            elif name == "ipo":  # prime-rl ipo_loss_fn
                moved = abs(math.exp(float(lp[p])) - math.exp(float(old[p]))) > cfg.ipo_threshold
                out[p] = (0.0 if moved else -a * r) + cfg.ipo_kl_coef * log_ratio(p) ** 2
            elif name == "dro":  # tinker's dro
                out[p] = -a * lp[p] + 0.5 * cfg.dro_beta * (lp[p] - old[p]) ** 2
            elif name == "kpop":  # prime-rl kpop_loss_fn: the binary KL of (token, rest) both ways
                pp = min(max(math.exp(float(lp[p])), 1e-6), 1 - 1e-6)
                q = min(max(math.exp(float(old[p])), 1e-6), 1 - 1e-6)

                def bkl(x, y):
                    return x * math.log(x / y) + (1 - x) * math.log((1 - x) / (1 - y))

                kept = bkl(pp, q) <= cfg.kpop_threshold and bkl(q, pp) <= cfg.kpop_threshold
                out[p] = (-a * r if kept else 0.0) + cfg.kpop_kl_coef * log_ratio(p) ** 2
            elif name == "icepop":  # prime-rl icepop: the ratio kept in [low, high], else dropped
                kept = cfg.icepop_low <= math.exp(float(lp[p] - old[p])) <= cfg.icepop_high
                out[p] = -a * r if kept else lp[p] * 0
            else:
                raise AssertionError(f"no reference for {name!r}")
    return out


def ref_tis(old, rollout, mask, cfg) -> dict:
    c = cfg.log_ratio_clamp
    out = {}
    for b in range(old.shape[0]):
        row = [(b, j) for j in range(old.shape[1]) if mask[b, j] == 1]
        seq = sum(float(old[p] - rollout[p]) for p in row)
        for p in row:
            lw = seq if cfg.tis_level == "sequence" else float(old[p] - rollout[p])
            out[p] = min(math.exp(min(max(lw, -c), c)), cfg.tis_cap)
    return out


def ref_ppo_loss(lp, old, adv, mask, cfg, entropy, ref, rollout) -> torch.Tensor:
    pg = ref_policy_terms(cfg.policy_loss, lp, old, adv, mask, cfg)
    w = ref_tis(old, rollout, mask, cfg) if cfg.tis_cap is not None else {}
    seqs = []
    for b in range(lp.shape[0]):
        terms = []
        for j in range(lp.shape[1]):
            p = (b, j)
            if mask[p] != 1:
                continue
            term = pg[p] * w.get(p, 1.0)
            if cfg.entropy_coeff:
                term = term - cfg.entropy_coeff * entropy[p]
            if cfg.kl_coef:
                d = torch.clamp(lp[p] - ref[p], -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
                term = term + cfg.kl_coef * ref_kl(d, cfg.kl_estimator)
            terms.append(term)
        if terms:
            seqs.append(terms)
    return aggregate(seqs, cfg.loss_agg_mode, cfg.loss_scale_factor)


# Deterministic settings for the randomized / covariance-based losses.
_LOSS_KW = {
    "clip_cov": dict(clip_cov_ratio=1.0, clip_cov_lb=0.0, clip_cov_ub=10.0),
    "kl_cov": dict(kl_cov_ratio=0.3, kl_cov_coef=0.7),
    "gmpo": dict(clip_ratio_low=0.15, clip_ratio_high=0.25),
    "cispo": dict(cispo_clip_low=0.2, cispo_clip_high=0.1),
    "sapo": dict(sapo_tau_pos=1.1, sapo_tau_neg=1.05),
    # bounds that mask some tokens and truncate some ratios of _data (so every branch is exercised)
    "dppo_tv": dict(clip_ratio_low=0.03, clip_ratio_high=0.04, dppo_ratio_cap=1.15),
    "dppo_kl": dict(clip_ratio_low=0.002, clip_ratio_high=0.003, dppo_ratio_cap=1.15),
    "ipo": dict(ipo_threshold=0.03, ipo_kl_coef=0.3),
    "dro": dict(dro_beta=0.7),
    "kpop": dict(kpop_threshold=0.0005, kpop_kl_coef=0.3),
    "icepop": dict(icepop_low=0.97, icepop_high=1.03),
}
REFERENCED = (
    "ppo",
    "gspo",
    "cispo",
    "gpg",
    "reinforce",
    "gmpo",
    "sapo",
    "clip_cov",
    "kl_cov",
    "dppo_tv",
    "dppo_kl",
    "ipo",
    "dro",
    "kpop",
    "icepop",
)
_EXTRAS = (
    dict(),
    dict(entropy_coeff=0.03, kl_coef=0.2, kl_estimator="k3", tis_cap=1.1),
    dict(
        clip_ratio_low=0.1,
        clip_ratio_high=0.3,
        kl_coef=0.1,
        kl_estimator="low_var_kl+",
        tis_cap=1.3,
        tis_level="sequence",
    ),
)


def _builtin_losses() -> list[str]:
    return list(POLICY_LOSSES)


def test_every_builtin_policy_loss_has_a_reference():
    missing = sorted(set(_builtin_losses()) - set(REFERENCED))
    assert not missing, f"built-in policy losses without a float64 reference here: {missing}"


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", REFERENCED)
def test_policy_loss_float64_matches_loop_reference(name, mode):
    lp0, old, adv, mask, ent, ref, rollout = _data(sum(map(ord, name + mode)))
    for i, extra in enumerate(_EXTRAS):
        kw = read_by(name, dict(_LOSS_KW.get(name, {}), **extra))  # the clip bounds where the loss reads them
        if mode == "seq-mean-token-sum-norm":
            kw["loss_scale_factor"] = 3.7
        flat = dict(policy_loss=name, loss_agg_mode=mode, **kw)
        cfg = from_flat(flat)
        lp, ent_l = lp0.clone().requires_grad_(), ent.clone().requires_grad_()
        loss, _ = ppo_loss(
            lp,
            old,
            adv,
            mask,
            cfg,
            entropy=ent_l,
            ref_logprobs=ref,
            rollout_logprobs=rollout,
            generator=torch.Generator().manual_seed(0),
        )
        lp_r, ent_r = lp0.clone().requires_grad_(), ent.clone().requires_grad_()
        expected = ref_ppo_loss(lp_r, old, adv, mask, flat_view(**flat), ent_r, ref, rollout)
        assert_exact(loss, expected, f"{name}/{mode}/{i} loss")
        got = torch.autograd.grad(loss, [lp, ent_l], allow_unused=True)
        want = torch.autograd.grad(expected, [lp_r, ent_r], allow_unused=True)
        for g, w, x, what in zip(got, want, (lp, ent_l), ("logprobs", "entropy"), strict=True):
            g = torch.zeros_like(x) if g is None else g
            w = torch.zeros_like(x) if w is None else w
            assert_exact(g, w, f"{name}/{mode}/{i} d loss / d {what}")


def test_sapo_negative_advantage_exact():
    """One on-policy token, A = -100, token-mean: l = -A f(1) = 100 * 2 / tau_neg = 200 / 1.05."""
    lp = torch.full((1, 1), -0.7, dtype=F64, requires_grad=True)
    adv = torch.full((1, 1), -100.0, dtype=F64)
    loss, _ = ppo_loss(lp, lp.detach(), adv, torch.ones(1, 1, dtype=F64), from_flat(policy_loss="sapo"))
    assert loss.dtype == F64
    assert abs(loss.item() - 200 / 1.05) <= 1e-12 * 200 / 1.05, loss.item()


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimator_float64_closed_form(estimator):
    g = torch.Generator().manual_seed(5)
    lp = (torch.randn(4, 6, generator=g, dtype=F64) * 0.7).requires_grad_()
    ref = torch.randn(4, 6, generator=g, dtype=F64) * 0.7
    lp.data[0, 0] = ref[0, 0] + 25.0  # beyond the clamp
    kl = kl_penalty(lp, ref, estimator, log_ratio_clamp=20.0)
    (grad,) = torch.autograd.grad(kl.sum(), lp)
    base = estimator.rstrip("+")
    values, grads = torch.empty_like(ref), torch.empty_like(ref)
    for p in [(i, j) for i in range(4) for j in range(6)]:
        raw = float(lp[p] - ref[p])
        d = min(max(raw, -20.0), 20.0)
        inside = -20.0 < raw < 20.0
        v, dv = {
            "k1": (d, 1.0),
            "k2": (d * d / 2, d),
            "mse": (d * d / 2, d),
            "k3": (math.exp(-d) - 1 + d, 1 - math.exp(-d)),
            "low_var_kl": (math.exp(-d) - 1 + d, 1 - math.exp(-d)),
            "abs": (abs(d), math.copysign(1.0, d)),
        }[base]
        if estimator.endswith("+"):
            dv = d
        values[p], grads[p] = v, dv if inside else 0.0
    assert_exact(kl, values, f"kl {estimator} value")
    assert_exact(grad, grads, f"kl {estimator} gradient")


# =============================================================================================
# Advantage estimators, value loss, TIS weights
# =============================================================================================
def _valid_positions(mask, b):
    return [j for j in range(mask.shape[1]) if mask[b, j] == 1]


def test_gae_float64_matches_loop():
    g = torch.Generator().manual_seed(7)
    rewards, values = torch.randn(3, 7, generator=g, dtype=F64), torch.randn(3, 7, generator=g, dtype=F64)
    mask = (torch.rand(3, 7, generator=g) < 0.7).to(F64)
    gamma, lam = 0.97, 0.93
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for b in range(3):
        next_v, next_a = 0.0, 0.0
        for j in reversed(_valid_positions(mask, b)):
            delta = float(rewards[b, j]) + gamma * next_v - float(values[b, j])
            a = delta + gamma * lam * next_a
            ref_adv[b, j], ref_ret[b, j] = a, a + float(values[b, j])
            next_v, next_a = float(values[b, j]), a
    assert_exact(adv, ref_adv, "gae advantages")
    assert_exact(ret, ref_ret, "gae returns")


def test_discounted_scan_float64_matches_loop():
    g = torch.Generator().manual_seed(8)
    coeffs, inputs = torch.rand(2, 9, generator=g, dtype=F64), torch.randn(2, 9, generator=g, dtype=F64)
    out = discounted_scan(coeffs, inputs)
    ref = torch.zeros_like(inputs)
    for b in range(2):
        x = 0.0
        for j in reversed(range(9)):
            x = float(coeffs[b, j]) * x + float(inputs[b, j])
            ref[b, j] = x
    assert_exact(out, ref, "discounted_scan")


def _ref_groups(scores: list[float], groups: list[int], kind: str, eps: float = 1e-6) -> list[float]:
    out = []
    for i, s in enumerate(scores):
        members = [scores[k] for k in range(len(scores)) if groups[k] == groups[i]]
        n = len(members)
        if n == 1:
            out.append(0.0)
            continue
        mean = sum(members) / n
        if kind == "rloo":
            out.append(s - (sum(members) - s) / (n - 1))
        elif kind == "grpo":
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / (n - 1))
            out.append((s - mean) / (std + eps))
        else:  # grpo without std
            out.append(s - mean)
    return out


@pytest.mark.parametrize("kind", ["grpo", "grpo-nostd", "rloo"])
def test_group_advantages_float64_match_loop(kind):
    g = torch.Generator().manual_seed(9)
    scores = torch.randn(10, generator=g, dtype=F64)
    groups = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3]
    ref = torch.tensor(_ref_groups(scores.tolist(), groups, kind), dtype=F64)
    gid = torch.tensor(groups)
    if kind == "rloo":
        got = rloo_advantages(scores, gid)
    else:
        got = grpo_advantages(scores, gid, normalize_std=kind == "grpo", eps=1e-6)
    assert_exact(got, ref, f"{kind} with group ids")
    grid = scores[:9].reshape(3, 3)  # [n_groups, group_size]
    ref2 = torch.tensor(_ref_groups(grid.reshape(-1).tolist(), [0, 0, 0, 1, 1, 1, 2, 2, 2], kind), dtype=F64)
    got2 = rloo_advantages(grid) if kind == "rloo" else grpo_advantages(grid, normalize_std=kind == "grpo")
    assert_exact(got2, ref2.reshape(3, 3), f"{kind} grid")


def test_reinforce_pp_float64_matches_loop():
    g = torch.Generator().manual_seed(10)
    rewards, kl = torch.randn(3, 6, generator=g, dtype=F64), torch.randn(3, 6, generator=g, dtype=F64) * 0.1
    mask = (torch.rand(3, 6, generator=g) < 0.8).to(F64)
    gamma, coef, eps = 0.99, 0.13, 1e-8
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=gamma, kl=kl, kl_coef=coef, eps=eps)
    ref_ret = torch.zeros_like(rewards)
    for b in range(3):
        acc = 0.0
        for j in reversed(_valid_positions(mask, b)):
            acc = float(rewards[b, j]) - coef * float(kl[b, j]) + gamma * acc
            ref_ret[b, j] = acc
    vals = [float(ref_ret[b, j]) for b in range(3) for j in _valid_positions(mask, b)]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    ref_adv = torch.zeros_like(rewards)
    for b in range(3):
        for j in _valid_positions(mask, b):
            ref_adv[b, j] = (float(ref_ret[b, j]) - mean) / math.sqrt(var + eps)
    assert_exact(ret, ref_ret, "reinforce++ returns")
    assert_exact(adv, ref_adv, "reinforce++ advantages")


def test_broadcast_to_tokens_float64():
    values = torch.tensor([0.1, -1.3, 2.7], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0]], dtype=F64)
    ref = torch.tensor([[0.1, 0.1, 0.0], [0.0, -1.3, -1.3], [2.7, 0.0, 0.0]], dtype=F64)
    assert_exact(broadcast_to_tokens(values, mask), ref, "broadcast_to_tokens")
    seq_ids = torch.tensor([[0, 0, 1, 1, 2, -1]])
    ref2 = torch.tensor([[0.1, 0.1, -1.3, -1.3, 2.7, 0.0]], dtype=F64)
    assert_exact(
        broadcast_to_tokens(values, torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=F64), seq_ids=seq_ids),
        ref2,
        "broadcast_to_tokens packed",
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_float64_matches_loop(mode):
    g = torch.Generator().manual_seed(11)
    v0, old, ret = (torch.randn(3, 5, generator=g, dtype=F64) for _ in range(3))
    mask = (torch.rand(3, 5, generator=g) < 0.7).to(F64)
    mask[0, 0] = 1.0
    clip, scale = 0.17, (2.9 if mode.endswith("norm") else None)
    v = v0.clone().requires_grad_()
    loss, _ = value_loss(v, old, ret, mask, clip, loss_agg_mode=mode, loss_scale_factor=scale)
    vr = v0.clone().requires_grad_()
    seqs = []
    for b in range(3):
        terms = []
        for j in _valid_positions(mask, b):
            v_clip = old[b, j] + torch.clamp(vr[b, j] - old[b, j], -clip, clip)
            terms.append(0.5 * torch.maximum((vr[b, j] - ret[b, j]) ** 2, (v_clip - ret[b, j]) ** 2))
        if terms:
            seqs.append(terms)
    expected = aggregate(seqs, mode, scale)
    assert_exact(loss, expected, f"value_loss {mode}")
    assert_exact(torch.autograd.grad(loss, v)[0], torch.autograd.grad(expected, vr)[0], f"value_loss {mode} grad")


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_weights_float64_match_loop(level):
    _, old, _, mask, _, _, rollout = _data(12)
    cfg = flat_view(tis_cap=1.07, tis_level=level)
    res = compute_tis_weights(old, rollout, mask, cap=1.07, level=level)
    ref = torch.zeros_like(old)
    for p, w in ref_tis(old, rollout, mask, cfg).items():
        ref[p] = w
    assert_exact(res.weights, ref, f"tis weights ({level})")
