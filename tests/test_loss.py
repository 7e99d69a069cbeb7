"""Tests of the losses (fnppo.core.losses): the parts and from_flat, closed forms, a loop-based reference,
split invariance, validation."""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnppo.core.errors import InputError, ShapeError
from fnppo.core.losses import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Aggregation,
    KLPenalty,
    LossConfig,
    PolicyInputs,
    RolloutCorrection,
    ValueLossConfig,
    clip_cov,
    compute_tis_weights,
    from_flat,
    kl_penalty,
    loss_normalizer,
    ppo_loss,
    value_loss,
)
from fnppo.core.losses.builtins import BUILTIN_LOSSES
from fnppo.core.metrics import finalize_metrics, merge_metrics, weighted_metric
from tests.loss_helpers import (
    aggregate,
    check_split_invariance,
    float64_default,  # noqa: F401  (autouse: float64 default dtype in this module)
    grad_of,
    leaf,
    log_beyond,
    log_hitting,
    next_down,
    next_up,
    random_batch,
    read_by,
    t,
    unchanged_check,
)
from tests.loss_reference import config_of, example, ref_ppo_loss
from tests.messages import check_message, raises_message

BUILTIN = BUILTIN_LOSSES  # the one list of the built-in losses (fnppo.core.losses.builtins)
SPLIT_INVARIANT = tuple(cls for cls in BUILTIN if cls.split_invariant)
IDS = {"ids": lambda cls: cls.__name__}


def parts_for(
    cls: type,
    mode: str = "token-mean",
    *,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    tis_cap: float | None = None,
    tis_level: str = "token",
    tis_reject_low: float | None = None,
) -> LossConfig:
    """The config of a case over every built-in loss, built from parts: the loss with its reference's
    parameters (tests/loss_reference.py) and the given terms (bypass mode for a bypass-only loss)."""
    active = tis_cap is not None or tis_reject_low is not None
    correction = RolloutCorrection(tis_cap=tis_cap, level=tis_level, reject_low=tis_reject_low) if active else None
    kl = KLPenalty(kl_coef) if kl_coef else None
    return config_of(example(cls), mode, entropy_coef=entropy_coef, kl=kl, correction=correction)


def flat_for(name: str = "ppo", mode: str = "token-mean", **kw) -> dict:
    """The flat settings of a case (Dr. GRPO's constant 4 for seq-mean-token-sum-norm)."""
    if mode == "seq-mean-token-sum-norm":
        kw.setdefault("loss_scale_factor", 4.0)
    return dict(policy_loss=name, loss_agg_mode=mode, **kw)


def cfg_for(name: str = "ppo", mode: str = "token-mean", **kw) -> LossConfig:
    return from_flat(flat_for(name, mode, **kw))


LN = math.log


# =============================================================================================
# Config (the parts are tested in tests/test_loss_parts.py)
# =============================================================================================
def test_config_defaults_and_frozen():
    cfg = from_flat()
    assert cfg == LossConfig() and cfg.policy.clip_low == cfg.policy.clip_high == 0.2
    assert cfg.policy.dual_clip == 3.0 and cfg.agg.mode == "token-mean" and cfg.correction is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy.clip_low = 0.3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.entropy_coef = 0.3  # type: ignore[misc]
    assert {cls.flat_name for cls in BUILTIN} - {None} == set(POLICY_LOSSES)


@pytest.mark.parametrize(
    "kw, arg, expected, received",
    [
        (dict(policy_loss="nope"), "policy_loss", "one of ['cispo', 'clip_cov', ", "'nope'"),
        (dict(clip_ratio_low=-0.1), "clip_ratio_low", "a finite number >= 0", "-0.1"),
        (dict(clip_ratio_high=float("nan")), "clip_ratio_high", "a finite number >= 0", "nan"),
        (dict(clip_ratio_c=1.0), "clip_ratio_c", "a number > 1 or None", "1.0"),
        (dict(clip_ratio_c=0.5), "clip_ratio_c", "a number > 1 or None", "0.5"),
        (dict(loss_agg_mode="mean"), "loss_agg_mode", "one of ['token-mean', 'seq-mean-token-sum'", "'mean'"),
        (dict(loss_agg_mode="seq-mean-token-sum-norm"), "loss_scale_factor", "a number > 0 (the constant C", "None"),
        (
            dict(loss_scale_factor=3.0),
            "loss_scale_factor",
            "None unless loss_agg_mode='seq-mean-token-sum-norm'",
            "3.0",
        ),
        (dict(kl_estimator="k4"), "kl_estimator", "one of ['k1', 'k2', 'mse', 'k3'", "'k4'"),
        (dict(tis_cap=0.0), "tis_cap", "a number > 0 or None", "0.0"),
        (dict(tis_level="batch"), "tis_level", "one of ['token', 'sequence']", "'batch'"),
        (dict(tis_reject_low=2.0, tis_reject_high=1.0), "tis_reject_high", "a number > tis_reject_low=2.0", "1.0"),
        (dict(tis_reject_level="word"), "tis_reject_level", "one of ['token', 'sequence'] or None", "'word'"),
        (dict(sapo_tau_neg=0.0), "sapo_tau_neg", "a number > 0", "0.0"),
        (dict(cispo_clip_low=1.5), "cispo_clip_low", "a number in [0, 1]", "1.5"),
        (dict(clip_cov_lb=5.0, clip_cov_ub=1.0), "clip_cov_ub", "a number > clip_cov_lb=5.0", "1.0"),
        (dict(kl_cov_ratio=2.0), "kl_cov_ratio", "a number in [0, 1]", "2.0"),
        (dict(entropy_coeff=True), "entropy_coeff", "a finite number >= 0", "True"),
        (dict(log_ratio_clamp=0.0), "log_ratio_clamp", "a number > 0", "0.0"),
    ],
)
def test_config_rejects_bad_values(kw, arg, expected, received):
    with raises_message("from_flat", arg, expected, received):
        from_flat(**kw)


def test_config_replace_is_validated():
    with raises_message("ppo_clip", "dual_clip", "a number > 1 or None", "0.9"):
        dataclasses.replace(from_flat().policy, dual_clip=0.9)
    with raises_message("LossConfig", "entropy_coef", "a finite number >= 0", "-0.1"):
        dataclasses.replace(from_flat(), entropy_coef=-0.1)
    assert from_flat(clip_ratio_c=None).policy.dual_clip is None


def test_unknown_loss_lists_names():
    with raises_message(
        "from_flat",
        "policy_loss",
        "one of ['cispo', 'clip_cov', 'dppo_kl', 'dppo_tv', 'dro', 'gmpo', 'gpg', 'gspo', 'icepop', 'ipo', 'kl_cov', 'kpop'",
        "'nope'",
    ):
        from_flat(policy_loss="nope")


# =============================================================================================
# Closed forms, one per policy loss
# =============================================================================================
def test_ppo_closed_form_asymmetric_and_dual_clip():
    # ratios 1.5, 0.5, 0.5, 5 with A = 1, 1, -1, -2; eps = 0.2, c = 3:
    #  t0: max(-1.5, -1.2) = -1.2 (clipped)      t1: max(-0.5, -0.8) = -0.5
    #  t2: max(0.5, 0.8) = 0.8 (clipped)         t3: max(10, 2.4) = 10 -> dual min(10, 6) = 6
    old = t([0.0, 0.0, 0.0, 0.0])
    lp = leaf(old + t([LN(1.5), LN(0.5), LN(0.5), LN(5.0)]))
    adv = t([1.0, 1.0, -1.0, -2.0])
    loss, metrics = ppo_loss(lp, old, adv, torch.ones(1, 4), cfg_for("ppo"))
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 6.0) / 4)
    fin = finalize_metrics(metrics)
    assert fin["pg_clipfrac"] == pytest.approx(0.5) and fin["pg_clipfrac_lower"] == pytest.approx(0.25)
    # only t1 is unclipped: d(-A r)/dlogp = -A r = -0.5, over 4 tokens
    torch.testing.assert_close(grad_of(loss, lp), t([0.0, -0.125, 0.0, 0.0]))
    # without dual clip t3 contributes 10
    loss_nodual, m2 = ppo_loss(lp, old, adv, torch.ones(1, 4), cfg_for("ppo", clip_ratio_c=None))
    assert loss_nodual.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 10.0) / 4)
    assert finalize_metrics(m2)["pg_clipfrac_lower"] == 0.0
    # asymmetric bounds [0.6, 1.6]: r = 1.5 (A > 0) is no longer clipped, r = 0.5 (A < 0) clips at 0.6
    loss_asym, _ = ppo_loss(lp, old, adv, torch.ones(1, 4), cfg_for("ppo", clip_ratio_low=0.4, clip_ratio_high=0.6))
    # t0: -1.5, t1: max(-0.5, -0.6) = -0.5, t2: max(0.5, 0.6) = 0.6, t3: min(max(10, 3.2), 6) = 6
    assert loss_asym.item() == pytest.approx((-1.5 - 0.5 + 0.6 + 6.0) / 4)
    # The mean alone cannot tell the bounds apart (swapped, [0.4, 1.4], it is also 4.6 / 4); the
    # gradient can: t0 (r = 1.5 < 1.6) and t1 keep -A r, t2 is clipped at 0.6, t3 dual-clipped.
    torch.testing.assert_close(grad_of(loss_asym, lp), t([-1.5 / 4, -0.5 / 4, 0.0, 0.0]))
    # and so can single tokens: r = 1.5, A = 1 is clipped only by the upper bound 1 + clip_ratio_high,
    # r = 0.5, A = -1 only by the lower bound 1 - clip_ratio_low
    for r, a, low, high, expected in (
        (1.5, 1.0, 0.4, 0.6, -1.5),
        (1.5, 1.0, 0.6, 0.4, -1.4),
        (0.5, -1.0, 0.4, 0.6, 0.6),
        (0.5, -1.0, 0.6, 0.4, 0.5),
    ):
        one, _ = ppo_loss(
            t([LN(r)]), t([0.0]), t([a]), torch.ones(1, 1), cfg_for("ppo", clip_ratio_low=low, clip_ratio_high=high)
        )
        assert one.item() == pytest.approx(expected, abs=1e-12), (r, a, low, high)
    # ppo_kl = mean(old - new)
    assert fin["ppo_kl"] == pytest.approx(-(LN(1.5) + 2 * LN(0.5) + LN(5.0)) / 4)


def test_gspo_closed_form():
    # one sequence, log-ratios log 2 and 0: s = exp(log(2)/2) = sqrt(2); wide clip -> unclipped.
    old = t([-1.0, -2.0, -3.0])
    lp = leaf(old + t([LN(2.0), 0.0, 5.0]))
    mask = t([1.0, 1.0, 0.0])
    adv = t([1.0, 1.0, 1.0])
    cfg = cfg_for("gspo", "seq-mean-token-mean", clip_ratio_high=1.0)
    loss, _ = ppo_loss(lp, old, adv, mask, cfg)
    assert loss.item() == pytest.approx(-math.sqrt(2))
    # gradient of each token: -A s / |y|
    torch.testing.assert_close(grad_of(loss, lp), t([-math.sqrt(2) / 2, -math.sqrt(2) / 2, 0.0]))
    # default clip (0.2): s clipped at 1.2 for A > 0, no gradient
    loss_c, m = ppo_loss(lp, old, adv, mask, cfg_for("gspo", "seq-mean-token-mean"))
    assert loss_c.item() == pytest.approx(-1.2)
    assert finalize_metrics(m)["pg_clipfrac"] == 1.0
    torch.testing.assert_close(grad_of(loss_c, lp), torch.zeros(1, 3))


def test_cispo_closed_form():
    # r = 2, 0.5; weights clip(r, 0, 1.28) = 1.28, 0.5 (stopped); loss -w A logp
    lp = leaf(t([-1.0, -2.0]))
    old = lp.detach() - t([LN(2.0), LN(0.5)])
    loss, m = ppo_loss(lp, old, t([1.0, 1.0]), torch.ones(1, 2), cfg_for("cispo"))
    assert loss.item() == pytest.approx((1.28 * 1.0 + 0.5 * 2.0) / 2)
    torch.testing.assert_close(grad_of(loss, lp), t([-1.28 / 2, -0.5 / 2]))
    assert finalize_metrics(m)["pg_clipfrac"] == 0.5


@pytest.mark.parametrize("name", ["gpg", "reinforce"])
def test_reinforce_closed_form(name):
    lp = leaf(t([-1.0, -2.0]))
    loss, _ = ppo_loss(lp, t([5.0, 5.0]), t([1.0, -1.0]), torch.ones(1, 2), cfg_for(name))
    assert loss.item() == pytest.approx((1.0 - 2.0) / 2)
    torch.testing.assert_close(grad_of(loss, lp), t([-0.5, 0.5]))


def test_gmpo_closed_form():
    # log-ratios 0.5, -0.1, log-space clip 0.4: A > 0 -> u = (0.4, -0.1), mean 0.15
    old = t([0.0, 0.0])
    lp = leaf(t([0.5, -0.1]))
    cfg = cfg_for("gmpo", "seq-mean-token-mean", clip_ratio_low=0.4, clip_ratio_high=0.4)
    loss, m = ppo_loss(lp, old, t([1.0, 1.0]), torch.ones(1, 2), cfg)
    assert loss.item() == pytest.approx(-math.exp(0.15))
    torch.testing.assert_close(grad_of(loss, lp), t([0.0, -math.exp(0.15) / 2]))
    assert finalize_metrics(m)["pg_clipfrac"] == 0.5
    # A < 0 -> u = max(lr, clip(lr)) = (0.5, -0.1), mean 0.2, both tokens keep their gradient
    loss_n, m = ppo_loss(lp, old, t([-1.0, -1.0]), torch.ones(1, 2), cfg)
    assert loss_n.item() == pytest.approx(math.exp(0.2))
    torch.testing.assert_close(grad_of(loss_n, lp), t([math.exp(0.2) / 2, math.exp(0.2) / 2]))
    assert finalize_metrics(m)["pg_clipfrac"] == 0.0


def test_sapo_closed_form():
    sig = 1 / (1 + math.exp(-0.5))  # sigmoid(tau (r - 1)) with tau = 1, r = 1.5
    lp = leaf(t([LN(1.5), 0.0]))
    loss, _ = ppo_loss(lp, t([0.0, 0.0]), t([1.0, -2.0]), torch.ones(1, 2), cfg_for("sapo"))
    # token 1 is on-policy: f(1) = 4 / tau_neg * 1/2
    assert loss.item() == pytest.approx((-4 * sig + 2.0 * 2.0 / 1.05) / 2)
    # gradient: -A f'(r) r with f'(r) = 4 s (1 - s); at r = 1 it is the plain policy gradient -A
    torch.testing.assert_close(grad_of(loss, lp), t([-4 * sig * (1 - sig) * 1.5 / 2, 2.0 / 2]))


def test_icepop_keeps_the_inclusive_band_and_drops_extreme_ratios_without_nan():
    # ratios 0.1, 0.2 (the low edge), 1, 5 (the high edge), 6 and e^1000 (inf); band [0.2, 5] kept inclusive
    ratios = [0.1, 0.2, 1.0, 5.0, 6.0]
    lp = leaf(t([LN(r) for r in ratios] + [1000.0]))
    adv = t([1.0, 2.0, -1.0, 0.5, 3.0, 1.0])
    loss, m = ppo_loss(lp, torch.zeros(1, 6), adv, torch.ones(1, 6), cfg_for("icepop"))
    kept = [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    r = ratios + [0.0]  # the dropped e^1000 never enters (no 0 * inf)
    assert loss.item() == pytest.approx(sum(-a * ri * k for a, ri, k in zip(adv.tolist()[0], r, kept)) / 6)
    g = grad_of(loss, lp)
    assert torch.isfinite(g).all()
    torch.testing.assert_close(g, t([-a * ri * k / 6 for a, ri, k in zip(adv.tolist()[0], r, kept)]))
    assert finalize_metrics(m)["pg_clipfrac"] == pytest.approx(3 / 6)


def test_kpop_band_is_the_binary_kl_both_ways():
    # q = 0.5 for every token; p moves: the binary KL both ways is below 0.1 for p = 0.6, above for 0.9
    p = [0.6, 0.9, 0.5, 0.1]
    lp = leaf(t([LN(x) for x in p]))
    old = t([LN(0.5)] * 4)
    adv = t([1.0, 1.0, -2.0, 1.0])
    cfg = LossConfig(
        policy=from_flat(policy_loss="kpop", kpop_threshold=0.1, kpop_kl_coef=0.0).policy, agg=Aggregation("token-mean")
    )
    loss, m = ppo_loss(lp, old, adv, torch.ones(1, 4), cfg)

    def db(a, b):
        return a * LN(a / b) + (1 - a) * LN((1 - a) / (1 - b))

    kept = [db(x, 0.5) <= 0.1 and db(0.5, x) <= 0.1 for x in p]
    assert kept == [True, False, True, False]
    assert loss.item() == pytest.approx(sum(-a * x / 0.5 for a, x, k in zip(adv.tolist()[0], p, kept) if k) / 4)
    assert finalize_metrics(m)["pg_clipfrac"] == pytest.approx(0.5)


def test_clip_cov_detaches_the_selected_token():
    # A - mean A = (3, -1, -1, -1); logp - mean logp = (1.5, -.5, -.5, -.5); cov = (4.5, .5, .5, .5):
    # only token 0 lies in (1, 5); n = 4 -> k = 1. Ratios are 1 (nothing clipped).
    lp = leaf(t([0.0, -2.0, -2.0, -2.0]))
    adv = t([3.0, -1.0, -1.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    loss, m = ppo_loss(lp, lp.detach(), adv, torch.ones(1, 4), cfg_for("clip_cov"), generator=gen)
    assert loss.item() == pytest.approx(0.0)  # value kept: mean(-A)
    torch.testing.assert_close(grad_of(loss, lp), t([0.0, 0.25, 0.25, 0.25]))
    assert finalize_metrics(m)["clip_cov_frac"] == 0.25


def test_clip_cov_random_selection_count_and_reproducibility():
    # 8 tokens, all with cov = 4 (in the band), ratio 0.5 -> k = 4 detached tokens.
    lp = leaf(t([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0]))
    adv = t([2.0, 2.0, 2.0, 2.0, -2.0, -2.0, -2.0, -2.0])
    cfg = cfg_for("clip_cov", clip_cov_ratio=0.5)
    grads = []
    for seed in (1, 1, 2):
        loss, m = ppo_loss(lp, lp.detach(), adv, torch.ones(1, 8), cfg, generator=torch.Generator().manual_seed(seed))
        grads.append(grad_of(loss, lp))
        assert finalize_metrics(m)["clip_cov_frac"] == 0.5
        assert int((grads[-1] == 0).sum()) == 4
    torch.testing.assert_close(grads[0], grads[1])


def test_kl_cov_penalizes_top_covariance_token():
    lp = leaf(t([0.0, -2.0, -2.0, -2.0]))
    old = lp.detach() - 0.1
    adv = t([3.0, -1.0, -1.0, -1.0])
    loss, m = ppo_loss(lp, old, adv, torch.ones(1, 4), cfg_for("kl_cov", kl_cov_coef=1.0))
    r = math.exp(0.1)
    assert loss.item() == pytest.approx((-3 * r + 3 * r + 0.1) / 4)
    torch.testing.assert_close(grad_of(loss, lp), t([(-3 * r + 1.0) / 4, r / 4, r / 4, r / 4]))
    assert finalize_metrics(m)["kl_cov_frac"] == 0.25


# =============================================================================================
# Aggregation modes
# =============================================================================================
AGG_CASES = {
    # per-token loss = A (gpg with logp = -1): rows (1,2,3 | 4 | empty)
    "token-mean": (1 + 2 + 3 + 4) / 4,
    "seq-mean-token-sum": (6 + 4) / 2,
    "seq-mean-token-mean": (2 + 4) / 2,
    "seq-mean-token-sum-norm": (6 + 4) / (2 * 4.0),
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_modes_closed_form(mode):
    adv = t([1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0])
    mask = t([1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0])
    lp = leaf(-torch.ones(3, 4))
    cfg = cfg_for("gpg", mode)
    loss, metrics = ppo_loss(lp, lp.detach(), adv, mask, cfg)
    assert loss.item() == pytest.approx(AGG_CASES[mode])
    expected_norm = 4.0 if mode == "token-mean" else 2.0
    assert loss_normalizer(mask, cfg.agg).item() == expected_norm
    assert loss_normalizer(mask, mode).item() == expected_norm
    assert loss_normalizer(mask, cfg).item() == expected_norm  # a config holding an Aggregation
    assert finalize_metrics(metrics)["loss"] == pytest.approx(AGG_CASES[mode])
    # with a global normalizer twice as large the loss halves
    loss2, _ = ppo_loss(lp, lp.detach(), adv, mask, cfg, normalizer=2 * expected_norm)
    assert loss2.item() == pytest.approx(AGG_CASES[mode] / 2)
    loss3, _ = ppo_loss(lp, lp.detach(), adv, mask, cfg, normalizer=torch.tensor(2 * expected_norm))
    assert loss3.item() == pytest.approx(AGG_CASES[mode] / 2)


# =============================================================================================
# KL estimators
# =============================================================================================
D = LN(2.0)
KL_VALUES = {  # d = logp - ref = +log 2 and -log 2
    "k1": (D, -D),
    "k2": (D * D / 2, D * D / 2),
    "mse": (D * D / 2, D * D / 2),
    "k3": (0.5 - 1 + D, 2 - 1 - D),
    "low_var_kl": (0.5 - 1 + D, 2 - 1 - D),
    "abs": (D, D),
}
KL_GRADS = {  # d/dlogp
    "k1": (1.0, 1.0),
    "k2": (D, -D),
    "mse": (D, -D),
    "k3": (1 - 0.5, 1 - 2.0),
    "low_var_kl": (0.5, -1.0),
    "abs": (1.0, -1.0),
}


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimators_closed_form(estimator):
    base = estimator.rstrip("+")
    lp = leaf(t([0.0, -D]))
    ref = t([-D, 0.0])
    kl = kl_penalty(lp, ref, estimator)
    torch.testing.assert_close(kl, t(list(KL_VALUES[base])))
    g = grad_of(kl.sum(), lp)
    expected = (D, -D) if estimator.endswith("+") else KL_GRADS[base]
    torch.testing.assert_close(g, t(list(expected)))


def test_kl_estimator_errors_and_clamp():
    with raises_message(
        "kl_penalty", "estimator", "one of ['k1', 'k2', 'mse', 'k3', 'low_var_kl', 'abs', 'k1+'", "'k9'"
    ):
        kl_penalty(torch.zeros(3), torch.zeros(3), "k9")
    kl = kl_penalty(t([0.0]), t([1e4]), "k3")
    assert torch.isfinite(kl).all()


@pytest.mark.parametrize("estimator", ["k3+", "k1+", "abs+", "low_var_kl+"])
def test_straight_through_kl_in_ppo_loss(estimator):
    lp = leaf(t([0.0, -D]))
    ref = t([-D, 0.0])
    cfg = cfg_for("gpg", kl_coef=0.5, kl_estimator=estimator)
    adv = torch.zeros(1, 2)
    loss, m = ppo_loss(lp, lp.detach(), adv, torch.ones(1, 2), cfg, ref_logprobs=ref)
    base = estimator.rstrip("+")
    assert loss.item() == pytest.approx(0.5 * sum(KL_VALUES[base]) / 2)
    torch.testing.assert_close(grad_of(loss, lp), t([0.5 * D / 2, -0.5 * D / 2]))
    assert finalize_metrics(m)["kl_loss"] == pytest.approx(sum(KL_VALUES[base]) / 2)


def test_entropy_and_kl_terms_compose():
    lp = leaf(t([-1.0, -2.0, -0.5]))
    ent = leaf(t([0.7, 0.1, 0.3]))
    ref = t([-1.5, -2.0, 0.0])
    adv = t([1.0, -1.0, 2.0])
    mask = t([1.0, 1.0, 0.0])
    cfg = cfg_for("gpg", entropy_coeff=0.1, kl_coef=0.2, kl_estimator="k1")
    loss, m = ppo_loss(lp, lp.detach(), adv, mask, cfg, entropy=ent, ref_logprobs=ref)
    pg = (1.0 - 2.0) / 2
    ent_mean = (0.7 + 0.1) / 2
    kl = (0.5 + 0.0) / 2
    assert loss.item() == pytest.approx(pg - 0.1 * ent_mean + 0.2 * kl)
    fin = finalize_metrics(m)
    assert fin["pg_loss"] == pytest.approx(pg) and fin["entropy"] == pytest.approx(ent_mean)
    assert fin["kl_loss"] == pytest.approx(kl)
    assert fin["loss"] == pytest.approx(fin["pg_loss"] - 0.1 * fin["entropy"] + 0.2 * fin["kl_loss"])
    g_lp, g_ent = torch.autograd.grad(loss, [lp, ent])
    torch.testing.assert_close(g_ent, t([-0.05, -0.05, 0.0]))
    torch.testing.assert_close(g_lp, t([(-1.0 + 0.2) / 2, (1.0 + 0.2) / 2, 0.0]))


def test_missing_optional_inputs_raise():
    x = torch.zeros(1, 2)
    with raises_message("ppo_loss", "entropy", "a tensor since entropy_coef=0.1", "None"):
        ppo_loss(x, x, x, x, cfg_for(entropy_coeff=0.1))
    with raises_message("ppo_loss", "ref_logprobs", "a tensor since kl.coef=0.1", "None"):
        ppo_loss(x, x, x, x, cfg_for(kl_coef=0.1))
    with raises_message(
        "ppo_loss",
        "rollout_logprobs",
        "a tensor since rollout correction (LossConfig.correction) is configured",
        "None",
    ):
        ppo_loss(x, x, x, x, cfg_for(tis_cap=2.0))


# =============================================================================================
# Truncated importance sampling
# =============================================================================================
def test_tis_token_level_closed_form():
    old = t([LN(3.0), LN(0.5), 0.0, 7.0])
    rollout = t([0.0, 0.0, 0.0, 0.0])
    mask = t([1.0, 1.0, 1.0, 0.0])
    res = compute_tis_weights(old, rollout, mask, cap=2.0)
    torch.testing.assert_close(res.weights, t([2.0, 0.5, 1.0, 0.0]))
    torch.testing.assert_close(res.keep, t([1.0, 1.0, 1.0, 0.0]))
    fin = finalize_metrics(res.metrics)
    assert fin["tis_weight"] == pytest.approx(3.5 / 3)
    assert fin["tis_truncated_frac"] == pytest.approx(1 / 3)
    assert fin["tis_ess"] == pytest.approx((3.5 / 3) ** 2 / ((4 + 0.25 + 1) / 3))
    # rejection outside [0.6, 2.5] (untruncated): tokens 0 and 1 go
    res = compute_tis_weights(old, rollout, mask, cap=2.0, reject_low=0.6, reject_high=2.5)
    torch.testing.assert_close(res.weights, t([0.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(res.keep, t([0.0, 0.0, 1.0, 0.0]))
    assert finalize_metrics(res.metrics)["tis_rejected_frac"] == pytest.approx(2 / 3)
    # rejection only (cap None): weight 1 where kept
    res = compute_tis_weights(old, rollout, mask, cap=None, reject_high=2.5)
    torch.testing.assert_close(res.weights, t([0.0, 1.0, 1.0, 0.0]))


def test_tis_sequence_level_closed_form():
    old = t([LN(3.0), LN(0.5), 0.0], [LN(4.0), 0.0, 0.0])
    rollout = torch.zeros(2, 3)
    mask = t([1.0, 1.0, 0.0], [1.0, 1.0, 1.0])
    res = compute_tis_weights(old, rollout, mask, cap=2.0, level="sequence")
    # sequence weights 1.5 and 4 -> truncated 1.5, 2
    torch.testing.assert_close(res.weights, t([1.5, 1.5, 0.0], [2.0, 2.0, 2.0]))
    fin = finalize_metrics(res.metrics)
    assert fin["tis_weight"] == pytest.approx(3.5 / 2) and fin["tis_truncated_frac"] == pytest.approx(0.5)
    # sequence rejection with token-level weights: sequence 1 (w = 4) rejected
    res = compute_tis_weights(old, rollout, mask, cap=2.0, level="token", reject_high=3.0, reject_level="sequence")
    torch.testing.assert_close(res.weights, t([2.0, 0.5, 0.0], [0.0, 0.0, 0.0]))
    assert finalize_metrics(res.metrics)["tis_rejected_frac"] == pytest.approx(0.5)


def test_tis_in_ppo_loss():
    # gpg with logp = -1: per-token pg loss = A; weights (2, 0.5, 1)
    lp = leaf(-torch.ones(1, 3))
    old = t([LN(3.0), LN(0.5), 0.0])
    adv = t([1.0, 2.0, 3.0])
    ent = t([1.0, 1.0, 1.0])
    cfg = cfg_for("gpg", tis_cap=2.0, entropy_coeff=0.5)
    loss, m = ppo_loss(lp, old, adv, torch.ones(1, 3), cfg, rollout_logprobs=torch.zeros(1, 3), entropy=ent)
    assert loss.item() == pytest.approx((2.0 * 1 + 0.5 * 2 + 1.0 * 3) / 3 - 0.5 * 1.0)
    torch.testing.assert_close(grad_of(loss, lp), t([-2.0 / 3, -1.0 / 3, -3.0 / 3]))
    fin = finalize_metrics(m)
    assert fin["tis_weight"] == pytest.approx(3.5 / 3)
    assert fin["rollout_kl"] == pytest.approx(-(LN(3.0) + LN(0.5)) / 3)
    # rejected tokens leave every term but stay in the denominator
    cfg = cfg_for("gpg", tis_cap=2.0, tis_reject_high=2.5, entropy_coeff=0.5)
    loss, _ = ppo_loss(lp, old, adv, torch.ones(1, 3), cfg, rollout_logprobs=torch.zeros(1, 3), entropy=ent)
    assert loss.item() == pytest.approx((0.5 * 2 + 1.0 * 3) / 3 - 0.5 * 2 / 3)


# =============================================================================================
# Loop-based reference (tests/loss_reference.py): loss value and gradients for every loss and mode
# =============================================================================================
# Input dtypes of the loss tests, each against the float64 loop reference evaluated on the very values
# the dtype holds (inputs rounded to the dtype, then promoted to fp64). ppo_loss computes in
# promote_types(dtype, fp32), so fp32 and bf16 losses carry fp32 rounding only; gradients come back in
# the input dtype (bf16 keeps 8 significant bits: relative rounding <= 2^-9).
DTYPE_TOL = {  # dtype -> (loss tolerance, gradient tolerance) for torch.testing.assert_close
    torch.float64: (dict(rtol=1e-12, atol=1e-12), dict(rtol=1e-12, atol=1e-12)),  # exact up to summation order
    torch.float32: (dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-5, atol=1e-6)),
    torch.bfloat16: (dict(rtol=1e-5, atol=1e-6), dict(rtol=2**-8, atol=1e-6)),
}
DTYPE_IDS = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16"}
CHECKING = pytest.mark.parametrize("checking", [True, False], ids=["checking-on", "checking-off"])
DTYPES = pytest.mark.parametrize("dtype", list(DTYPE_TOL), ids=DTYPE_IDS.get)


@CHECKING
@DTYPES
@pytest.mark.parametrize("cls", BUILTIN, **IDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_matches_loop_reference(cls, mode, dtype, checking):
    from fnppo.core.typing import typechecking

    # a seed fixed by the case (hash() of a str changes with PYTHONHASHSEED, i.e. from run to run)
    batch = random_batch(zlib.crc32(f"{cls.__name__}/{mode}".encode()) % 1000, 4, 6)
    lp0, old, adv, mask, ent, ref, rollout = (x.to(dtype) for x in batch)
    loss_tol, grad_tol = DTYPE_TOL[dtype]
    for extra in (
        dict(),
        dict(entropy_coef=0.03, kl_coef=0.2, tis_cap=1.5, tis_level="sequence"),
        dict(tis_cap=1.2),
    ):
        cfg = parts_for(cls, mode, **extra)
        lp = leaf(lp0)
        ent_l = leaf(ent)
        kw = dict(entropy=ent_l, ref_logprobs=ref, rollout_logprobs=rollout, generator=torch.Generator().manual_seed(0))
        with typechecking(checking):
            loss, _ = ppo_loss(lp, old, adv, mask, cfg, **kw)
        assert loss.dtype == torch.promote_types(dtype, torch.float32)
        lp64, ent64 = leaf(lp0.double()), leaf(ent.double())
        expected = ref_ppo_loss(
            lp64, old.double(), adv.double(), mask.double(), cfg, ent64, ref.double(), rollout.double()
        )
        torch.testing.assert_close(loss.double(), expected, **loss_tol)
        g = torch.autograd.grad(loss, [lp, ent_l], allow_unused=True)
        ge = torch.autograd.grad(expected, [lp64, ent64], allow_unused=True)
        for a, e, x in zip(g, ge, (lp64, ent64), strict=True):
            assert a is None or a.dtype == dtype
            torch.testing.assert_close(
                torch.zeros_like(x) if a is None else a.double(), torch.zeros_like(x) if e is None else e, **grad_tol
            )


# =============================================================================================
# Split invariance, packed layout
# =============================================================================================
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 6),
    s=st.integers(1, 5),
    cls=st.sampled_from(SPLIT_INVARIANT),
    mode=st.sampled_from(LOSS_AGG_MODES),
    cuts=st.lists(st.integers(1, 5), max_size=4),
    p=st.sampled_from([0.0, 0.3, 0.9]),
    extras=st.booleans(),
)
def test_split_invariance(seed, b, s, cls, mode, cuts, p, extras):
    kw = dict(entropy_coef=0.01, kl_coef=0.1, tis_cap=1.3, tis_level="sequence", tis_reject_low=0.2) if extras else {}
    check_split_invariance(random_batch(seed, b, s, p), parts_for(cls, mode, **kw), cuts)


@pytest.mark.parametrize("cls", BUILTIN, **IDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_packed_layout_matches_padded(cls, mode):
    b, s = 3, 5
    lp0, old, adv, mask, ent, ref, rollout = random_batch(7, b, s)
    mask[1] = 0.0  # an empty sequence
    # clip_cov draws its tokens in an order that depends on the layout; with its reference's ratio = 1
    # every eligible token is taken (no draw), so values and gradients must agree (the default ratio: below)
    cfg = parts_for(cls, mode, entropy_coef=0.01, kl_coef=0.1, tis_cap=1.3, tis_level="sequence")
    others = dict(entropy=ent, ref_logprobs=ref, rollout_logprobs=rollout)
    lp = leaf(lp0)
    padded, pm = ppo_loss(lp, old, adv, mask, cfg, generator=torch.Generator().manual_seed(3), **others)
    g_padded = grad_of(padded, lp)
    # pack: sequences renamed (2, 0, 1), two padding tokens appended (seq id -1)
    names = torch.tensor([2, 0, 1])
    seq_ids = torch.cat([names.repeat_interleave(s), torch.tensor([-1, -1])])[None]

    def pack(x, fill=0.0):
        return torch.cat([x.reshape(-1), torch.full((2,), fill)])[None]

    lp_p = leaf(pack(lp0))
    packed, qm = ppo_loss(
        lp_p,
        pack(old, float("nan")),
        pack(adv),
        pack(mask),
        cfg,
        seq_ids=seq_ids,
        generator=torch.Generator().manual_seed(3),
        **{k: pack(v) for k, v in others.items()},
    )
    if cls is clip_cov:
        assert finalize_metrics(pm)["clip_cov_frac"] > 0  # some tokens were detached
        # the default ratio: the drawn tokens may differ, but detaching keeps every value
        default = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, ratio=2e-4))
        v_padded, _ = ppo_loss(lp0, old, adv, mask, default, generator=torch.Generator().manual_seed(3), **others)
        v_packed, _ = ppo_loss(
            pack(lp0),
            pack(old, float("nan")),
            pack(adv),
            pack(mask),
            default,
            seq_ids=seq_ids,
            generator=torch.Generator().manual_seed(3),
            **{k: pack(v) for k, v in others.items()},
        )
        torch.testing.assert_close(v_packed, v_padded)
        torch.testing.assert_close(v_packed, padded)
    torch.testing.assert_close(packed, padded)
    torch.testing.assert_close(grad_of(packed, lp_p)[0, :-2].reshape(b, s), g_padded)
    assert loss_normalizer(pack(mask), cfg.agg, seq_ids=seq_ids).item() == loss_normalizer(mask, cfg.agg).item()
    fp, fq = finalize_metrics(pm), finalize_metrics(qm)
    for key in fp:
        assert fq[key] == pytest.approx(fp[key], rel=1e-5, abs=1e-6), key


# =============================================================================================
# Clip bounds at equality: a ratio exactly on a bound is not clipped and keeps its gradient
# =============================================================================================
# (policy loss, config, ratio exactly on the bound, advantage, the metric counting that bound,
#  the gradient one float beyond the bound, per unit of -A)
CLIP_EDGES = {
    "ppo-upper": ("ppo", dict(clip_ratio_high=0.25), 1.25, 1.0, "pg_clipfrac", 0.0),
    "ppo-lower": ("ppo", dict(clip_ratio_low=0.5), 0.5, -1.0, "pg_clipfrac", 0.0),
    "ppo-dual": ("ppo", dict(clip_ratio_c=2.0, clip_ratio_high=0.25), 2.0, -1.0, "pg_clipfrac_lower", 0.0),
    "clip_cov-dual": (
        "clip_cov",
        dict(clip_ratio_c=2.0, clip_ratio_high=0.25, clip_cov_ub=1e9, clip_cov_lb=1e8),
        2.0,
        -1.0,
        "pg_clipfrac_lower",
        0.0,
    ),
    "gspo-upper": ("gspo", dict(clip_ratio_high=0.25), 1.25, 1.0, "pg_clipfrac", 0.0),
    "gspo-lower": ("gspo", dict(clip_ratio_low=0.5), 0.5, -1.0, "pg_clipfrac", 0.0),
    "cispo-upper": ("cispo", dict(cispo_clip_high=0.25), 1.25, 1.0, "pg_clipfrac", 1.25),  # weight stays at 1.25
    "cispo-lower": ("cispo", dict(cispo_clip_low=0.5), 0.5, 1.0, "pg_clipfrac", 0.5),
}


@pytest.mark.parametrize("case", list(CLIP_EDGES))
def test_ratio_exactly_on_a_clip_bound_is_not_clipped(case):
    name, kw, bound, a, metric, beyond_grad = CLIP_EDGES[case]
    x = log_hitting(bound)  # exp(x - 0) == bound exactly in float64
    outward = log_beyond(bound, up=bound > 1)  # the nearest ratio beyond the bound
    for lp_value, clipped in ((x, False), (outward, True)):
        lp = leaf(t([lp_value]))
        loss, m = ppo_loss(lp, t([0.0]), t([a]), torch.ones(1, 1), cfg_for(name, **kw))
        r = math.exp(lp_value)  # float64 reference of the unclipped ratio
        assert finalize_metrics(m)[metric] == float(clipped), (lp_value, finalize_metrics(m))
        # unclipped: d(-A r)/dlogp = -A r (cispo: d(-sg(r) A logp)/dlogp = -A r); clipped: see the table
        expected = -a * (beyond_grad if clipped else r)
        assert grad_of(loss, lp).item() == pytest.approx(expected, rel=1e-15, abs=0), (lp_value, clipped)


def test_gmpo_log_ratio_exactly_on_its_bound_is_not_clipped():
    # gmpo clips the log-ratio to [-clip_ratio_low, clip_ratio_high]: log r = 0.25 exactly (-0.75 - (-1))
    cfg = cfg_for("gmpo", clip_ratio_low=0.25, clip_ratio_high=0.25)
    for lp_value, a, clipped in (
        (-0.75, 1.0, False),
        (next_up(-0.75), 1.0, True),
        (-1.25, -1.0, False),
        (next_down(-1.25), -1.0, True),
    ):
        lp = leaf(t([lp_value]))
        loss, m = ppo_loss(lp, t([-1.0]), t([a]), torch.ones(1, 1), cfg)
        assert finalize_metrics(m)["pg_clipfrac"] == float(clipped), lp_value
        expected = 0.0 if clipped else -a * math.exp(lp_value + 1.0)  # l = -A exp(u), u = log r
        assert grad_of(loss, lp).item() == pytest.approx(expected, rel=1e-12, abs=0), lp_value


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "clip_cov"])
@pytest.mark.parametrize("packed", [False, True])
def test_on_policy_with_zero_clip_width_is_the_plain_policy_gradient(name, packed):
    # logprobs == old_logprobs: every ratio is exactly 1 = 1 - 0 = 1 + 0, on both bounds at once
    lp0, _, adv, mask, *_ = random_batch(21, 3, 5)
    mask[0, 0] = 1.0
    kw = dict(clip_ratio_low=0.0, clip_ratio_high=0.0, cispo_clip_low=0.0, cispo_clip_high=0.0)
    if name == "clip_cov":
        kw.update(clip_cov_lb=1e8, clip_cov_ub=1e9)  # no token in the covariance band: plain ppo
    seq_ids = None
    if packed:
        lp0, adv, mask = (x.reshape(1, -1) for x in (lp0, adv, mask))
        seq_ids = torch.arange(3).repeat_interleave(5)[None]
    lp = leaf(lp0)
    loss, m = ppo_loss(lp, lp0.clone(), adv, mask, cfg_for(name, **read_by(name, kw)), seq_ids=seq_ids)
    fin = finalize_metrics(m)
    assert fin["pg_clipfrac"] == 0.0 and fin.get("pg_clipfrac_lower", 0.0) == 0.0  # (gspo, cispo: no lower bound)
    # token-mean of -A r with r = 1: value -sum(A m) / N; gradient -A m / N (float64 loops)
    n = sum(float(v) for v in mask.reshape(-1))
    expected_grad = [-float(a) * float(v) / n for a, v in zip(adv.reshape(-1), mask.reshape(-1), strict=True)]
    got = grad_of(loss, lp).reshape(-1).tolist()
    assert got == pytest.approx(expected_grad, rel=1e-15, abs=1e-300)
    if name != "cispo":  # cispo's value contains logp
        assert loss.item() == pytest.approx(
            -sum(float(a) * float(v) for a, v in zip(adv.reshape(-1), mask.reshape(-1), strict=True)) / n, rel=1e-14
        )


def test_value_clip_at_equality():
    # |V - old_V| == clip_range exactly (1.25 - 1.0 = 0.25): the clip is not active, the loss is 1/2 (V - R)^2
    # with its gradient V - R; one float beyond (towards R = 1.5), V_clip = old_V + 0.25 gives the larger
    # term: clipped, no gradient.
    for v_value, clipped in ((1.25, False), (next_up(1.25), True)):
        v = leaf(t([v_value]))
        loss, m = value_loss(v, t([1.0]), t([1.5]), torch.ones(1, 1), 0.25)
        assert finalize_metrics(m)["vf_clipfrac"] == float(clipped)
        assert grad_of(loss, v).item() == (0.0 if clipped else v_value - 1.5), v_value
    # float32, |V - old_V| rounds to exactly clip_range while old_V + 0.25 rounds away from V: at equality the
    # clip is not active (V_clip = V), so rounding cannot pick the clipped term (here it would be larger)
    f32 = dict(dtype=torch.float32)
    v32, old32 = torch.tensor([[0.07251190394163132]], **f32), torch.tensor([[-0.17748808860778809]], **f32)
    assert (v32 - old32).item() == 0.25 and (old32 + 0.25).item() != v32.item()  # the premise
    v = leaf(v32)
    loss, m = value_loss(v, old32, torch.zeros(1, 1, **f32), torch.ones(1, 1, **f32), 0.25)
    assert finalize_metrics(m)["vf_clipfrac"] == 0.0 and torch.equal(grad_of(loss, v), v32)
    # both terms equal while the clip is active (old_V = 0, V = 1, R = 0.75: V_clip = 0.5, (V - R)^2 = (V_clip - R)^2):
    # the loss is the unclipped term, with its gradient V - R, and the token is not counted as clipped
    v = leaf(t([1.0]))
    loss, m = value_loss(v, t([0.0]), t([0.75]), torch.ones(1, 1), 0.5)
    assert loss.item() == 0.5 * 0.25**2 and finalize_metrics(m)["vf_clipfrac"] == 0.0
    assert grad_of(loss, v).item() == 0.25


# =============================================================================================
# NaN at masked-out positions: the loss ignores it; a Sample refuses it (collate_microbatch)
# =============================================================================================
@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("packed", [False, True])
def test_nan_at_masked_positions_leaves_the_loss_unchanged(name, packed):
    # ppo_loss reads no position where loss_mask is 0: NaN / inf there give the loss, gradient and metrics
    # of zeros there, in both layouts (with rollout correction, KL and entropy terms in use)
    lp0, old, adv, mask, ent, ref, rollout = random_batch(31, 3, 5)
    mask[:, 0] = 1.0
    mask[:, -1] = 0.0
    cfg = cfg_for(
        name,
        "seq-mean-token-mean",
        entropy_coeff=0.1,
        kl_coef=0.1,
        tis_cap=1.5,
        tis_reject_low=0.5,
        reject_seq_max_abs_log_ratio=5.0,
    )
    seq_ids = None
    if packed:
        lp0, old, adv, mask, ent, ref, rollout = (x.reshape(1, -1) for x in (lp0, old, adv, mask, ent, ref, rollout))
        seq_ids = torch.arange(3).repeat_interleave(5)[None]
    off = mask == 0

    def fill(x, value):
        return torch.where(off, torch.full_like(x, value), x)

    def run(value):
        lp = leaf(fill(lp0, value))
        loss, m = ppo_loss(
            lp,
            fill(old, value),
            fill(adv, value),
            mask,
            cfg,
            entropy=fill(ent, value),
            ref_logprobs=fill(ref, value),
            rollout_logprobs=fill(rollout, value),
            seq_ids=seq_ids,
        )
        return loss, grad_of(loss, lp), finalize_metrics(m)

    loss0, g0, m0 = run(0.0)
    for value in (math.nan, math.inf, -math.inf):
        loss, g, m = run(value)
        assert torch.equal(loss, loss0) and torch.equal(g, g0), value
        assert m == m0, value


def _masked_nan_samples(field: str) -> list:
    from fnppo.core.batching.sample import Sample

    good = [
        Sample.from_lists(
            [1, 2],
            [3, 4, 5],
            advantages=[0.5, -0.5, 1.0],
            old_logprobs=[-1.0, -2.0, -1.5],
            rollout_logprobs=[-1.1, -2.0, -1.4],
            ref_logprobs=[-1.0, -1.0, -1.0],
        )
        for _ in range(2)
    ]
    values = {
        "advantages": [0.5, 1.0, math.nan],
        "old_logprobs": [-1.0, -2.0, math.nan],
        "rollout_logprobs": [-1.0, -2.0, math.nan],
        "ref_logprobs": [-1.0, -2.0, math.inf],
    }
    lists = {name: [0.5, 1.0, 0.0] if name == "advantages" else [-1.0, -2.0, -1.0] for name in values}
    lists[field] = values[field]
    bad = Sample.from_lists([1], [6, 7, 8], response_mask=[1.0, 1.0, 0.0], **lists)  # the NaN is masked out
    return [*good, bad]


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("field", ["advantages", "old_logprobs", "rollout_logprobs", "ref_logprobs"])
def test_nan_at_a_masked_response_position_is_refused_by_collate(layout, field):
    # documented refusal (docs/errors.md): a Sample's per-token values are finite at every response
    # position, response_mask 0 included; the error names the sample and the field
    from fnppo.core.batching.collate import collate_microbatch

    with raises_message("collate_microbatch", f"samples[2].{field}", "finite values", "f32[3] with 1 NaN/inf"):
        collate_microbatch(_masked_nan_samples(field), layout=layout)


def _train_step_masked_nan() -> dict:
    """train_step on one rank with a NaN advantage at a masked-out response position, for each
    policy loss and layout: the error (type, message) of each call; were the parameters untouched."""
    import fnppo
    from fnppo.megatron.unwrap import unwrap_model
    from fnppo.testing import tiny_model_config

    cfg = tiny_model_config(num_layers=1, vocab_size=16, max_seq_len=16)
    ddp = fnppo.wrap_ddp(fnppo.build_gpt(cfg))
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-2))
    before = [p.detach().clone() for p in unwrap_model(ddp[0]).parameters()]
    out: dict = {}
    for name in ("ppo", "gspo", "cispo"):
        for layout in ("packed", "padded"):
            step = fnppo.StepConfig(layout=layout, loss=from_flat(policy_loss=name))
            try:
                fnppo.train_step(state, _masked_nan_samples("advantages"), step)
                out[(name, layout)] = ("no error", "")
            except Exception as err:  # noqa: BLE001 - reported to the test
                out[(name, layout)] = (type(err).__name__, str(err))
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, unwrap_model(ddp[0]).parameters(), strict=True))
    return out


def test_train_step_refuses_nan_at_a_masked_position_for_every_loss_and_layout():
    from fnppo.testing import run_ranks

    (out,) = run_ranks(_train_step_masked_nan, 1)
    assert out.pop("untouched")
    assert len(out) == 6
    for key, (kind, msg) in out.items():
        assert kind == "InputError", (key, kind, msg)
        check_message(
            InputError(msg), InputError, "train_step", "batch[2].advantages", "finite values", "f32[3] with 1 NaN/inf"
        )


# =============================================================================================
# Empty masks, garbage at masked-out positions, no in-place changes
# =============================================================================================
@pytest.mark.parametrize("cls", BUILTIN, **IDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_mask_gives_exact_zero(cls, mode):
    lp0, old, adv, _, ent, ref, rollout = random_batch(1, 2, 3)
    cfg = parts_for(cls, mode, entropy_coef=0.1, kl_coef=0.1, tis_cap=2.0)
    for normalizer in (None, 0.0, 5.0):
        lp, ent_l = leaf(lp0), leaf(ent)
        loss, m = ppo_loss(
            lp,
            old,
            adv,
            torch.zeros(2, 3),
            cfg,
            entropy=ent_l,
            ref_logprobs=ref,
            rollout_logprobs=rollout,
            normalizer=normalizer,
        )
        assert loss.item() == 0.0
        g = torch.autograd.grad(loss, [lp, ent_l])
        for x in g:
            assert torch.equal(x, torch.zeros_like(x))
        assert all(v == 0.0 for v in finalize_metrics(m).values())


@pytest.mark.parametrize("cls", BUILTIN, **IDS)
def test_garbage_at_masked_positions_is_ignored(cls):
    lp0, old, adv, mask, ent, ref, rollout = random_batch(2, 3, 4)
    mask[0, 0] = 0.0
    cfg = parts_for(cls, "seq-mean-token-mean", entropy_coef=0.1, kl_coef=0.1, tis_cap=2.0, tis_level="sequence")
    kw = dict(generator=torch.Generator().manual_seed(0))
    lp = leaf(lp0)
    clean, _ = ppo_loss(lp, old, adv, mask, cfg, entropy=ent, ref_logprobs=ref, rollout_logprobs=rollout, **kw)
    g_clean = grad_of(clean, lp)

    def dirty(x, v):
        return torch.where(mask == 0, torch.full_like(x, v), x)

    lp2 = leaf(dirty(lp0, -math.inf))
    kw = dict(generator=torch.Generator().manual_seed(0))
    loss, m = ppo_loss(
        lp2,
        dirty(old, math.nan),
        dirty(adv, math.inf),
        mask,
        cfg,
        entropy=dirty(ent, math.nan),
        ref_logprobs=dirty(ref, math.inf),
        rollout_logprobs=dirty(rollout, math.nan),
        **kw,
    )
    torch.testing.assert_close(loss, clean)
    torch.testing.assert_close(grad_of(loss, lp2), g_clean)
    assert all(math.isfinite(v) for v in finalize_metrics(m).values())


EXTREME = (80.0, -80.0, 100.0, -100.0, 1e4, -1e4)  # log-ratios; exp overflows fp32 beyond 88.7, fp64 beyond 709.8


@pytest.mark.parametrize("cls", BUILTIN, **IDS)
def test_extreme_log_ratios_give_no_nan_gradient(cls):
    """One token of log-ratio +-80, +-100, +-1e4 (``log_ratio_clamp`` raised to 2e4, as prime-rl's inputs
    need), advantage 1, -1 or 0, beside an ordinary sequence, in fp32 and fp64. A masked or clipped
    branch never leaks an overflow into the gradient (``torch.where`` keeps the gradient of an unselected
    inf branch as ``0 * inf = NaN``): a finite loss has a finite gradient; the loss is finite wherever the
    float64 reference is (in fp32: and fits fp32), and equals it, with its gradient, where both are finite.
    A loss whose objective itself overflows (e.g. GSPO's ``-A s`` with ``A < 0``) may be inf there, or be
    refused by name while checking is on; never NaN with a finite loss."""
    from fnppo.core.typing import typechecking

    loss_fn = example(cls)
    cfg = config_of(loss_fn, clamp=2e4)
    for dtype, d, a in itertools.product((torch.float32, torch.float64), EXTREME, (1.0, -1.0, 0.0)):
        old64 = torch.tensor([[-0.1 - max(d, 0.0)], [-0.7], [-1.9]], dtype=torch.float64)
        lp64 = old64 + torch.tensor([[d], [0.05], [-0.02]], dtype=torch.float64)
        adv64, mask = torch.tensor([[a], [0.5], [-0.8]], dtype=torch.float64), torch.ones(3, 1, dtype=dtype)
        lp, old, adv = leaf(lp64.to(dtype)), old64.to(dtype), adv64.to(dtype)
        kw = dict(rollout_logprobs=old, generator=torch.Generator().manual_seed(0))
        lp_r = leaf(lp64)
        ref = ref_ppo_loss(lp_r, old64, adv64, mask.double(), cfg, rollout=old64)
        ref_grad = grad_of(ref, lp_r) if torch.isfinite(ref) and ref.requires_grad else None
        case = f"{cls.__name__} {dtype} log-ratio {d:g} A {a:g}: reference {ref.item():.6g}"
        fits = bool(torch.isfinite(ref)) and abs(ref.item()) < torch.finfo(dtype).max / 1e3
        try:
            loss, _ = ppo_loss(lp, old, adv, mask, cfg, **kw)
        except InputError as e:  # the per-token loss check: only an objective that overflows in fact
            assert "policy loss" in str(e) and not fits, f"{case}: {e}"
            with typechecking(False):
                loss, _ = ppo_loss(lp, old, adv, mask, cfg, **kw)
        grad = grad_of(loss, lp)
        if torch.isfinite(loss):
            assert torch.isfinite(grad).all(), f"{case}: finite loss {loss.item()} with gradient {grad.tolist()}"
        if fits:
            assert torch.isfinite(loss), f"{case}: loss {loss.item()}"
            tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(loss.double(), ref, **tol, msg=case)
            if ref_grad is not None and torch.isfinite(ref_grad).all():
                torch.testing.assert_close(grad.double(), ref_grad, **tol, msg=f"{case}: gradient")


@pytest.mark.parametrize("cls", BUILTIN, **IDS)
def test_a_loss_reading_probabilities_refuses_log_probs_above_zero(cls):
    """IPO in bypass mode accepted rollout log-probs above 0 (a probability above 1): every loss that
    reads exp(old) as a probability (DPPO, IPO, KPop; reads_probabilities) refuses them where the mask
    is 1, naming the argument that holds them (rollout_logprobs in bypass mode, else old_logprobs);
    a masked position is never read; the other losses take them."""
    from fnppo.core.losses.policy import bypass_only, reads_probabilities

    lp0, old, adv, mask, *_, rollout = random_batch(5, 2, 4)
    mask[:, 3] = 1.0
    loss = example(cls)
    for bypass in (True, False) if not bypass_only(loss) else (True,):
        cfg = LossConfig(policy=loss, bypass_old_logprobs=bypass)
        name = "rollout_logprobs" if bypass else "old_logprobs"
        above = {"old": old, "rollout": rollout}
        above[name.split("_")[0]] = torch.where(torch.arange(4) == 3, torch.full_like(old, 0.25), old.clamp(max=0.0))

        def run(m=mask, above=above):
            return ppo_loss(lp0, above["old"], adv, m, cfg, rollout_logprobs=above["rollout"])

        if reads_probabilities(loss):
            with raises_message("ppo_loss", name, "log-probs <= 0 where loss_mask is 1", "2 entries above 0"):
                run()
        else:
            run()
        masked = mask.clone()
        masked[:, 3] = 0.0
        run(masked)  # never read where the mask is 0


def test_inputs_not_modified():
    lp0, old, adv, mask, ent, ref, rollout = random_batch(3, 3, 4)
    lp, ent = leaf(lp0), leaf(ent)
    unchanged = unchanged_check(dict(lp=lp, old=old, adv=adv, mask=mask, ent=ent, ref=ref, rollout=rollout))
    for cls in BUILTIN:
        cfg = parts_for(cls, "seq-mean-token-mean", entropy_coef=0.1, kl_coef=0.1, tis_cap=2.0, tis_reject_low=0.1)
        loss, _ = ppo_loss(lp, old, adv, mask, cfg, entropy=ent, ref_logprobs=ref, rollout_logprobs=rollout)
        loss.backward()
    value_loss(lp, old, adv, mask, 0.2)[0].backward()
    compute_tis_weights(old, rollout, mask, cap=2.0)
    unchanged()


# =============================================================================================
# Validation
# =============================================================================================
def test_shape_mismatch_raises_shape_error():
    x = torch.zeros(2, 3)  # float64 in this module
    with raises_message("ppo_loss", "advantages", "Float[Tensor, 'batch seq']", "f64[2,4]", ShapeError):
        ppo_loss(x, x, torch.zeros(2, 4), x, cfg_for())
    with raises_message("ppo_loss", "ref_logprobs", "Float[Tensor, 'batch seq'] | None", "f64[3,3]", ShapeError):
        ppo_loss(x, x, x, x, cfg_for(), ref_logprobs=torch.zeros(3, 3))
    with raises_message("ppo_loss", "logprobs", "Float[Tensor, 'batch seq']", "f64[6]", ShapeError):
        ppo_loss(torch.zeros(6), torch.zeros(6), torch.zeros(6), torch.zeros(6), cfg_for())
    with raises_message("ppo_loss", "normalizer", "Shaped[Tensor, '']", "f64[2]", ShapeError):
        ppo_loss(x, x, x, x, cfg_for(), normalizer=torch.ones(2))
    with raises_message("ppo_loss", "seq_ids", "Integer[Tensor, 'batch seq'] | None", "f64[2,3]", ShapeError):
        ppo_loss(x, x, x, x, cfg_for(), seq_ids=torch.zeros(2, 3))  # not integer


def test_bad_values_raise_input_error():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    with raises_message("ppo_loss", "loss_mask", "a 0/1 mask", "f64[2,3] containing 2.0"):
        ppo_loss(x, x, x, torch.full((2, 3), 2.0), cfg_for())
    bad = x.clone()
    bad[1, 2] = math.nan
    for kw in ("advantages", "old_logprobs"):
        args = dict(logprobs=x, old_logprobs=x, advantages=x, loss_mask=mask)
        args[kw] = bad
        with raises_message("ppo_loss", kw, "finite values", "f64[2,3] with 1 NaN/inf entries"):
            ppo_loss(config=cfg_for(), **args)
    with raises_message("ppo_loss", "ref_logprobs", "finite values", "f64[2,3] with 1 NaN/inf entries"):
        ppo_loss(x, x, x, mask, cfg_for(kl_coef=0.1), ref_logprobs=bad)
    with raises_message("ppo_loss", "rollout_logprobs", "finite values", "f64[2,3] with 1 NaN/inf entries"):
        ppo_loss(x, x, x, mask, cfg_for(tis_cap=2.0), rollout_logprobs=bad)
    with raises_message("ppo_loss", "normalizer", "a finite number >= 0", "-1.0"):
        ppo_loss(x, x, x, mask, cfg_for(), normalizer=-1.0)
    with raises_message("ppo_loss", "normalizer", "a finite number >= 0", "f64[] = nan"):
        ppo_loss(x, x, x, mask, cfg_for(), normalizer=torch.tensor(math.nan))
    with raises_message(
        "ppo_loss", "seq_ids", "values in [-1, 6) and >= 0 wherever loss_mask is 1", "i64[2,3] with values in [6, 6]"
    ):
        ppo_loss(x, x, x, mask, cfg_for(), seq_ids=torch.full((2, 3), 6))
    with raises_message(
        "ppo_loss", "seq_ids", "values in [-1, 6) and >= 0 wherever loss_mask is 1", "i64[2,3] with values in [-1, -1]"
    ):
        ppo_loss(x, x, x, mask, cfg_for(), seq_ids=torch.full((2, 3), -1))  # masked-in token without sequence
    # NaN where the mask is 0 is fine
    ppo_loss(x, x, bad, torch.where(torch.isnan(bad), 0.0, 1.0), cfg_for())


def test_validation_skipped_when_typechecking_off():
    from fnppo.core.typing import typechecking

    x = torch.zeros(1, 2)
    with typechecking(False):
        loss, _ = ppo_loss(x, x, x, torch.ones(1, 2), cfg_for(), normalizer=-1.0)
    assert loss.item() == 0.0


def test_bad_custom_loss_output_raises():
    def test_bad_shape(x: PolicyInputs):  # named as in the message
        return x.logprobs.sum(), {}

    with raises_message("ppo_loss", "policy loss 'test_bad_shape'", "a per-token loss of shape (1, 2)", "f64[]"):
        ppo_loss(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), LossConfig(policy=test_bad_shape)
        )


def test_custom_loss_is_passed_as_a_callable():
    def scaled(x: PolicyInputs):
        return -3.0 * x.advantages * x.logprobs, {"my_metric": x.token_metric(x.advantages)}

    # no registry: a name from_flat does not know is refused, listing the built-ins
    with raises_message(
        "from_flat",
        "policy_loss",
        f"one of {sorted(POLICY_LOSSES)}",
        "'test_scaled_reinforce'",
    ):
        from_flat(policy_loss="test_scaled_reinforce")
    lp = leaf(t([-1.0, -2.0]))
    loss, m = ppo_loss(lp, lp.detach(), t([1.0, 3.0]), t([1.0, 0.0]), LossConfig(policy=scaled))
    assert loss.item() == pytest.approx(3.0)
    torch.testing.assert_close(grad_of(loss, lp), t([-3.0, 0.0]))
    fin = finalize_metrics(m)
    assert fin["my_metric"] == 1.0 and "pg_clipfrac" not in fin and "pg_clipfrac_lower" not in fin  # not 0.0
    assert "test_scaled_reinforce" not in POLICY_LOSSES and not hasattr(POLICY_LOSSES, "__setitem__")


# =============================================================================================
# Metrics helpers, value loss
# =============================================================================================
def test_merge_and_finalize_metrics():
    a = {"x": torch.tensor([2.0, 4.0]), "y": torch.tensor([1.0, 0.0])}
    b = {"x": torch.tensor([4.0, 2.0]), "z": torch.tensor([3.0, 1.0])}
    merged = merge_metrics([a, b])
    assert torch.equal(a["x"], torch.tensor([2.0, 4.0]))  # inputs untouched
    assert finalize_metrics(merged) == {"x": 1.0, "y": 0.0, "z": 3.0}
    assert finalize_metrics({}) == {}
    w = weighted_metric(t([1.0, math.nan, 3.0]), t([1.0, 0.0, 1.0]))
    assert w.dtype == torch.float32 and w.tolist() == [4.0, 2.0]


def test_value_loss_closed_form():
    # t0: V=1, R=2, V_clip = 0.8 + 0.1 = 0.9 -> max(1, 1.21) = 1.21 (clipped, no gradient)
    # t1: V=2, old=2.05, R=1: V_clip = V -> 1; t2 masked
    v = leaf(t([1.0, 2.0, 5.0]))
    old, ret, mask = t([0.8, 2.05, 0.0]), t([2.0, 1.0, 0.0]), t([1.0, 1.0, 0.0])
    loss, m = value_loss(v, old, ret, mask, 0.1)
    assert loss.item() == pytest.approx(0.5 * (1.21 + 1.0) / 2)
    torch.testing.assert_close(grad_of(loss, v), t([0.0, 0.5, 0.0]))
    fin = finalize_metrics(m)
    assert fin["vf_clipfrac"] == 0.5 and fin["vf_loss"] == pytest.approx(loss.item())
    loss_u, _ = value_loss(v, old, ret, mask, None)
    assert loss_u.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    loss_s, _ = value_loss(
        v, old, ret, mask, 0.1, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=2.0, normalizer=4
    )
    assert loss_s.item() == pytest.approx(0.5 * (1.21 + 1.0) / 2.0 / 4)
    with raises_message("value_loss", "clip_range", "a number >= 0 or None", "-1.0"):
        value_loss(v, old, ret, mask, -1.0)
    with raises_message("value_loss", "loss_agg_mode", "one of ['token-mean', 'seq-mean-token-sum'", "'nope'"):
        value_loss(v, old, ret, mask, 0.1, loss_agg_mode="nope")
    empty, _ = value_loss(v, old, ret, torch.zeros(1, 3), 0.1)
    assert empty.item() == 0.0 and torch.equal(grad_of(empty, v), torch.zeros(1, 3))


def test_value_clipfrac_counts_exactly_the_clipped_tokens():
    """vf_clipfrac is the fraction of tokens whose loss is the clipped term (float64 decision), and
    those are exactly the tokens without gradient; inside the clip range the loss is 1/2 (V - R)^2
    bit for bit (fp32 rounding of old_V + (V - old_V) never picks the clipped branch there)."""
    g = torch.Generator().manual_seed(3)
    n, clip = 4096, 0.2
    v0 = torch.randn(1, n, generator=g)
    far = torch.rand(1, n, generator=g) < 0.3  # |V - old_V| well outside the range, else well inside
    step = torch.where(far, 1.1 + torch.rand(1, n, generator=g), 0.95 * torch.rand(1, n, generator=g))
    sign = torch.where(torch.rand(1, n, generator=g) < 0.5, -1.0, 1.0)
    old = v0 - sign * clip * step
    ret = v0 + 0.5 * torch.randn(1, n, generator=g)
    mask = torch.ones(1, n)
    v = leaf(v0)
    loss, m = value_loss(v, old, ret, mask, clip)
    v64, old64, ret64 = v0.double(), old.double(), ret.double()
    d64 = v64 - old64
    l1 = (v64 - ret64) ** 2
    l2 = (old64 + d64.clamp(-clip, clip) - ret64) ** 2
    clipped = (d64.abs() > clip) & (l2 > l1)
    assert 0 < int(clipped.sum()) < int(far.sum())  # some clipped tokens, not all the far ones
    fin = finalize_metrics(m)
    assert fin["vf_clipfrac"] == float(clipped.double().mean())
    grad = grad_of(loss, v)
    assert torch.equal(grad == 0, clipped), "the clipped tokens and only they have zero gradient"
    inside = ~far
    loss_in, m_in = value_loss(v0[inside][None], old[inside][None], ret[inside][None], mask[inside][None], clip)
    unclipped, _ = value_loss(v0[inside][None], old[inside][None], ret[inside][None], mask[inside][None], None)
    assert finalize_metrics(m_in)["vf_clipfrac"] == 0.0 and torch.equal(loss_in, unclipped)


def test_value_explained_variance_is_exact_over_splits():
    """vf_explained_var = 1 - Var(R - V) / Var(R) over the valid tokens of the whole step (float64
    reference), the same from merged micro-batch pairs as from one call; 0.0 for constant returns."""
    g = torch.Generator().manual_seed(5)
    v, old = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    ret = 0.7 * v + 0.4 * torch.randn(4, 6, generator=g) + 1.5
    mask = (torch.rand(4, 6, generator=g) < 0.7).float()
    _, full = value_loss(v, old, ret, mask, 0.2)
    parts = [value_loss(v[i:j], old[i:j], ret[i:j], mask[i:j], 0.2)[1] for i, j in ((0, 1), (1, 4))]
    keep = mask.bool()
    r64, e64 = ret.double()[keep], (ret.double() - v.double())[keep]
    want = 1.0 - float(e64.var(unbiased=False) / r64.var(unbiased=False))
    assert 0.2 < want < 0.95
    for metrics in (full, merge_metrics(parts)):
        fin = finalize_metrics(metrics)
        assert fin["vf_explained_var"] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert fin["vpred_mean"] == pytest.approx(float(v.double()[keep].mean()), rel=1e-5)
    _, flat = value_loss(v, old, torch.full_like(v, 2.0), mask, 0.2)
    assert finalize_metrics(flat)["vf_explained_var"] == 0.0


def reference_value_loss(v, old, ret, mask, clip, mode, scale):
    """The documented value loss, one token at a time."""
    seqs = []
    for b in range(v.shape[0]):
        terms = []
        for j in range(v.shape[1]):
            if mask[b, j] == 0:
                continue
            l1 = (v[b, j] - ret[b, j]) ** 2
            if clip is None:
                terms.append(0.5 * l1)
                continue
            v_clip = old[b, j] + torch.clamp(v[b, j] - old[b, j], -clip, clip)
            terms.append(0.5 * torch.maximum(l1, (v_clip - ret[b, j]) ** 2))
        if terms:
            seqs.append(terms)
    if not seqs:
        return v.sum() * 0
    return aggregate(seqs, mode, scale)


@CHECKING
@DTYPES
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_matches_loop_reference(mode, dtype, checking):
    from fnppo.core.typing import typechecking

    g = torch.Generator().manual_seed(11)
    v0, old, ret = (torch.randn(3, 5, generator=g).to(dtype) for _ in range(3))
    mask = (torch.rand(3, 5, generator=g) < 0.6).to(dtype)
    mask[1] = 0  # an empty sequence
    scale = 3.0 if mode.endswith("norm") else None
    loss_tol, grad_tol = DTYPE_TOL[dtype]
    for clip in (0.3, None):
        v = leaf(v0)
        with typechecking(checking):
            loss, _ = value_loss(v, old, ret, mask, clip, loss_agg_mode=mode, loss_scale_factor=scale)
        v64 = leaf(v0.double())
        expected = reference_value_loss(v64, old.double(), ret.double(), mask.double(), clip, mode, scale)
        torch.testing.assert_close(loss.double(), expected, **loss_tol)
        got, want = grad_of(loss, v), grad_of(expected, v64)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, **grad_tol)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 1000), b=st.integers(1, 5), cut=st.integers(1, 4), mode=st.sampled_from(LOSS_AGG_MODES))
def test_value_loss_split_invariance(seed, b, cut, mode):
    g = torch.Generator().manual_seed(seed)
    v, old, ret = (torch.randn(b, 4, generator=g) for _ in range(3))
    mask = (torch.rand(b, 4, generator=g) < 0.6).double()
    scale = 3.0 if mode.endswith("norm") else None
    kw = dict(loss_agg_mode=mode, loss_scale_factor=scale)
    full, _ = value_loss(v, old, ret, mask, 0.3, **kw)
    cut = min(cut, b)
    n = loss_normalizer(mask[:cut], mode) + loss_normalizer(mask[cut:], mode)
    parts = [
        value_loss(v[i:j], old[i:j], ret[i:j], mask[i:j], 0.3, normalizer=n, **kw)[0]
        for i, j in ((0, cut), (cut, b))
        if j > i
    ]
    torch.testing.assert_close(sum(parts), full)


def test_value_loss_takes_a_config_like_ppo_loss():
    """``value_loss(..., ValueLossConfig(...))`` is the loose form's loss; loose aggregation keywords
    beside a config are refused (one way in per parameter)."""
    g = torch.Generator().manual_seed(3)
    v, old, ret = (torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(3, 5, generator=g) < 0.7).double()
    for clip, agg in ((0.1, Aggregation("seq-mean-token-sum-norm", 4.0)), (None, Aggregation("seq-mean-token-mean"))):
        want = value_loss(v, old, ret, mask, clip, loss_agg_mode=agg.mode, loss_scale_factor=agg.scale)
        got = value_loss(v, old, ret, mask, ValueLossConfig(clip_range=clip, agg=agg))
        assert got[0].item() == want[0].item() and got[1].keys() == want[1].keys()
    with raises_message("value_loss", "loss_agg_mode", "None when config is a ValueLossConfig", "'token-mean'"):
        value_loss(v, old, ret, mask, ValueLossConfig(), loss_agg_mode="token-mean")
