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
    with pytest.raises(InputError, match="gamma"):
        gae_advantages(r, v, m, gamma=1.5, lam=0.9)
    with pytest.raises(InputError, match="lam"):
        gae_advantages(r, v, m, gamma=0.9, lam=-0.1)
    with pytest.raises(InputError, match="mask"):
        gae_advantages(r, v, m * 2 + 0.5, gamma=0.9, lam=0.9)
    bad = r.clone()
    bad[0, 0] = math.nan
    with pytest.raises(InputError, match="'rewards' expected finite"):
        gae_advantages(bad, v, torch.ones(2, 3), gamma=0.9, lam=0.9)
    gae_advantages(bad, v, torch.where(torch.isnan(bad), 0.0, 1.0).to(F64), gamma=0.9, lam=0.9)  # masked NaN is fine
    with pytest.raises(ShapeError):
        gae_advantages(r, v[:, :2], m, gamma=0.9, lam=0.9)
    copies, versions = [x.clone() for x in (r, v, m)], [x._version for x in (r, v, m)]
    gae_advantages(r, v, m, gamma=0.9, lam=0.9)
    for x, c, ver in zip((r, v, m), copies, versions):
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
    with pytest.raises(InputError, match="'scores' expected finite"):
        grpo_advantages(t(1.0, math.inf), torch.tensor([0, 0]))
    with pytest.raises(InputError, match="'scores' expected finite"):
        rloo_advantages(t([1.0, math.nan]))
    with pytest.raises(InputError, match="group_ids"):
        grpo_advantages(t(1.0, 2.0))
    with pytest.raises(InputError, match="group_ids"):
        rloo_advantages(t([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(ShapeError):
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
    with pytest.raises(InputError, match="'kl'"):
        reinforce_pp_advantages(rewards, mask, kl_coef=0.1)
    with pytest.raises(InputError, match="'rewards' expected finite"):
        reinforce_pp_advantages(t([math.nan, 1.0]), mask)
    with pytest.raises(InputError, match="gamma"):
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
    with pytest.raises(InputError, match="values"):
        broadcast_to_tokens(t(1.0, 2.0, 3.0), t([1.0, 0.0], [1.0, 1.0]))
    with pytest.raises(InputError, match="seq_ids"):
        broadcast_to_tokens(t(5.0), t([1.0, 1.0]), seq_ids=torch.tensor([[0, 1]]))
    with pytest.raises(InputError, match="seq_ids"):
        broadcast_to_tokens(t(5.0), t([1.0, 1.0]), seq_ids=torch.tensor([[0, -1]]))


# =============================================================================================
# pass@k, REINFORCE++-baseline, ReMax, OPO, GPG, optimal token baseline
# =============================================================================================
import itertools  # noqa: E402

from fnppo.advantages import (  # noqa: E402
    gpg_advantages,
    gpg_batch_counts,
    masked_moments,
    opo_advantages,
    optimal_token_baseline_advantages,
    pass_at_k_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
)

TOL = dict(rtol=1e-12, atol=1e-12)


def close(actual, expected):
    assert isinstance(expected, torch.Tensor) and expected.dtype == F64, "references are float64 tensors"
    torch.testing.assert_close(actual, expected.to(actual.dtype), **TOL)


def groups_of(ids, valid):
    """{group id: [row indices of its valid rows]} (plain Python)."""
    out: dict[int, list[int]] = {}
    for i, (gid, v) in enumerate(zip(ids, valid)):
        out.setdefault(int(gid), [])
        if v:
            out[int(gid)].append(i)
    return out


def random_groups(seed, n, n_groups, p_valid=0.8, ties=False):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, generator=g, dtype=F64)
    if ties:
        scores = torch.round(scores)
    ids = torch.randint(0, n_groups, (n,), generator=g) * 7 - 3  # arbitrary integers
    valid = (torch.rand(n, generator=g) < p_valid).to(F64)
    return scores, ids, valid


# ---------------------------------------------------------------------------------------------
# pass@k
# ---------------------------------------------------------------------------------------------
def pass_at_k_reference(xs, k, normalize=True, eps=0.0):
    """Enumerate every k-subset (plain Python floats)."""
    n = len(xs)
    subsets = list(itertools.combinations(range(n), k))
    maxima = [max(xs[j] for j in s) for s in subsets]
    mean = sum(maxima) / len(maxima)
    var = max(sum(v * v for v in maxima) / len(maxima) - mean * mean, 0.0)
    out = []
    for i in range(n):
        with_i = [max(xs[j] for j in s) for s in subsets if i in s]
        a = sum(with_i) / len(with_i) - mean
        if max(maxima) == min(maxima):  # every subset has the same maximum
            a = 0.0
        elif normalize:
            a = a / (math.sqrt(var) + eps)
        out.append(a)
    return out


@pytest.mark.parametrize("n,c,k", [(8, 2, 3), (8, 1, 1), (5, 3, 2), (16, 3, 8), (6, 1, 5), (12, 6, 4)])
def test_pass_at_k_binary_matches_paper_closed_form(n, c, k):
    # Chen et al. (arXiv:2508.10751), analytical derivation for 0/1 rewards.
    rows = torch.tensor([[1.0] * c + [0.0] * (n - c)], dtype=F64)
    adv = pass_at_k_advantages(rows, k=k, eps=0.0)
    r = 1 - math.comb(n - c, k) / math.comb(n, k)
    sigma = math.sqrt(r * (1 - r))
    pos = (1 - r) / sigma
    neg = (1 - r - math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1)) / sigma
    close(adv, torch.tensor([[pos] * c + [neg] * (n - c)], dtype=F64))
    close(pass_at_k_advantages(rows, k=k, normalize_std=False),
          torch.tensor([[pos * sigma] * c + [neg * sigma] * (n - c)], dtype=F64))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 9), n_groups=st.integers(1, 3), ties=st.booleans(),
       normalize=st.booleans(), k_pick=st.integers(0, 10))
def test_pass_at_k_matches_enumeration(seed, n, n_groups, ties, normalize, k_pick):
    scores, ids, valid = random_groups(seed, n, n_groups, ties=ties)
    groups = groups_of(ids.tolist(), valid.tolist())
    sizes = [len(v) for v in groups.values() if v]
    if not sizes:
        close(pass_at_k_advantages(scores, ids, k=1, valid=valid), torch.zeros(n, dtype=F64))
        return
    k = 1 + k_pick % min(sizes)
    adv = pass_at_k_advantages(scores, ids, k=k, valid=valid, normalize_std=normalize, eps=1e-3)
    expected = [0.0] * n
    for rows in groups.values():
        if rows:
            for i, a in zip(rows, pass_at_k_reference([float(scores[i]) for i in rows], k, normalize, 1e-3)):
                expected[i] = a
    close(adv, torch.tensor(expected, dtype=F64))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), size=st.integers(2, 8), k=st.integers(1, 8))
def test_pass_at_k_permutation_equivariant_and_zero_sum(seed, size, k):
    k = min(k, size)
    g = torch.Generator().manual_seed(seed)
    scores = torch.round(torch.randn(3, size, generator=g, dtype=F64) * 2)  # ties included
    perm = torch.randperm(size, generator=g)
    adv = pass_at_k_advantages(scores, k=k)
    close(pass_at_k_advantages(scores[:, perm], k=k), adv[:, perm])
    close(pass_at_k_advantages(scores, k=k, normalize_std=False).sum(1), torch.zeros(3, dtype=F64))


def test_pass_at_k_edge_cases():
    # k = 1 on a group of size 1: no baseline, 0; k >= 2 on it: refused
    close(pass_at_k_advantages(t([3.0], [4.0]), k=1), t([0.0], [0.0]))
    with pytest.raises(InputError, match=r"pass_at_k_advantages: argument 'k' expected .*smallest non-empty group: 1.*received 2"):
        pass_at_k_advantages(t(1.0, 2.0, 3.0), torch.tensor([0, 0, 1]), k=2)
    # masked rows leave the group: the size-1 group is fine once its only row is masked
    adv = pass_at_k_advantages(t(1.0, 2.0, 5.0, 3.0), torch.tensor([0, 0, 0, 1]), k=2, valid=t(1.0, 1.0, 1.0, 0.0),
                               normalize_std=False)
    # group {1, 2, 5}, k = 2: maxima of {1,2},{1,5},{2,5} = 2, 5, 5 -> R = 4; m = (2+5)/2, (2+5)/2, 5
    close(adv, t(-0.5, -0.5, 1.0, 0.0))
    # n = k: the only subset is the whole group, so every advantage is 0
    close(pass_at_k_advantages(t([1.0, 2.0]), k=2), t([0.0, 0.0]))
    # 0/1 rewards with fewer than k wrong rows: every k-subset passes, R = 1, sigma = 0, A = 0
    close(pass_at_k_advantages(t([1.0, 1.0, 1.0, 0.0]), k=2, eps=0.0), t([0.0, 0.0, 0.0, 0.0]))
    # all rows masked: zeros, no error, whatever k
    close(pass_at_k_advantages(t([1.0, 2.0]), k=5, valid=t([0.0, 0.0])), t([0.0, 0.0]))
    # masked NaN is ignored, a valid one refused
    close(pass_at_k_advantages(t([math.nan, 2.0, 1.0]), k=1, valid=t([0.0, 1.0, 1.0]), normalize_std=False),
          t([0.0, 0.5, -0.5]))
    with pytest.raises(InputError, match="'scores' expected finite"):
        pass_at_k_advantages(t([math.nan, 2.0, 1.0]), k=1)
    for bad in (0, -1, True):
        with pytest.raises(InputError, match="pass_at_k_advantages: argument 'k' expected an int >= 1, received"):
            pass_at_k_advantages(t([1.0, 2.0]), k=bad)
    with pytest.raises(ShapeError, match="'k'"):
        pass_at_k_advantages(t([1.0, 2.0]), k=2.0)
    with pytest.raises(InputError, match="argument 'valid' expected a 0/1 mask of the shape of scores"):
        pass_at_k_advantages(t([1.0, 2.0]), k=1, valid=t(1.0, 1.0))
    with pytest.raises(InputError, match="argument 'eps'"):
        pass_at_k_advantages(t([1.0, 2.0]), k=1, eps=-1.0)
