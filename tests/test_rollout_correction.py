"""Tests of the rollout-correction options of the loss: bypass mode, batch-normalized importance
weights, rejection on sequence statistics (fnppo.core.losses.rollout_correction, fnppo.core.losses).

Closed forms in float64, a plain-loop reference of the documented formulas, hypothesis split
invariance (micro-batches summing to the full batch with the global normalizer and the global mean
weight), empty masks, no input mutation, validation. ``train_step`` under DP=2 / TP=2 against an
independent single-process autograd reference is at the end of the file.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnppo.core.errors import InputError
from fnppo.core.losses import (
    KLPenalty,
    LossConfig,
    RolloutCorrection,
    Staleness,
    from_flat,
    gpg,
    kl_penalty,
    loss_normalizer,
    ppo_loss,
)
from fnppo.core.losses.rollout_correction import SEQ_REJECTION_CRITERIA
from fnppo.core.losses.rollout_weights import compute_tis_weights, tis_batch_stats
from fnppo.core.metrics import finalize_metrics
from tests.loss_helpers import (
    aggregate,
    check_split_invariance,
    flat_view,
    float64_default,  # noqa: F401  (autouse: float64 default dtype in this module)
    grad_of,
    leaf,
    log_hitting,
    next_down,
    next_up,
    random_batch,
    t,
    unchanged_check,
)
from tests.loss_reference import Rows, policy_terms, ref_ppo_loss
from tests.messages import raises_message

LN = math.log


EXACT = dict(rtol=1e-12, atol=1e-12)


# =============================================================================================
# Config
# =============================================================================================
@pytest.mark.parametrize(
    "kw, arg",
    [
        (dict(bypass_old_logprobs="yes"), "bypass_old_logprobs"),
        (dict(tis_batch_normalize=1, tis_cap=2.0), "tis_batch_normalize"),
        (dict(reject_seq_k2=0.0), "reject_seq_k2"),
        (dict(reject_seq_k3=-1.0), "reject_seq_k3"),
        (dict(reject_seq_max_abs_log_ratio=math.nan), "reject_seq_max_abs_log_ratio"),
        (dict(reject_seq_mean_log_ratio=(0.5, -0.5)), "reject_seq_mean_log_ratio"),
        (dict(reject_seq_mean_log_ratio=(0.5,)), "reject_seq_mean_log_ratio"),
        (dict(reject_seq_mean_log_ratio=(None, 0.5)), "reject_seq_mean_log_ratio"),
        (dict(bypass_old_logprobs=True, tis_cap=2.0), "tis_cap"),  # ppo: the ratio already is the IS weight
        (dict(bypass_old_logprobs=True, policy_loss="cispo", tis_cap=2.0), "tis_cap"),
        (dict(tis_batch_normalize=True), "tis_cap"),
        (
            dict(tis_batch_normalize=True, policy_loss="gpg", tis_cap=2.0, bypass_old_logprobs=True),
            "tis_batch_normalize",
        ),
    ],
)
def test_config_rejects_bad_values(kw, arg):
    with pytest.raises(InputError, match=f"from_flat: argument '{arg}' expected"):
        from_flat(**kw)


# the same refusals, by the parts (fields named as the parts name them)
@pytest.mark.parametrize(
    "build, fn, arg",
    [
        (lambda: RolloutCorrection(tis_cap=2.0, batch_normalize=1), "RolloutCorrection", "batch_normalize"),
        (lambda: RolloutCorrection(reject_seq_k2=0.0), "RolloutCorrection", "reject_seq_k2"),
        (
            lambda: RolloutCorrection(reject_seq_mean_log_ratio=(0.5, -0.5)),
            "RolloutCorrection",
            "reject_seq_mean_log_ratio",
        ),
        (lambda: RolloutCorrection(batch_normalize=True), "RolloutCorrection", "tis_cap"),
        (lambda: RolloutCorrection(), "RolloutCorrection", "tis_cap"),  # corrects nothing: use correction=None
        (lambda: LossConfig(bypass_old_logprobs="yes"), "LossConfig", "bypass_old_logprobs"),
        (
            lambda: LossConfig(bypass_old_logprobs=True, correction=RolloutCorrection(tis_cap=2.0)),
            "LossConfig",
            "correction.tis_cap",
        ),
        (
            lambda: LossConfig(
                policy=gpg(), bypass_old_logprobs=True, correction=RolloutCorrection(tis_cap=2.0, batch_normalize=True)
            ),
            "LossConfig",
            "correction.batch_normalize",
        ),
    ],
)
def test_parts_reject_bad_values(build, fn, arg):
    with pytest.raises(InputError, match=f"{fn}: argument '{arg}' expected"):
        build()


def test_config_accepts_valid_combinations():
    assert from_flat(bypass_old_logprobs=True, policy_loss="gpg", tis_cap=2.0).correction is not None
    assert from_flat(bypass_old_logprobs=True, tis_reject_high=2.0).correction is not None  # ratio loss + rejection
    cfg = from_flat(reject_seq_mean_log_ratio=[-0.5, 0.25])
    assert cfg.correction.reject_seq_mean_log_ratio == (-0.5, 0.25) and cfg.needs_rollout_logprobs
    hash(cfg)  # frozen and hashable (a list became a tuple)
    assert RolloutCorrection(reject_seq_mean_log_ratio=[-0.5, 0.25]) == cfg.correction
    for name in SEQ_REJECTION_CRITERIA:
        value = (-1.0, 1.0) if name == "reject_seq_mean_log_ratio" else 0.5
        assert from_flat(**{name: value}).correction is not None
    assert from_flat().correction is None and from_flat(bypass_old_logprobs=True).correction is None
    assert not from_flat().needs_rollout_logprobs and from_flat(bypass_old_logprobs=True).needs_rollout_logprobs
    assert not RolloutCorrection(tis_cap=2.0).sequence_level
    assert RolloutCorrection(tis_cap=2.0, level="sequence").sequence_level
    assert RolloutCorrection(tis_cap=2.0, reject_level="sequence").sequence_level


def test_custom_ratio_free_loss_may_take_tis_in_bypass_mode():
    def ratio_based(x):
        return -x.advantages * x.logprobs, {}

    def ratio_free(x):
        return -x.advantages * x.logprobs, {}

    ratio_free.uses_ratio = False
    LossConfig(policy=ratio_free, bypass_old_logprobs=True, correction=RolloutCorrection(tis_cap=2.0))
    with pytest.raises(InputError, match="tis_cap"):  # no uses_ratio attribute: ratio-based
        LossConfig(policy=ratio_based, bypass_old_logprobs=True, correction=RolloutCorrection(tis_cap=2.0))


# =============================================================================================
# Bypass mode: closed forms
# =============================================================================================
def test_bypass_ppo_uses_rollout_as_old():
    # rollout 0; pi/pi_rollout = 1.5 (A = 1: clipped at 1.2, no gradient) and 0.9 (A = -1, inside)
    lp = leaf(t([LN(1.5), LN(0.9)]))
    rollout, adv, mask = torch.zeros(1, 2), t([1.0, -1.0]), torch.ones(1, 2)
    cfg = from_flat(bypass_old_logprobs=True)
    for old in (None, t([math.nan, math.inf]), t([5.0, -5.0])):  # old log-probs are ignored
        loss, m = ppo_loss(lp, old, adv, mask, cfg, rollout_logprobs=rollout)
        torch.testing.assert_close(loss, torch.tensor((-1.2 + 0.9) / 2), **EXACT)
        torch.testing.assert_close(grad_of(loss, lp), t([0.0, 0.9 / 2]), **EXACT)
        fin = finalize_metrics(m)
        assert fin["pg_clipfrac"] == pytest.approx(0.5, abs=0)
        assert fin["ppo_kl"] == pytest.approx(-(LN(1.5) + LN(0.9)) / 2, rel=1e-6)  # fp32 metric
        assert fin["rollout_kl"] == pytest.approx(fin["ppo_kl"], rel=1e-6)  # rollout vs the current policy
    # the same numbers as an ordinary call with old = rollout
    plain, _ = ppo_loss(lp, rollout, adv, mask, from_flat())
    torch.testing.assert_close(plain, loss, **EXACT)


def test_bypass_reinforce_takes_tis_weights_of_the_current_policy():
    # w = min(exp(sg(logp) - logp_rollout), 2): (3 -> 2, 0.5, 1); l = -w A logp
    lp = leaf(t([LN(3.0), LN(0.5), 0.0]))
    adv = t([1.0, 2.0, 3.0])
    cfg = from_flat(policy_loss="gpg", bypass_old_logprobs=True, tis_cap=2.0)
    loss, m = ppo_loss(lp, None, adv, torch.ones(1, 3), cfg, rollout_logprobs=torch.zeros(1, 3))
    w = [2.0, 0.5, 1.0]
    expected = -sum(wi * a * x for wi, a, x in zip(w, [1.0, 2.0, 3.0], [LN(3.0), LN(0.5), 0.0])) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad_of(loss, lp), t([-2.0 / 3, -1.0 / 3, -1.0]), **EXACT)  # weights detached
    fin = finalize_metrics(m)
    assert fin["tis_weight"] == pytest.approx(3.5 / 3) and fin["tis_truncated_frac"] == pytest.approx(1 / 3)


def test_bypass_rejection_compares_the_current_policy_with_the_rollout():
    lp = leaf(t([LN(3.0), LN(0.5), 0.0]))
    cfg = from_flat(bypass_old_logprobs=True, tis_reject_high=2.5, clip_ratio_c=None)
    loss, m = ppo_loss(lp, None, t([1.0, 1.0, 1.0]), torch.ones(1, 3), cfg, rollout_logprobs=torch.zeros(1, 3))
    # token 0 (ratio 3) rejected; tokens 1, 2: ratio 0.5 (max(-0.5, -0.8): unclipped) and 1; denominator 3
    torch.testing.assert_close(loss, torch.tensor((-0.5 - 1.0) / 3), **EXACT)
    torch.testing.assert_close(grad_of(loss, lp), t([0.0, -0.5 / 3, -1.0 / 3]), **EXACT)
    assert finalize_metrics(m)["tis_rejected_frac"] == pytest.approx(1 / 3)


def test_bypass_and_missing_inputs():
    x = torch.zeros(1, 2)
    with pytest.raises(InputError, match="'rollout_logprobs' expected a tensor since bypass_old_logprobs"):
        ppo_loss(x, None, x, x, from_flat(bypass_old_logprobs=True))
    with pytest.raises(InputError, match="'old_logprobs' expected a tensor"):
        ppo_loss(x, None, x, x, from_flat(), rollout_logprobs=x)
    with pytest.raises(InputError, match="'rollout_logprobs' expected a tensor since rollout correction"):
        ppo_loss(x, x, x, x, from_flat(reject_seq_k3=0.1))


# =============================================================================================
# Rejection on sequence statistics: closed forms
# =============================================================================================
# d = old - rollout per token; row 1 has a masked token with d = 5 (must not count), row 3 is empty
D = t([0.1, -0.1, 0.0], [1.0, 0.0, 5.0], [-2.0, 0.0, 0.0], [9.0, 9.0, 9.0])
MASK = t([1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0])
STATS = {  # per valid sequence (rows 0, 1, 2), means over the valid tokens
    "reject_seq_k2": [0.005, 0.25, 2.0],
    "reject_seq_k3": [math.cosh(0.1) - 1.0, (math.e - 2.0) / 2, math.exp(-2.0) + 1.0],
    "reject_seq_mean_log_ratio": [0.0, 0.5, -2.0],
    "reject_seq_max_abs_log_ratio": [0.1, 1.0, 2.0],
}


def _rejected_rows(res) -> list[int]:
    return [b for b in range(3) if res.keep[b].sum() == 0]


@pytest.mark.parametrize("name", SEQ_REJECTION_CRITERIA)
def test_each_criterion_fires_exactly_above_its_closed_form(name):
    rollout = torch.zeros(4, 3) - 1.0
    old = rollout + D
    for i, value in enumerate(STATS[name]):
        for rel, fires in ((1 - 1e-9, True), (1 + 1e-9, False)):
            if name == "reject_seq_mean_log_ratio":
                lo, hi = (value - 1e-9, value + 1e-9)
                thr = (value + 1e-9, value + 1.0) if fires else (lo, hi)
            else:
                thr = value * rel
            res = compute_tis_weights(old, rollout, MASK, cap=None, **{name: thr})
            assert (i in _rejected_rows(res)) == fires, (name, i, thr, _rejected_rows(res))
            assert res.keep[3].sum() == 0 and bool(res.keep[i].sum() == 0) == fires
            fin = finalize_metrics(res.metrics)
            n_hit = len(_rejected_rows(res))
            assert fin[f"{name}_frac"] == pytest.approx(n_hit / 3) and fin["rollout_rejected_frac"] == pytest.approx(
                n_hit / 3
            )


def test_criteria_combine_with_or_and_report_each():
    rollout = torch.zeros(4, 3)
    res = compute_tis_weights(
        rollout + D,
        rollout,
        MASK,
        cap=None,
        reject_seq_k2=0.1,
        reject_seq_k3=1.0,
        reject_seq_mean_log_ratio=(-1.0, 0.4),
        reject_seq_max_abs_log_ratio=1.5,
    )
    # k2: rows 1, 2; k3: row 2; mean: rows 1, 2; max: row 2 -> rows 1 and 2 rejected
    torch.testing.assert_close(res.keep, MASK * t([1.0], [0.0], [0.0], [0.0]), **EXACT)
    torch.testing.assert_close(res.weights, res.keep, **EXACT)
    fin = finalize_metrics(res.metrics)
    assert fin["reject_seq_k2_frac"] == pytest.approx(2 / 3) and fin["reject_seq_k3_frac"] == pytest.approx(1 / 3)
    assert fin["reject_seq_mean_log_ratio_frac"] == pytest.approx(2 / 3)
    assert fin["reject_seq_max_abs_log_ratio_frac"] == pytest.approx(1 / 3)
    assert fin["rollout_rejected_frac"] == pytest.approx(2 / 3)
    assert fin["tis_rejected_frac"] == 0.0  # the weight bounds are reported apart


def test_log_ratio_is_clamped_in_the_statistics():
    rollout = torch.zeros(1, 2)
    old = t([30.0, 0.0])
    # clamp 20: k2 mean = (200 + 0) / 2 = 100; unclamped it would be 225
    keep = compute_tis_weights(old, rollout, torch.ones(1, 2), cap=None, reject_seq_k2=100.0 * (1 + 1e-12)).keep
    assert keep.sum() == 2
    keep = compute_tis_weights(old, rollout, torch.ones(1, 2), cap=None, reject_seq_k2=100.0 * (1 - 1e-12)).keep
    assert keep.sum() == 0
    keep = compute_tis_weights(
        old, rollout, torch.ones(1, 2), cap=None, reject_seq_max_abs_log_ratio=19.0, log_ratio_clamp=10.0
    ).keep
    assert keep.sum() == 2  # |d| clamped to 10


def test_packed_layout_matches_padded_for_the_criteria():
    rollout = torch.zeros(4, 3)
    kw = dict(cap=2.0, level="sequence", reject_seq_k2=0.1, reject_seq_max_abs_log_ratio=1.5, batch_normalize=True)
    padded = compute_tis_weights(rollout + D, rollout, MASK, **kw)
    # pack rows in the order (2, 0, 3, 1) with two padding tokens; sequence ids renamed
    order = [2, 0, 3, 1]
    ids = torch.cat([torch.full((3,), i) for i in range(4)] + [torch.tensor([-1, -1])])[None]

    def pack(x, fill=0.0):
        return torch.cat([x[order].reshape(-1), torch.full((2,), fill)])[None]

    packed = compute_tis_weights(pack(rollout + D, math.nan), pack(rollout, math.nan), pack(MASK), seq_ids=ids, **kw)
    torch.testing.assert_close(packed.weights[0, :-2].reshape(4, 3), padded.weights[order], **EXACT)
    torch.testing.assert_close(packed.keep[0, :-2].reshape(4, 3), padded.keep[order], **EXACT)
    fp, fq = finalize_metrics(padded.metrics), finalize_metrics(packed.metrics)
    assert fp.keys() == fq.keys() and all(fq[k] == pytest.approx(fp[k], rel=1e-6) for k in fp)


def test_rejected_sequences_leave_numerators_and_stay_in_the_denominator():
    # gpg with logp = -1 everywhere: pg per token = A; entropy 1; token-mean over 5 valid tokens
    rollout = torch.zeros(4, 3)
    lp = leaf(-torch.ones(4, 3))
    adv = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [1.0, 1.0, 1.0])
    cfg = from_flat(policy_loss="gpg", entropy_coeff=0.5, reject_seq_max_abs_log_ratio=1.5)
    loss, m = ppo_loss(lp, rollout + D, adv, MASK, cfg, rollout_logprobs=rollout, entropy=torch.ones(4, 3))
    # row 2 rejected; kept: row 0 (1, 2) and row 1 (4, 5) -> (12 - 0.5 * 4) / 5
    torch.testing.assert_close(loss, torch.tensor((12.0 - 0.5 * 4) / 5), **EXACT)
    torch.testing.assert_close(grad_of(loss, lp), -adv * MASK * t([1.0], [1.0], [0.0], [0.0]) / 5, **EXACT)
    assert finalize_metrics(m)["rollout_rejected_frac"] == pytest.approx(1 / 3)
    assert loss_normalizer(MASK, cfg).item() == 5.0


# =============================================================================================
# Batch-normalized weights: closed forms
# =============================================================================================
def test_batch_normalized_token_weights_closed_form():
    old = t([LN(3.0), LN(0.5), 0.0, LN(4.0)])
    rollout, mask = torch.zeros(1, 4), t([1.0, 1.0, 1.0, 0.0])
    res = compute_tis_weights(old, rollout, mask, cap=2.0, batch_normalize=True)
    torch.testing.assert_close(res.weights, t([2.0, 0.5, 1.0, 0.0]) * (3 / 3.5), **EXACT)
    fin = finalize_metrics(res.metrics)
    assert fin["tis_batch_mean"] == pytest.approx(3.5 / 3, rel=1e-7)
    assert fin["tis_weight"] == pytest.approx(1.0, rel=1e-7)  # normalized: mean 1 over kept units
    # rejected units leave the mean: token 0 (raw weight 3) rejected -> mean of (0.5, 1) = 0.75
    res = compute_tis_weights(old, rollout, mask, cap=2.0, reject_high=2.5, batch_normalize=True)
    torch.testing.assert_close(res.weights, t([0.0, 0.5 / 0.75, 1.0 / 0.75, 0.0]), **EXACT)
    assert finalize_metrics(res.metrics)["tis_batch_mean"] == pytest.approx(0.75, rel=1e-7)
    # a given global mean is used as is
    res = compute_tis_weights(old, rollout, mask, cap=2.0, batch_normalize=True, tis_mean=torch.tensor(1.25))
    torch.testing.assert_close(res.weights, t([2.0, 0.5, 1.0, 0.0]) / 1.25, **EXACT)
    # the pair of tis_batch_stats
    cfg = from_flat(tis_cap=2.0, tis_reject_high=2.5, tis_batch_normalize=True)
    torch.testing.assert_close(tis_batch_stats(old, rollout, mask, cfg), t(1.5, 2.0), **EXACT)


def test_batch_normalized_sequence_weights_closed_form():
    old = t([LN(3.0), LN(0.5), 0.0], [LN(4.0), 0.0, 0.0], [1.0, 1.0, 1.0])
    rollout, mask = torch.zeros(3, 3), t([1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    # sequence weights 1.5 and 4 -> 2 (capped): mean 1.75 over the two valid sequences
    res = compute_tis_weights(old, rollout, mask, cap=2.0, level="sequence", batch_normalize=True)
    torch.testing.assert_close(res.weights, t([1.5, 1.5, 0.0], [2.0, 2.0, 2.0], [0.0, 0.0, 0.0]) / 1.75, **EXACT)
    cfg = from_flat(tis_cap=2.0, tis_level="sequence", tis_batch_normalize=True)
    torch.testing.assert_close(tis_batch_stats(old, rollout, mask, cfg), t(3.5, 2.0), **EXACT)
    # a sequence rejected by a token-level bound still counts if one of its tokens is kept
    corr = dataclasses.replace(cfg.correction, reject_high=3.5, reject_level="token")  # token of weight 4 rejected
    cfg = dataclasses.replace(cfg, correction=corr)
    torch.testing.assert_close(tis_batch_stats(old, rollout, mask, cfg), t(3.5, 2.0), **EXACT)
    cfg = dataclasses.replace(cfg, correction=dataclasses.replace(corr, reject_level="sequence"))  # sequence rejected
    torch.testing.assert_close(tis_batch_stats(old, rollout, mask, cfg), t(1.5, 1.0), **EXACT)


def test_batch_normalized_weights_in_ppo_loss():
    # gpg, logp = -1: pg per token = A; weights (2, 0.5, 1) / (3.5 / 3)
    lp = leaf(-torch.ones(1, 3))
    old, rollout, adv = t([LN(3.0), LN(0.5), 0.0]), torch.zeros(1, 3), t([1.0, 2.0, 3.0])
    cfg = from_flat(policy_loss="gpg", tis_cap=2.0, tis_batch_normalize=True)
    loss, m = ppo_loss(lp, old, adv, torch.ones(1, 3), cfg, rollout_logprobs=rollout)
    torch.testing.assert_close(loss, torch.tensor((2.0 + 1.0 + 3.0) / 3.5), **EXACT)
    loss2, _ = ppo_loss(lp, old, adv, torch.ones(1, 3), cfg, rollout_logprobs=rollout, tis_mean=2.0)
    torch.testing.assert_close(loss2, torch.tensor((2.0 + 1.0 + 3.0) / 3 / 2.0), **EXACT)
    assert finalize_metrics(m)["tis_batch_mean"] == pytest.approx(3.5 / 3, rel=1e-7)
    # no kept unit anywhere (global mean 0): weights 0, loss 0, no NaN
    loss3, _ = ppo_loss(lp, old, adv, torch.zeros(1, 3), cfg, rollout_logprobs=rollout, tis_mean=0.0)
    assert loss3.item() == 0.0 and torch.equal(grad_of(loss3, lp), torch.zeros(1, 3))


def test_batch_normalization_errors():
    x, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(InputError, match="'tis_mean' expected None unless correction.batch_normalize=True"):
        ppo_loss(x, x, x, mask, from_flat(tis_cap=2.0), rollout_logprobs=x, tis_mean=1.0)
    cfg = from_flat(tis_cap=2.0, tis_batch_normalize=True)
    for bad in (-1.0, math.nan, torch.tensor(-0.5), torch.tensor(math.inf)):
        with pytest.raises(InputError, match="'tis_mean' expected a finite number >= 0"):
            ppo_loss(x, x, x, mask, cfg, rollout_logprobs=x, tis_mean=bad)
    with pytest.raises(
        InputError, match="compute_tis_weights: argument 'tis_mean' expected None since batch_normalize"
    ):
        compute_tis_weights(x, x, mask, cap=2.0, tis_mean=1.0)
    with pytest.raises(InputError, match="tis_batch_stats: argument 'config' expected a LossConfig without bypass"):
        tis_batch_stats(x, x, mask, from_flat(bypass_old_logprobs=True))
    with pytest.raises(InputError, match="compute_tis_weights: argument 'reject_seq_k3' expected a finite number > 0"):
        compute_tis_weights(x, x, mask, cap=None, reject_seq_k3=0.0)


# =============================================================================================
# Loop reference: every option on random inputs, loss and gradient at 1e-12
# =============================================================================================
def _clamp(x: float, c: float) -> float:
    return max(-c, min(c, x))


def _seq_rejected(ds: list[float], cfg) -> bool:
    n, c = len(ds), cfg.log_ratio_clamp
    ds = [_clamp(x, c) for x in ds]
    hits = []
    if cfg.reject_seq_k2 is not None:
        hits.append(sum(x * x / 2 for x in ds) / n > cfg.reject_seq_k2)
    if cfg.reject_seq_k3 is not None:
        hits.append(sum(math.exp(x) - 1 - x for x in ds) / n > cfg.reject_seq_k3)
    if cfg.reject_seq_mean_log_ratio is not None:
        lo, hi = cfg.reject_seq_mean_log_ratio
        hits.append(not lo <= sum(ds) / n <= hi)
    if cfg.reject_seq_max_abs_log_ratio is not None:
        hits.append(max(abs(x) for x in ds) > cfg.reject_seq_max_abs_log_ratio)
    return any(hits)


def reference_weights(train, rollout, mask, cfg, tis_mean=None):
    """Per token: the applied weight (0 if rejected) and whether it is kept, by loops over the formulas
    (``cfg``: the :func:`~tests.loss_helpers.flat_view` of the flat settings)."""
    c = cfg.log_ratio_clamp
    rl = cfg.tis_reject_level or cfg.tis_level
    weights, kept_units = {}, []
    for b in range(mask.shape[0]):
        idx = [j for j in range(mask.shape[1]) if mask[b, j] != 0]
        if not idx:
            continue
        d = {j: float(train[b, j] - rollout[b, j]) for j in idx}
        seq_raw = math.exp(_clamp(sum(d.values()), c))
        seq_rej = _seq_rejected(list(d.values()), cfg)
        seq_kept = False
        for j in idx:
            tok_raw = math.exp(_clamp(d[j], c))
            r = tok_raw if rl == "token" else seq_raw
            rejected = (
                seq_rej
                or (cfg.tis_reject_low is not None and r < cfg.tis_reject_low)
                or (cfg.tis_reject_high is not None and r > cfg.tis_reject_high)
            )
            raw = tok_raw if cfg.tis_level == "token" else seq_raw
            w = 1.0 if cfg.tis_cap is None else min(raw, cfg.tis_cap)
            weights[b, j] = None if rejected else w
            if not rejected and cfg.tis_level == "token":
                kept_units.append(w)
            seq_kept = seq_kept or not rejected
        if seq_kept and cfg.tis_level == "sequence":
            kept_units.append(1.0 if cfg.tis_cap is None else min(seq_raw, cfg.tis_cap))
    mean = 1.0
    if cfg.tis_batch_normalize:
        mean = tis_mean if tis_mean is not None else (sum(kept_units) / len(kept_units) if kept_units else 1.0)
    return {k: (0.0 if w is None else w / mean) for k, w in weights.items()}, {
        k: w is not None for k, w in weights.items()
    }


def reference_loss(lp, old, adv, mask, rollout, cfg, ent, ref, policy, tis_mean=None):
    """The loss with bypass, weights and rejection, token-mean or seq-mean-token-mean, as loops; the policy
    term is the policy loss's one reference (tests/loss_reference.py)."""
    base = rollout if cfg.bypass_old_logprobs else old
    train = lp.detach() if cfg.bypass_old_logprobs else old
    w, keep = reference_weights(train, rollout, mask, cfg, tis_mean) if cfg.tis_active else ({}, {})
    pg = policy_terms(policy, Rows(lp, base, adv, mask, cfg.log_ratio_clamp))
    seqs = []
    for b in range(lp.shape[0]):
        terms = []
        for j in [j for j in range(lp.shape[1]) if mask[b, j] != 0]:
            k = keep.get((b, j), True)
            dk = lp[b, j] - ref[b, j]
            term = pg[b, j] * w.get((b, j), 1.0) + (
                k * (-cfg.entropy_coeff * ent[b, j] + cfg.kl_coef * (torch.exp(-dk) - 1 + dk))
            )
            terms.append(term)
        if terms:
            seqs.append(terms)
    if not seqs:
        return lp.sum() * 0
    return aggregate(seqs, cfg.loss_agg_mode)


OPTIONS = {
    "bypass-ppo": dict(bypass_old_logprobs=True),
    "bypass-ppo-reject": dict(bypass_old_logprobs=True, tis_reject_low=0.7, reject_seq_k3=0.05),
    "bypass-gpg-tis": dict(policy_loss="gpg", bypass_old_logprobs=True, tis_cap=1.2, reject_seq_max_abs_log_ratio=0.6),
    "norm-token": dict(tis_cap=1.3, tis_batch_normalize=True, tis_reject_high=1.4),
    "norm-seq": dict(tis_cap=1.3, tis_level="sequence", tis_batch_normalize=True, reject_seq_k2=0.06),
    "norm-token-seq-reject": dict(
        tis_cap=1.3, tis_batch_normalize=True, tis_reject_low=0.5, tis_reject_level="sequence"
    ),
    "k2": dict(reject_seq_k2=0.04),
    "k3": dict(tis_cap=1.5, reject_seq_k3=0.04),
    "mean": dict(reject_seq_mean_log_ratio=(-0.15, 0.1)),
    "max": dict(policy_loss="gpg", tis_cap=1.5, reject_seq_max_abs_log_ratio=0.5),
    "all": dict(
        tis_cap=1.4,
        tis_level="sequence",
        tis_batch_normalize=True,
        tis_reject_high=3.0,
        reject_seq_k2=0.08,
        reject_seq_k3=0.08,
        reject_seq_mean_log_ratio=(-0.3, 0.3),
        reject_seq_max_abs_log_ratio=0.9,
    ),
}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_matches_loop_reference(name, mode):
    lp0, old, adv, mask, ent, ref, rollout = random_batch(zlib.crc32(f"{name}/{mode}".encode()) % 997, 6, 7)
    flat = dict(loss_agg_mode=mode, entropy_coeff=0.03, kl_coef=0.2, **OPTIONS[name])
    cfg = from_flat(flat)
    for tis_mean in (None, 0.8) if flat_view(**flat).tis_batch_normalize else (None,):
        lp, ent_l = leaf(lp0), leaf(ent)
        loss, m = ppo_loss(
            lp,
            None if cfg.bypass_old_logprobs else old,
            adv,
            mask,
            cfg,
            entropy=ent_l,
            ref_logprobs=ref,
            rollout_logprobs=rollout,
            tis_mean=tis_mean,
        )
        lp64, ent64 = leaf(lp0), leaf(ent)
        expected = reference_loss(lp64, old, adv, mask, rollout, flat_view(**flat), ent64, ref, cfg.policy, tis_mean)
        torch.testing.assert_close(loss, expected, **EXACT)
        for a, e in zip(torch.autograd.grad(loss, [lp, ent_l]), torch.autograd.grad(expected, [lp64, ent64])):
            torch.testing.assert_close(a, e, **EXACT)
    # the options did something here: some rejection or truncation happened, not everything
    fin = finalize_metrics(m)
    if any(k in OPTIONS[name] for k in ("tis_reject_low", "tis_reject_high", *SEQ_REJECTION_CRITERIA)):
        frac = max(fin.get("rollout_rejected_frac", 0.0), fin["tis_rejected_frac"])
        assert 0.0 < frac < 1.0, fin


# =============================================================================================
# Split invariance (hypothesis), empty masks, no mutation
# =============================================================================================
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 6),
    s=st.integers(1, 5),
    name=st.sampled_from(list(OPTIONS)),
    mode=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]),
    cuts=st.lists(st.integers(1, 5), max_size=4),
    p=st.sampled_from([0.0, 0.3, 0.9]),
)
def test_split_invariance(seed, b, s, name, mode, cuts, p):
    batch = random_batch(seed, b, s, p)
    _, old, _, mask, _, _, rollout = batch
    cfg = from_flat(loss_agg_mode=mode, entropy_coeff=0.01, kl_coef=0.1, **OPTIONS[name])

    def global_tis_mean(parts: list[tuple[int, int]]) -> dict:
        if not (cfg.correction is not None and cfg.correction.batch_normalize):
            return {}
        pair = sum(tis_batch_stats(old[i:j], rollout[i:j], mask[i:j], cfg) for i, j in parts)  # the parts' pairs
        return {"tis_mean": pair[0] / pair[1] if pair[1] > 0 else pair[0]}

    check_split_invariance(batch, cfg, cuts, part_kwargs=global_tis_mean)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_empty_mask_gives_exact_zero(name):
    lp0, old, adv, _, ent, ref, rollout = random_batch(1, 2, 3)
    cfg = from_flat(entropy_coeff=0.1, kl_coef=0.1, **OPTIONS[name])
    empty = torch.zeros(2, 3)
    for normalizer in (None, 0.0, 5.0):
        lp, ent_l = leaf(lp0), leaf(ent)
        loss, m = ppo_loss(
            lp, old, adv, empty, cfg, entropy=ent_l, ref_logprobs=ref, rollout_logprobs=rollout, normalizer=normalizer
        )
        assert loss.item() == 0.0
        for g in torch.autograd.grad(loss, [lp, ent_l]):
            assert torch.equal(g, torch.zeros_like(g))
        assert all(v == 0.0 for v in finalize_metrics(m).values())
    if cfg.correction is not None and not cfg.bypass_old_logprobs:
        assert torch.equal(tis_batch_stats(old, rollout, empty, cfg), torch.zeros(2))


def test_zero_length_rows_have_nothing_to_reject():
    x = torch.zeros(2, 0)
    res = compute_tis_weights(
        x, x, x, cap=2.0, reject_seq_max_abs_log_ratio=0.5, reject_seq_k3=0.1, batch_normalize=True
    )
    assert res.weights.shape == (2, 0) and all(v == 0.0 for v in finalize_metrics(res.metrics).values())


def test_inputs_not_modified():
    lp0, old, adv, mask, ent, ref, rollout = random_batch(3, 3, 4)
    lp, ent = leaf(lp0), leaf(ent)
    unchanged = unchanged_check(dict(lp=lp, old=old, adv=adv, mask=mask, ent=ent, ref=ref, rollout=rollout))
    for opts in OPTIONS.values():
        cfg = from_flat(entropy_coeff=0.1, kl_coef=0.1, **opts)
        loss, _ = ppo_loss(lp, old, adv, mask, cfg, entropy=ent, ref_logprobs=ref, rollout_logprobs=rollout)
        loss.backward()
        if not cfg.bypass_old_logprobs:
            tis_batch_stats(old, rollout, mask, cfg)
    compute_tis_weights(
        old, rollout, mask, cap=2.0, reject_seq_k2=0.01, reject_seq_max_abs_log_ratio=0.3, batch_normalize=True
    )
    unchanged()


# =============================================================================================
# One rule for the weight settings: compute_tis_weights refuses what from_flat and RolloutCorrection refuse
# =============================================================================================
# (arguments of compute_tis_weights, the argument named, expected ({p}: "tis_" in the config), received)
WEIGHT_RULE_CASES = {
    "low-above-high": (dict(reject_low=3.0, reject_high=1.0), "reject_high", "a number > {p}reject_low=3.0", "1.0"),
    "low-equals-high": (dict(reject_low=1.0, reject_high=1.0), "reject_high", "a number > {p}reject_low=1.0", "1.0"),
    "negative-low": (dict(reject_low=-0.5), "reject_low", "a number >= 0 or None", "-0.5"),
    "nan-low": (dict(reject_low=math.nan), "reject_low", "a number >= 0 or None", "nan"),
    "zero-high": (dict(reject_high=0.0), "reject_high", "a number > 0 or None", "0.0"),
    "inf-high": (dict(reject_high=math.inf), "reject_high", "a number > 0 or None", "inf"),
    "zero-cap": (dict(cap=0.0), "cap", "a number > 0 or None", "0.0"),
    "nan-cap": (dict(cap=math.nan), "cap", "a number > 0 or None", "nan"),
    "unknown-level": (dict(level="batch"), "level", "one of ['token', 'sequence']", "'batch'"),
    "unknown-reject-level": (
        dict(reject_level="word"),
        "reject_level",
        "one of ['token', 'sequence'] or None",
        "'word'",
    ),
    "zero-clamp": (dict(log_ratio_clamp=0.0), "log_ratio_clamp", "a number > 0", "0.0"),
    "negative-clamp": (dict(log_ratio_clamp=-1.0), "log_ratio_clamp", "a number > 0", "-1.0"),
}


@pytest.mark.parametrize("case", list(WEIGHT_RULE_CASES))
def test_compute_tis_weights_refuses_what_the_config_refuses(case):
    kw, arg, expected, received = WEIGHT_RULE_CASES[case]
    x = torch.zeros(2, 3)
    with raises_message("compute_tis_weights", arg, expected.format(p=""), received):
        compute_tis_weights(x, x, torch.ones(2, 3), **{"cap": None, **kw})
    in_config = {name if name == "log_ratio_clamp" else f"tis_{name}": value for name, value in kw.items()}
    config_arg = arg if arg == "log_ratio_clamp" else f"tis_{arg}"
    with raises_message("from_flat", config_arg, expected.format(p="tis_"), received):
        from_flat(**in_config)
    if arg == "log_ratio_clamp":  # a setting of the whole loss
        with raises_message("LossConfig", arg, expected, received):
            LossConfig(**kw)
        return
    part = {("tis_cap" if name == "cap" else name): value for name, value in {"cap": 2.0, **kw}.items()}
    with raises_message("RolloutCorrection", "tis_cap" if arg == "cap" else arg, expected.format(p=""), received):
        RolloutCorrection(**part)


def test_kl_penalty_refuses_a_clamp_that_is_not_positive():
    x = torch.zeros(3)
    for bad in (0.0, -1.0, math.nan):
        with raises_message("kl_penalty", "log_ratio_clamp", "a number > 0", repr(bad)):
            kl_penalty(x, x, "k3", log_ratio_clamp=bad)


# =============================================================================================
# Thresholds at equality: every bound is hit exactly in floating point
# =============================================================================================
# The documented rules: the applied weight is min(w, cap) and a weight equal to the cap is not
# counted as truncated; a unit is rejected when its weight lies outside the closed interval
# [reject_low, reject_high]; a reject_seq_* criterion fires strictly above its threshold (mean:
# strictly outside its closed interval). So a value exactly on a threshold is kept, and one float
# beyond it is not.
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_weights_of_exactly_one_sit_on_every_bound(level):
    # old == rollout: every weight is exp(0) = 1 exactly, at both levels
    _, old, _, mask, *_ = random_batch(11, 4, 6)
    mask[0, 0] = 1.0
    for kw in (
        dict(cap=1.0),
        dict(cap=None, reject_low=1.0),
        dict(cap=None, reject_high=1.0),
        dict(cap=1.0, reject_low=1.0, reject_high=2.0),
        dict(cap=1.0, reject_low=0.5, reject_high=1.0),
    ):
        res = compute_tis_weights(old, old.clone(), mask, level=level, **kw)
        assert torch.equal(res.keep, mask) and torch.equal(res.weights, mask), kw
        fin = finalize_metrics(res.metrics)
        assert fin["tis_rejected_frac"] == 0.0 and fin["tis_truncated_frac"] == 0.0, (kw, fin)
        assert fin["tis_weight"] == 1.0, kw
    # one float beyond: every valid unit rejected (the bounds really are applied)
    for kw in (dict(reject_low=next_up(1.0)), dict(reject_high=next_down(1.0))):
        res = compute_tis_weights(old, old.clone(), mask, cap=None, level=level, **kw)
        assert res.keep.sum() == 0 and finalize_metrics(res.metrics)["tis_rejected_frac"] == 1.0, kw


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_rejection_bound_of_one_leaves_ppo_loss_unchanged(level):
    # the failure mode of an exclusive bound: reject_low=1.0 on on-policy data would reject every token
    lp0, old, adv, mask, *_ = random_batch(12, 3, 5)
    lp = leaf(lp0)
    plain, _ = ppo_loss(lp, old, adv, mask, from_flat())
    g_plain = grad_of(plain, lp)
    for kw in (dict(tis_reject_low=1.0), dict(tis_reject_high=1.0), dict(tis_cap=1.0, tis_reject_low=1.0)):
        lp = leaf(lp0)
        loss, m = ppo_loss(lp, old, adv, mask, from_flat(tis_level=level, **kw), rollout_logprobs=old.clone())
        torch.testing.assert_close(loss, plain, rtol=0, atol=0)
        torch.testing.assert_close(grad_of(loss, lp), g_plain, rtol=0, atol=0)
        assert finalize_metrics(m)["tis_rejected_frac"] == 0.0, kw


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("w", [2.0, 0.5])
def test_weight_exactly_on_the_cap_and_the_rejection_bounds(level, w):
    # row 0: one valid token with log-weight x, exp(x) == w exactly (so the sequence weight is w too);
    # row 1: on-policy (weight 1)
    x = log_hitting(w)
    old = t([x, 0.0], [-1.0, -2.0])
    rollout = t([0.0, 0.0], [-1.0, -2.0])
    mask = t([1.0, 0.0], [1.0, 1.0])
    weights = [w, 1.0] if level == "sequence" else [w, 1.0, 1.0]  # per unit
    units = len(weights)

    def run(**kw):
        res = compute_tis_weights(old, rollout, mask, level=level, **{"cap": None, **kw})
        return res, finalize_metrics(res.metrics)

    # exactly at the cap: applied weight w, not truncated; just below: truncated to the cap
    for cap in (w, next_down(w)):
        res, fin = run(cap=cap)
        assert res.weights[0, 0].item() == min(w, cap)
        assert fin["tis_truncated_frac"] == pytest.approx(sum(v > cap for v in weights) / units, abs=0), cap
    # the rejection interval is closed: [w, .] and [., w] keep row 0; one float inside it rejects row 0
    low, high = min(w, 1.0), max(w, 1.0)
    for kw, rejected in (
        (dict(reject_low=low, reject_high=high), False),
        (dict(reject_low=w) if w == low else dict(reject_high=w), False),
        (dict(reject_low=next_up(w)) if w == low else dict(reject_high=next_down(w)), True),
    ):
        res, fin = run(**kw)
        assert bool(res.keep[0, 0] == 0) == rejected, kw
        assert torch.equal(res.keep[1], mask[1]), kw  # the on-policy row is always kept
        assert fin["tis_rejected_frac"] == pytest.approx(rejected / units, abs=0), kw


# d = old - rollout = 0.5 on every valid token of row 0 (exact: -0.5 - (-1.0)); rows 1, 2: other values
D_EXACT = t([0.5, 0.5, 0.5, 0.0], [0.25, -0.25, 0.0, 0.0], [-0.5, 0.0, 0.0, 0.0])
MASK_EXACT = t([1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0])


def _seq_thresholds():
    """Per criterion: the threshold equal to row 0's statistic (by the documented formula, in float64),
    and the same statistic one float lower (where row 0 must be rejected)."""
    d = 0.5
    k3 = (torch.exp(torch.tensor(d)) - 1.0 - d).item()  # the mean of equal terms is that term
    return {
        "reject_seq_k2": (d * d / 2, next_down(d * d / 2)),  # 0.125, exact
        "reject_seq_k3": (k3, next_down(k3)),
        "reject_seq_max_abs_log_ratio": (d, next_down(d)),
        "reject_seq_mean_log_ratio": ((-1.0, d), (-1.0, next_down(d))),  # row 0's mean is exactly 0.5
    }


@pytest.mark.parametrize("name", SEQ_REJECTION_CRITERIA)
def test_sequence_statistic_exactly_at_its_threshold_keeps_the_sequence(name):
    rollout = torch.full((3, 4), -1.0)
    old = rollout + D_EXACT
    assert torch.equal(old - rollout, D_EXACT)  # d exact in float64
    at, beyond = _seq_thresholds()[name]
    if name == "reject_seq_k3":  # the statistic of row 0 is the mean of three equal terms: check it is exact
        term = torch.exp(torch.tensor(0.5)) - 1.0 - 0.5
        assert ((term + term + term) / 3).item() == at
    for thr, row0_rejected in ((at, False), (beyond, True)):
        res = compute_tis_weights(old, rollout, MASK_EXACT, cap=None, **{name: thr})
        assert bool(res.keep[0].sum() == 0) == row0_rejected, (thr, res.keep)
    # the lower bound of the mean, hit exactly by row 2 (mean -0.5)
    if name == "reject_seq_mean_log_ratio":
        for bounds, row2_rejected in (((-0.5, 1.0), False), ((next_up(-0.5), 1.0), True)):
            res = compute_tis_weights(old, rollout, MASK_EXACT, cap=None, reject_seq_mean_log_ratio=bounds)
            assert bool(res.keep[2].sum() == 0) == row2_rejected, bounds
            assert res.keep[0].sum() == 3  # row 0's mean 0.5 is inside


# =============================================================================================
# train_step under DP=2 and TP=2 against an independent single-process reference
# =============================================================================================
# Reference: one process, one micro-batch of all samples, forward_logits -> logprob_and_entropy ->
# ppo_loss (the local normalizer and the local mean weight are then the global ones), autograd.
# train_step runs with SGD (lr = STEP_LR, no clipping): its first update is -lr * gradient, so
# (w0 - w1) / lr is the gradient train_step applied, gathered over TP shards.
STEP_LR = 1000.0
STEP_REL = 1e-6
STEP_CASES = {
    "bypass": dict(bypass_old_logprobs=True, clip_ratio_high=0.28, tis_reject_low=0.92),
    "bypass-gpg-tis": dict(policy_loss="gpg", bypass_old_logprobs=True, tis_cap=1.1),
    "norm-token": dict(tis_cap=1.1, tis_batch_normalize=True),
    "norm-seq": dict(tis_cap=1.2, tis_level="sequence", tis_batch_normalize=True, loss_agg_mode="seq-mean-token-mean"),
    "reject-k3": dict(tis_cap=1.1, tis_batch_normalize=True, reject_seq_k3=0.006),
    # M2PO: one cutoff over both micro-batches and both DP ranks (a per-micro-batch one would differ)
    "m2po": dict(m2_threshold=0.006),
    "bypass-ipo": dict(policy_loss="ipo", bypass_old_logprobs=True, ipo_threshold=0.0015, ipo_kl_coef=0.5),
}
STEP_METRICS = (
    "loss",
    "pg_loss",
    "entropy",
    "kl_loss",
    "tis_weight",
    "tis_batch_mean",
    "rollout_rejected_frac",
    "reject_seq_k3_frac",
    "m2po_masked_frac",
    "pg_clipfrac",
    "tis_rejected_frac",
    "rollout_kl",
)


def _step_loss_cfg(name: str) -> LossConfig:
    return from_flat(entropy_coeff=0.01, kl_coef=0.05, **STEP_CASES[name])


def _step_chunks():
    import fnppo
    from fnppo.testing import tiny_model_config

    cfg = tiny_model_config(tie_embeddings=True)
    chunks = fnppo.build_gpt(cfg)
    fnppo.models.layout_invariant_init(chunks, seed=3)
    return chunks


def _case_samples(samples, name: str):
    return [dataclasses.replace(s, old_logprobs=None) for s in samples] if name.startswith("bypass") else samples


def _step_reference() -> dict:
    """Samples with log-probs near the model's, then every case by plain autograd on one process."""
    import fnppo
    from fnppo.testing import synthetic_samples

    torch.set_default_dtype(torch.float32)
    chunks = _step_chunks()
    base = synthetic_samples(8, seed=11, with_rollout=True)
    lps, _ = fnppo.compute_logprobs(fnppo.wrap_ddp(chunks, use_distributed_optimizer=False), base)
    g = torch.Generator().manual_seed(5)
    samples = [
        dataclasses.replace(
            s,
            old_logprobs=lp + 0.05 * torch.randn(lp.shape, generator=g),
            rollout_logprobs=lp + 0.1 * torch.randn(lp.shape, generator=g),
            ref_logprobs=lp + 0.05 * torch.randn(lp.shape, generator=g),
        )
        for s, lp in zip(base, lps, strict=True)
    ]
    core = fnppo.megatron.unwrap.unwrap_model(chunks[0])
    params = dict(core.named_parameters())
    out = {"samples": samples, "cases": {}}
    for name in STEP_CASES:
        cfg = _step_loss_cfg(name)
        mb = fnppo.collate_microbatch(_case_samples(samples, name), layout="packed", pad_to_multiple_of=1)
        lp, ent = fnppo.logprob_and_entropy(fnppo.forward_logits(core, mb), mb.labels, with_entropy=True)
        loss, metrics = ppo_loss(
            lp,
            None if cfg.bypass_old_logprobs else mb.old_logprobs,
            mb.advantages,
            mb.loss_mask,
            cfg,
            entropy=ent,
            ref_logprobs=mb.ref_logprobs,
            rollout_logprobs=mb.rollout_logprobs,
            seq_ids=mb.seq_ids,
        )
        grads = torch.autograd.grad(loss, list(params.values()))
        out["cases"][name] = {"grads": dict(zip(params, grads)), "metrics": finalize_metrics(metrics)}
    return out


def _step_layout(samples, split: dict) -> dict:
    import fnppo

    torch.set_default_dtype(torch.float32)
    layout = fnppo.parallel.current_layout()
    seen_old: list[bool] = []

    def loss_fn(lp, old, *args, rollout_logprobs, **kwargs):  # a user loss stage sees old = rollout in bypass mode
        seen_old.append(old is not None and torch.equal(old, rollout_logprobs))
        return ppo_loss(lp, old, *args, rollout_logprobs=rollout_logprobs, **kwargs)

    out = {}
    for name in STEP_CASES:
        ddp = fnppo.wrap_ddp(_step_chunks(), use_distributed_optimizer=False)
        state = fnppo.TrainState(
            model=ddp, optimizer=fnppo.build_optimizer(ddp, optimizer="sgd", lr=STEP_LR, clip_grad=0.0)
        )
        w0 = fnppo.models.gather_full_weights(state.model)
        mine = fnppo.shard_for_data_parallel(_case_samples(samples, name), layout)
        step_cfg = fnppo.StepConfig(loss=_step_loss_cfg(name), fns=fnppo.StepFns(loss=loss_fn), **split)
        seen_old.clear()
        state, metrics = fnppo.train_step(state, mine, step_cfg)
        w1 = fnppo.models.gather_full_weights(state.model)
        out[name] = {
            "metrics": metrics,
            "grads": {k: (w0[k] - w1[k]) / STEP_LR for k in w0},
            "old_is_rollout": list(seen_old),
        }
    return out if layout.rank == 0 else {}


@pytest.fixture(scope="module")
def step_reference():
    from fnppo.testing import run_ranks

    return run_ranks(_step_reference, 1)[0]


def test_step_reference_cases_are_not_vacuous(step_reference):
    cases = step_reference["cases"]
    for name, case in cases.items():
        m = case["metrics"]
        assert max(float(g.abs().max()) for g in case["grads"].values()) > 1e-3, name
        if "tis_cap" in STEP_CASES[name]:
            assert 0.0 < m["tis_truncated_frac"] < 1.0, (name, m)
        if STEP_CASES[name].get("tis_batch_normalize"):
            assert abs(m["tis_batch_mean"] - 1.0) > 1e-3 and m["tis_weight"] == pytest.approx(1.0, abs=0.2), (name, m)
    assert 0.0 < cases["bypass"]["metrics"]["tis_rejected_frac"] < 1.0
    assert 0.0 < cases["reject-k3"]["metrics"]["rollout_rejected_frac"] < 1.0
    assert 0.0 < cases["m2po"]["metrics"]["m2po_masked_frac"] < 1.0
    assert 0.0 < cases["bypass-ipo"]["metrics"]["pg_clipfrac"] < 1.0
    # bypass: the ratio is against the rollout log-probs, not the old ones
    assert cases["bypass"]["metrics"]["ppo_kl"] == pytest.approx(cases["bypass"]["metrics"]["rollout_kl"], rel=1e-5)


@pytest.mark.parametrize(
    "world,tp,split", [(2, 1, {"num_microbatches": 2}), (2, 2, {"max_tokens_per_microbatch": 24})], ids=["dp2", "tp2"]
)
def test_train_step_matches_single_process_reference(step_reference, world, tp, split):
    from fnppo.testing import run_ranks

    got = run_ranks(_step_layout, world, step_reference["samples"], split, tp=tp)[0]
    worst = 0.0
    for name, ref in step_reference["cases"].items():
        mine = got[name]
        assert mine["metrics"]["skipped"] == 0.0, name
        bypass = STEP_CASES[name].get("bypass_old_logprobs", False)
        assert mine["metrics"]["offpolicy/old_logprobs_read"] == (0.0 if bypass else 1.0), name  # said, not silent
        assert mine["old_is_rollout"] and all(x == bypass for x in mine["old_is_rollout"]), (
            name,
            mine["old_is_rollout"],
        )
        for key in STEP_METRICS:
            if key in ref["metrics"]:
                r, g = ref["metrics"][key], mine["metrics"][key]
                assert g == pytest.approx(r, rel=STEP_REL, abs=1e-7), f"{name}: metric {key} {g} vs {r}"
        assert ref["grads"].keys() == mine["grads"].keys()
        for k, r in ref["grads"].items():
            err = float((mine["grads"][k] - r).abs().max() / r.abs().max().clamp_min(1e-12))
            worst = max(worst, err)
            assert err <= STEP_REL, f"{name}: gradient of {k} differs by {err:.2e}"
    print(f"dp={world // tp} tp={tp}: max relative gradient difference {worst:.2e}")


# =============================================================================================
# M2PO: the second-moment trust region, one cutoff for the whole mini-batch
# =============================================================================================
def _m2_brute_force_kept(values: list[float], tau: float) -> set[int]:
    """The kept tokens, by the definition: the largest cutoff ``c`` (a value of the batch, or inf) whose
    kept set ``{v < c}`` is non-empty with a mean below ``tau``; none: the tokens of the smallest value."""
    best = None
    for c in sorted({*values, math.inf}):
        kept = [v for v in values if v < c]
        if kept and sum(kept) / len(kept) < tau:
            best = c
    if best is None:
        return {i for i, v in enumerate(values) if v == min(values)}
    return {i for i, v in enumerate(values) if v < best}


@pytest.mark.parametrize("seed", range(6))
def test_m2po_cutoff_matches_brute_force(seed):
    from fnppo.core.losses.m2po import m2po_cutoff

    g = torch.Generator().manual_seed(seed)
    values = (torch.rand(23, generator=g, dtype=torch.float64) * 0.2).round(decimals=2)  # ties
    for tau in (0.001, 0.03, 0.06, 0.09, 1.0):
        c = m2po_cutoff(values, tau)
        kept = {i for i, v in enumerate(values.tolist()) if v < float(c)}
        assert kept == _m2_brute_force_kept(values.tolist(), tau), (seed, tau)
        shuffled = values[torch.randperm(values.numel(), generator=g)]
        assert m2po_cutoff(shuffled, tau).item() == c.item()  # the order of the tokens does not matter


def _m2_batch(seed: int):
    lp0, old, adv, mask, ent, ref, rollout = random_batch(seed, 6, 7)
    return lp0, old, adv, mask, ent, ref, rollout


def test_m2po_loss_matches_loop_reference_and_is_split_invariant_with_the_global_cutoff():
    from fnppo.core.losses.m2po import m2_values, m2po_cutoff

    for seed in range(4):
        batch = _m2_batch(seed)
        lp0, old, adv, mask, ent, ref, rollout = batch
        sq = [((b, j), min(max(float(old[b, j] - rollout[b, j]), -20), 20) ** 2) for b in range(6) for j in range(7)]
        sq = [(p, v) for p, v in sq if mask[p] != 0]
        tau = 0.5 * sum(v for _, v in sq) / len(sq)  # half the batch's second moment: some tokens go
        cfg = LossConfig(correction=RolloutCorrection(m2_threshold=tau))
        kept = {sq[i][0] for i in _m2_brute_force_kept([v for _, v in sq], tau)}
        lp = leaf(lp0)
        loss, m = ppo_loss(lp, old, adv, mask, cfg, rollout_logprobs=rollout)
        # float64 loop: the policy loss's reference (PPO clip) on the kept tokens over all valid tokens
        lp64 = leaf(lp0)
        pg = policy_terms(cfg.policy, Rows(lp64, old, adv, mask, cfg.log_ratio_clamp))
        terms = [pg[p] if p in kept else pg[p] * 0 for p, _ in sq]
        expected = sum(terms) / len(terms)
        torch.testing.assert_close(loss, expected, **EXACT)
        torch.testing.assert_close(grad_of(loss, lp), grad_of(expected, lp64), **EXACT)
        assert finalize_metrics(m)["m2po_masked_frac"] == pytest.approx(1 - len(kept) / len(sq))
        assert 0 < len(kept) < len(sq)

        def global_cutoff(parts: list[tuple[int, int]]) -> dict:
            vals = torch.cat([m2_values(old[i:j], rollout[i:j], mask[i:j], 20.0) for i, j in parts])
            return {"m2_cutoff": m2po_cutoff(vals, tau)}

        for cuts in ([1], [2, 4], [1, 2, 3, 4, 5]):
            check_split_invariance(batch, cfg, cuts, part_kwargs=global_cutoff)


def test_m2po_needs_the_global_cutoff_under_a_split():
    """Per-micro-batch cutoffs (AReaL's) change the loss with the split: the step's global one does not."""
    batch = _m2_batch(11)
    lp0, old, adv, mask, _, _, rollout = batch
    cfg = LossConfig(correction=RolloutCorrection(m2_threshold=0.01))
    full, _ = ppo_loss(lp0, old, adv, mask, cfg, rollout_logprobs=rollout)
    n = loss_normalizer(mask, cfg.agg)
    local = sum(
        ppo_loss(lp0[i:j], old[i:j], adv[i:j], mask[i:j], cfg, rollout_logprobs=rollout[i:j], normalizer=n)[0]
        for i, j in ((0, 1), (1, 6))
    )
    assert abs(float(local - full)) > 1e-6


def test_m2po_refusals():
    with raises_message("LossConfig", "correction.m2_threshold", "None with bypass_old_logprobs=True", "0.1"):
        LossConfig(correction=RolloutCorrection(m2_threshold=0.1), bypass_old_logprobs=True)
    with raises_message("RolloutCorrection", "m2_threshold", "a number > 0 or None", "0.0"):
        RolloutCorrection(m2_threshold=0.0)
    lp0, old, adv, mask, *_, rollout = _m2_batch(0)
    with raises_message("ppo_loss", "m2_cutoff", "None unless correction.m2_threshold is set", "0.5"):
        ppo_loss(lp0, old, adv, mask, LossConfig(), m2_cutoff=0.5)


def test_m2po_cutoff_that_is_nan_or_not_positive_is_refused():
    """A NaN cutoff masked nothing (``m >= NaN`` is False) and a negative one everything: refused by
    name, as a number or a tensor; inf (keep all, what m2po_cutoff returns when nothing goes) is fine.
    The cutoff's own inputs: a NaN value sorted first and became the cutoff; a threshold that is NaN or
    not > 0 kept only the smallest value's tokens."""
    from fnppo.core.losses.m2po import m2po_cutoff

    lp0, old, adv, mask, *_, rollout = _m2_batch(0)
    cfg = LossConfig(correction=RolloutCorrection(m2_threshold=0.1))
    for bad, shown in (
        (math.nan, "nan"),
        (-1.0, "-1.0"),
        (0.0, "0.0"),
        (torch.tensor(math.nan, dtype=torch.float64), "= nan"),
        (torch.tensor(-0.5, dtype=torch.float64), "= -0.5"),
    ):
        with raises_message("ppo_loss", "m2_cutoff", "a number > 0 or inf", shown):
            ppo_loss(lp0, old, adv, mask, cfg, rollout_logprobs=rollout, m2_cutoff=bad)
    keep_all, m = ppo_loss(lp0, old, adv, mask, cfg, rollout_logprobs=rollout, m2_cutoff=math.inf)
    assert finalize_metrics(m)["m2po_masked_frac"] == 0.0
    plain, _ = ppo_loss(lp0, old, adv, mask, LossConfig(), rollout_logprobs=rollout)
    torch.testing.assert_close(keep_all, plain, **EXACT)
    values = torch.tensor([0.3, 0.01, 0.02], dtype=torch.float64)
    with raises_message("m2po_cutoff", "values", "finite values", "1 NaN/inf"):
        m2po_cutoff(torch.tensor([math.nan, 0.01, 0.02], dtype=torch.float64), 0.1)
    for tau in (math.nan, -0.1, 0.0, math.inf):
        with raises_message("m2po_cutoff", "threshold", "a finite number > 0", repr(tau)):
            m2po_cutoff(values, tau)


def test_staleness_owns_the_off_policy_contract():
    from fnppo.core.losses import Staleness

    recompute, bypass = Staleness(max_staleness=2), Staleness(max_staleness=2, proximal="behaviour")
    loss = from_flat(policy_loss="ipo")
    assert not recompute.loss_config(loss).bypass_old_logprobs and bypass.loss_config(loss).bypass_old_logprobs
    assert recompute.needs_old_logprobs and not bypass.needs_old_logprobs
    m = bypass.metrics([5, 4, 3, 5], current_version=5)
    assert m == {
        "offpolicy/staleness_mean": 0.75,
        "offpolicy/staleness_max": 2.0,
        "offpolicy/old_logprob_forward": 0.0,
    }
    with raises_message("Staleness.check", "versions[2]", "a version in [3, 5] (max_staleness=2", "2 (staleness 3)"):
        recompute.check([5, 4, 2, 6], current_version=5)
    with raises_message("Staleness.check", "versions[0]", "a version in [3, 5]", "6 (staleness -1)"):
        recompute.check([6], current_version=5)  # from the future
    with raises_message("Staleness", "proximal", "one of ['old', 'behaviour']", "'rollout'"):
        Staleness(proximal="rollout")
    with raises_message("Staleness", "max_staleness", "an int >= 0", "-1"):
        Staleness(max_staleness=-1)
    # a contract that bypasses the old log-probs refuses a loss that cannot run in bypass mode
    with raises_message("LossConfig", "correction.m2_threshold", "None with bypass_old_logprobs=True", "0.1"):
        bypass.loss_config(LossConfig(correction=RolloutCorrection(m2_threshold=0.1)))


@pytest.mark.parametrize("staleness", [1, 2, 4])
def test_loglinear_decoupled_matches_float64_loop(staleness):
    """AReaL's decoupled PPO with the log-linear proximal policy, in bypass mode (no old-log-prob
    forward), at several staleness values: its float64 loop reference, value and gradient at 1e-12; at
    K = 1 it is PPO in bypass mode, bit for bit."""
    from fnppo.core.losses import loglinear_decoupled

    lp0, _, adv, mask, _, _, rollout = random_batch(40 + staleness, 4, 6)
    cfg = LossConfig(policy=loglinear_decoupled(staleness=staleness, weight_cap=1.05), bypass_old_logprobs=True)
    lp = leaf(lp0)
    loss, m = ppo_loss(lp, None, adv, mask, cfg, rollout_logprobs=rollout)
    lp64 = leaf(lp0)
    expected = ref_ppo_loss(lp64, None, adv, mask, cfg, rollout=rollout)  # its one reference (tests/loss_reference.py)
    torch.testing.assert_close(loss, expected, **EXACT)
    torch.testing.assert_close(grad_of(loss, lp), grad_of(expected, lp64), **EXACT)
    if staleness == 1:  # the proximal policy is the behaviour one: PPO in bypass mode
        plain, _ = ppo_loss(lp0, None, adv, mask, LossConfig(bypass_old_logprobs=True), rollout_logprobs=rollout)
        torch.testing.assert_close(loss, plain, **EXACT)
    else:
        assert 0.0 < finalize_metrics(m)["behaviour_weight"] != 1.0
    with raises_message("loglinear_decoupled", "staleness", "an int >= 0", "-1"):
        loglinear_decoupled(staleness=-1)


def test_loglinear_decoupled_is_refused_outside_bypass_mode():
    """Outside bypass mode its old_logprobs would be the trainer's recompute, taken for the behaviour
    policy: the proximal policy would then be interpolated between two copies of itself (loss 0 in a step)."""
    from fnppo.core.losses import loglinear_decoupled

    expected = "True with the policy loss 'loglinear_decoupled(staleness=2"
    with raises_message("LossConfig", "bypass_old_logprobs", expected, "False"):
        LossConfig(policy=loglinear_decoupled(staleness=2))
    cfg = LossConfig(policy=loglinear_decoupled(staleness=2), bypass_old_logprobs=True)
    with raises_message("LossConfig", "bypass_old_logprobs", expected, "False"):
        dataclasses.replace(cfg, bypass_old_logprobs=False)


def test_staleness_loss_config_sets_the_bypass_flag_from_proximal():
    """proximal='behaviour' turns bypass mode on whatever the caller's flag; proximal='old' keeps it off
    and refuses a loss that asked for it; everything else of the loss is kept."""
    from fnppo.core.losses import ipo

    loss = LossConfig(policy=ipo(threshold=0.2), entropy_coef=0.01, kl=KLPenalty(0.1))
    for caller in (False, True):
        given = dataclasses.replace(loss, bypass_old_logprobs=caller)
        assert Staleness(2, "behaviour").loss_config(given) == dataclasses.replace(loss, bypass_old_logprobs=True)
    assert Staleness(2, "old").loss_config(loss) == loss
    with raises_message("Staleness.loss_config", "loss.bypass_old_logprobs", "False with proximal='old'", "True"):
        Staleness(2, "old").loss_config(dataclasses.replace(loss, bypass_old_logprobs=True))
    with raises_message("Staleness.loss_config", "loss", "a fnppo.losses.LossConfig", "dict"):
        Staleness(2, "old").loss_config({"bypass_old_logprobs": False})


def test_staleness_refuses_a_loss_that_contradicts_it():
    from fnppo.core.losses import loglinear_decoupled

    stale4 = LossConfig(policy=loglinear_decoupled(staleness=4), bypass_old_logprobs=True)
    with raises_message("Staleness.loss_config", "loss.policy.staleness", "at most max_staleness=2", "4"):
        Staleness(2, "behaviour").loss_config(stale4)
    assert Staleness(4, "behaviour").loss_config(stale4) == stale4
    with raises_message(
        "Staleness.loss_config", "proximal", "'behaviour' for the policy loss 'loglinear_decoupled(", "'old'"
    ):
        Staleness(4, "old").loss_config(stale4)


@pytest.mark.parametrize(
    "versions, arg, expected",
    [
        (None, "versions", "a sequence (list or tuple) of ints"),
        ("543", "versions", "a sequence (list or tuple) of ints"),
        (torch.tensor([5, 4]), "versions", "a sequence (list or tuple) of ints"),
        ([5, "4"], "versions[1]", "a version in [3, 5]"),
        ([5, 4.0], "versions[1]", "a version in [3, 5]"),
        ([True], "versions[0]", "a version in [3, 5]"),
    ],
    ids=["none", "str", "tensor", "str-version", "float-version", "bool-version"],
)
def test_staleness_check_refuses_what_is_not_a_list_of_versions(versions, arg, expected):
    contract = Staleness(2, "old")
    for call in (contract.check, contract.metrics):
        with raises_message("Staleness.check", arg, expected, ""):
            call(versions, 5)
