"""Tests of fnppo.advantages: closed forms and loop references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnppo.advantages import (
    broadcast_to_tokens,
    discounted_scan,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from fnppo.typing import InputError, ShapeError
from tests.messages import raises_message

F64 = torch.float64


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def gae_reference(r, v, m, gamma, lam):
    adv = torch.zeros_like(r)
    for b in range(r.shape[0]):
        last_adv, next_v = 0.0, 0.0
        for j in reversed(range(r.shape[1])):
            if m[b, j] == 0:
                continue
            delta = float(r[b, j]) + gamma * next_v - float(v[b, j])
            last_adv = delta + gamma * lam * last_adv
            adv[b, j] = last_adv
            next_v = float(v[b, j])
    return adv, torch.where(m != 0, adv + v, torch.zeros_like(v))


def random_tokens(seed, b, s):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(b, s, generator=g, dtype=F64)
    v = torch.randn(b, s, generator=g, dtype=F64)
    m = (torch.rand(b, s, generator=g, dtype=F64) < 0.7).to(F64)
    return r, v, m


# =============================================================================================
# GAE
# =============================================================================================
def test_gae_closed_form():
    # gamma = lam = 1: returns are the sum of future rewards, advantages returns - V
    adv, ret = gae_advantages(t([0.0, 0.0, 1.0]), t([0.5, 0.5, 0.5]), t([1.0, 1.0, 1.0]), gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, t([1.0, 1.0, 1.0]))
    torch.testing.assert_close(adv, t([0.5, 0.5, 0.5]))
    # a hole at t=1 is skipped: t2: delta = 1 - 0.4 = 0.6; t0: delta = 0.9 * 0.4 - 0.2 = 0.16,
    # A0 = 0.16 + 0.9 * 0.8 * 0.6 = 0.592
    adv, ret = gae_advantages(t([0.0, 99.0, 1.0]), t([0.2, 99.0, 0.4]), t([1.0, 0.0, 1.0]), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, t([0.592, 0.0, 0.6]))
    torch.testing.assert_close(ret, t([0.792, 0.0, 1.0]))
    # lam = 0: one-step TD errors
    adv, _ = gae_advantages(t([1.0, 2.0]), t([0.5, 1.0]), t([1.0, 1.0]), gamma=0.5, lam=0.0)
    torch.testing.assert_close(adv, t([1.0 + 0.5 * 1.0 - 0.5, 2.0 - 1.0]))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 4), s=st.integers(1, 19),
       gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0))
def test_gae_matches_loop(seed, b, s, gamma, lam):
    r, v, m = random_tokens(seed, b, s)
    adv, ret = gae_advantages(r, v, m, gamma=gamma, lam=lam)
    adv_ref, ret_ref = gae_reference(r, v, m, gamma, lam)
    torch.testing.assert_close(adv, adv_ref)
    torch.testing.assert_close(ret, ret_ref)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), s=st.integers(1, 33))
def test_discounted_scan_matches_loop(seed, s):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(2, s, generator=g, dtype=F64)
    x = torch.randn(2, s, generator=g, dtype=F64)
    out = discounted_scan(a, x)
    expected = torch.zeros_like(x)
    for b in range(2):
        carry = 0.0
        for j in reversed(range(s)):
            carry = float(a[b, j]) * carry + float(x[b, j])
            expected[b, j] = carry
    torch.testing.assert_close(out, expected)


def test_gae_validation_and_no_inplace():
    r, v, m = random_tokens(0, 2, 3)
    with raises_message("gae_advantages", "gamma", "a number in [0, 1]", "1.5"):
        gae_advantages(r, v, m, gamma=1.5, lam=0.9)
    with raises_message("gae_advantages", "lam", "a number in [0, 1]", "-0.1"):
        gae_advantages(r, v, m, gamma=0.9, lam=-0.1)
    with raises_message("gae_advantages", "mask", "a 0/1 mask", "f64[2,3] containing 2.5"):
        gae_advantages(r, v, m * 2 + 0.5, gamma=0.9, lam=0.9)
    bad = r.clone()
    bad[0, 0] = math.nan
    with raises_message("gae_advantages", "rewards", "finite values", "f64[2,3] with 1 NaN/inf entries"):
        gae_advantages(bad, v, torch.ones(2, 3), gamma=0.9, lam=0.9)
    gae_advantages(bad, v, torch.where(torch.isnan(bad), 0.0, 1.0).to(F64), gamma=0.9, lam=0.9)  # masked NaN is fine
    with raises_message("gae_advantages", "values", "Float[Tensor, 'batch seq']", "f64[2,2]", ShapeError):
        gae_advantages(r, v[:, :2], m, gamma=0.9, lam=0.9)
    copies, versions = [x.clone() for x in (r, v, m)], [x._version for x in (r, v, m)]
    gae_advantages(r, v, m, gamma=0.9, lam=0.9)
    for x, c, ver in zip((r, v, m), copies, versions, strict=True):
        assert torch.equal(x, c) and x._version == ver


# =============================================================================================
# GRPO, RLOO
# =============================================================================================
def test_grpo_closed_form():
    scores = t([1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0])
    adv = grpo_advantages(scores, eps=0.0)
    half_over_std = 0.5 / math.sqrt(1 / 3)  # mean 0.5, unbiased variance 1/3
    torch.testing.assert_close(adv, t([half_over_std, -half_over_std, -half_over_std, half_over_std], [0.0] * 4))
    torch.testing.assert_close(grpo_advantages(scores, normalize_std=False), t([0.5, -0.5, -0.5, 0.5], [0.0] * 4))
    # group ids (any integers), with a singleton group -> 0
    flat = t(1.0, 0.0, 5.0, 0.0, 1.0)
    ids = torch.tensor([7, 7, -3, 7, 7])
    adv = grpo_advantages(flat, ids, eps=0.0)
    torch.testing.assert_close(adv, t(half_over_std, -half_over_std, 0.0, -half_over_std, half_over_std))
    torch.testing.assert_close(grpo_advantages(t([3.0], [4.0])), t([0.0], [0.0]))


def test_rloo_closed_form():
    torch.testing.assert_close(rloo_advantages(t([1.0, 0.0, 0.0, 1.0])), t([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    adv = rloo_advantages(t(1.0, 4.0, 3.0), torch.tensor([0, 1, 0]))
    torch.testing.assert_close(adv, t(1.0 - 3.0, 0.0, 3.0 - 1.0))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 12), k=st.integers(1, 4), normalize=st.booleans())
def test_group_advantages_match_loop(seed, n, k, normalize):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, generator=g, dtype=F64)
    ids = torch.randint(0, k, (n,), generator=g)
    grpo = grpo_advantages(scores, ids, normalize_std=normalize)
    rloo = rloo_advantages(scores, ids)
    for i in range(n):
        group = [float(scores[j]) for j in range(n) if ids[j] == ids[i]]
        if len(group) == 1:
            assert grpo[i] == 0.0 and rloo[i] == 0.0
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        expected = (float(scores[i]) - mean) / (std + 1e-6) if normalize else float(scores[i]) - mean
        assert float(grpo[i]) == pytest.approx(expected, rel=1e-9, abs=1e-9)
        loo = (sum(group) - float(scores[i])) / (len(group) - 1)
        assert float(rloo[i]) == pytest.approx(float(scores[i]) - loo, rel=1e-9, abs=1e-9)


def test_group_validation():
    with raises_message("grpo_advantages", "scores", "finite values", "f64[2] with 1 NaN/inf entries"):
        grpo_advantages(t(1.0, math.inf), torch.tensor([0, 0]))
    with raises_message("rloo_advantages", "scores", "finite values", "f64[1,2] with 1 NaN/inf entries"):
        rloo_advantages(t([1.0, math.nan]))
    with raises_message("grpo_advantages", "group_ids", "a tensor [n] when scores is 1-D", "None"):
        grpo_advantages(t(1.0, 2.0))
    with raises_message("rloo_advantages", "group_ids", "None when scores is [n_groups, group_size]", "a tensor"):
        rloo_advantages(t([1.0, 2.0]), torch.tensor([0]))
    with raises_message("grpo_advantages", "group_ids", "Integer[Tensor, 'n'] | None", "i64[3]", ShapeError):
        grpo_advantages(t(1.0, 2.0), torch.tensor([0, 0, 1]))


# =============================================================================================
# REINFORCE++
# =============================================================================================
def test_reinforce_pp_closed_form():
    rewards = t([0.0, 0.0, 1.0], [0.0, 2.0, 0.0])
    mask = t([1.0, 1.0, 1.0], [1.0, 1.0, 0.0])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5, eps=0.0)
    torch.testing.assert_close(ret, t([0.25, 0.5, 1.0], [1.0, 2.0, 0.0]))
    valid = torch.tensor([0.25, 0.5, 1.0, 1.0, 2.0], dtype=F64)
    expected = (valid - valid.mean()) / valid.std()  # unbiased
    torch.testing.assert_close(adv[mask != 0], expected)
    assert adv[1, 2] == 0.0
    # KL-shaped rewards: r - 0.5 * kl with kl = 0.2 everywhere (gamma = 1)
    _, ret = reinforce_pp_advantages(rewards, mask, gamma=1.0, kl=torch.full((2, 3), 0.2, dtype=F64), kl_coef=0.5)
    torch.testing.assert_close(ret, t([0.7, 0.8, 0.9], [1.8, 1.9, 0.0]))


def test_reinforce_pp_validation():
    rewards, mask = t([0.0, 1.0]), t([1.0, 1.0])
    with raises_message("reinforce_pp_advantages", "kl", "a per-token KL tensor since kl_coef=0.1", "None"):
        reinforce_pp_advantages(rewards, mask, kl_coef=0.1)
    with raises_message("reinforce_pp_advantages", "rewards", "finite values", "f64[1,2] with 1 NaN/inf entries"):
        reinforce_pp_advantages(t([math.nan, 1.0]), mask)
    with raises_message("reinforce_pp_advantages", "gamma", "a number in [0, 1]", "2.0"):
        reinforce_pp_advantages(rewards, mask, gamma=2.0)
    adv, ret = reinforce_pp_advantages(rewards, torch.zeros(1, 2, dtype=F64))
    assert torch.equal(adv, torch.zeros(1, 2, dtype=F64)) and torch.equal(ret, torch.zeros(1, 2, dtype=F64))


# =============================================================================================
# Broadcast
# =============================================================================================
def test_broadcast_to_tokens():
    out = broadcast_to_tokens(t(2.0, 3.0), t([1.0, 0.0], [1.0, 1.0]))
    torch.testing.assert_close(out, t([2.0, 0.0], [3.0, 3.0]))
    out = broadcast_to_tokens(t(5.0, 6.0), t([1.0, 1.0, 1.0, 0.0]), seq_ids=torch.tensor([[1, 1, 0, -1]]))
    torch.testing.assert_close(out, t([6.0, 6.0, 5.0, 0.0]))
    with raises_message("broadcast_to_tokens", "values", "one value per row ([2]) when seq_ids is None", "[3]"):
        broadcast_to_tokens(t(1.0, 2.0, 3.0), t([1.0, 0.0], [1.0, 1.0]))
    with raises_message("broadcast_to_tokens", "seq_ids", "values in [-1, 1)", "values in [0, 1]"):
        broadcast_to_tokens(t(5.0), t([1.0, 1.0]), seq_ids=torch.tensor([[0, 1]]))
    with raises_message("broadcast_to_tokens", "seq_ids", "a sequence (>= 0) wherever mask is 1", "-1 at a masked-in token"):
        broadcast_to_tokens(t(5.0), t([1.0, 1.0]), seq_ids=torch.tensor([[0, -1]]))
