"""Every loss and estimator, in float64, against plain-loop float64 references at 1e-12.

A constant that enters a loss as a float32 tensor (e.g. ``torch.where(cond, 1.0, 1.05)``, which
makes a float32 tensor from two Python floats) rounds ``1.05`` to ``1.0499999523``: a relative
error of ~5e-8, invisible at the usual 1e-5 tolerances. Here the default dtype stays float32 (so
such a constant really is float32), all inputs are float64 values that float32 cannot represent,
and every result must equal a plain Python-loop reference to 1e-12 relative.

Covered: every built-in policy loss (``fnppo.core.losses.builtins.BUILTIN_LOSSES``, against its one
reference in tests/loss_reference.py), with entropy, KL and TIS terms, in all aggregation modes; every KL estimator (value and gradient); GAE, GRPO, RLOO, REINFORCE++,
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
    KLPenalty,
    RolloutCorrection,
    compute_tis_weights,
    from_flat,
    kl_penalty,
    ppo_loss,
    value_loss,
)
from fnppo.core.losses.builtins import BUILTIN_LOSSES
from tests.loss_helpers import aggregate
from tests.loss_reference import config_of, example, ref_ppo_loss, ref_tis

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
# Every built-in policy loss against its loop reference (tests/loss_reference.py)
# =============================================================================================
_EXTRAS = (
    dict(),
    dict(entropy_coef=0.03, kl=KLPenalty(0.2, "k3"), correction=RolloutCorrection(tis_cap=1.1)),
    dict(kl=KLPenalty(0.1, "low_var_kl+"), correction=RolloutCorrection(tis_cap=1.3, level="sequence")),
)
LOSS_IDS = [cls.__name__ for cls in BUILTIN_LOSSES]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("cls", BUILTIN_LOSSES, ids=LOSS_IDS)
def test_policy_loss_float64_matches_loop_reference(cls, mode):
    lp0, old, adv, mask, ent, ref, rollout = _data(sum(map(ord, cls.__name__ + mode)))
    for i, extra in enumerate(_EXTRAS):
        cfg = config_of(example(cls), mode, scale=3.7, **extra)
        lp, ent_l = lp0.clone().requires_grad_(), ent.clone().requires_grad_()
        loss, _ = ppo_loss(
            lp,
            None if cfg.bypass_old_logprobs else old,
            adv,
            mask,
            cfg,
            entropy=ent_l,
            ref_logprobs=ref,
            rollout_logprobs=rollout,
            generator=torch.Generator().manual_seed(0),
        )
        lp_r, ent_r = lp0.clone().requires_grad_(), ent.clone().requires_grad_()
        expected = ref_ppo_loss(lp_r, old, adv, mask, cfg, ent_r, ref, rollout)
        assert_exact(loss, expected, f"{cls.__name__}/{mode}/{i} loss")
        got = torch.autograd.grad(loss, [lp, ent_l], allow_unused=True)
        want = torch.autograd.grad(expected, [lp_r, ent_r], allow_unused=True)
        for g, w, x, what in zip(got, want, (lp, ent_l), ("logprobs", "entropy"), strict=True):
            g = torch.zeros_like(x) if g is None else g
            w = torch.zeros_like(x) if w is None else w
            assert_exact(g, w, f"{cls.__name__}/{mode}/{i} d loss / d {what}")


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


@pytest.mark.parametrize("eps", [1e-6, 0.3])
@pytest.mark.parametrize("kind", ["grpo", "grpo-nostd", "rloo"])
def test_group_advantages_float64_match_loop(kind, eps):
    g = torch.Generator().manual_seed(9)
    scores = torch.randn(10, generator=g, dtype=F64)
    groups = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3]
    ref = torch.tensor(_ref_groups(scores.tolist(), groups, kind, eps), dtype=F64)
    gid = torch.tensor(groups)
    if kind == "rloo":
        got = rloo_advantages(scores, gid)
    else:
        got = grpo_advantages(scores, gid, normalize_std=kind == "grpo", eps=eps)
    assert_exact(got, ref, f"{kind} with group ids")
    grid = scores[:9].reshape(3, 3)  # [n_groups, group_size]
    ref2 = torch.tensor(_ref_groups(grid.reshape(-1).tolist(), [0, 0, 0, 1, 1, 1, 2, 2, 2], kind, eps), dtype=F64)
    got2 = rloo_advantages(grid) if kind == "rloo" else grpo_advantages(grid, normalize_std=kind == "grpo", eps=eps)
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
    res = compute_tis_weights(old, rollout, mask, cap=1.07, level=level)
    ref = torch.zeros_like(old)
    for p, w in ref_tis(old, rollout, mask, 1.07, level).items():
        ref[p] = w
    assert_exact(res.weights, ref, f"tis weights ({level})")
