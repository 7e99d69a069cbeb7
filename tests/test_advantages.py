"""Tests of fnppo.core.advantages: closed forms and loop references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnppo.core.advantages import (
    broadcast_to_tokens,
    discounted_scan,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from fnppo.core.errors import InputError, ShapeError
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
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 4),
    s=st.integers(1, 19),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
)
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
    with raises_message(
        "broadcast_to_tokens", "seq_ids", "a sequence (>= 0) wherever mask is 1", "-1 at a masked-in token"
    ):
        broadcast_to_tokens(t(5.0), t([1.0, 1.0]), seq_ids=torch.tensor([[0, -1]]))


# =============================================================================================
# pass@k, REINFORCE++-baseline, ReMax, OPO, GPG, optimal token baseline
# =============================================================================================
import itertools  # noqa: E402

from fnppo.core.advantages import (  # noqa: E402
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
    close(
        pass_at_k_advantages(rows, k=k, normalize_std=False),
        torch.tensor([[pos * sigma] * c + [neg * sigma] * (n - c)], dtype=F64),
    )


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 9),
    n_groups=st.integers(1, 3),
    ties=st.booleans(),
    normalize=st.booleans(),
    k_pick=st.integers(0, 10),
)
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
    with pytest.raises(
        InputError, match=r"pass_at_k_advantages: argument 'k' expected .*smallest non-empty group: 1.*received 2"
    ):
        pass_at_k_advantages(t(1.0, 2.0, 3.0), torch.tensor([0, 0, 1]), k=2)
    # masked rows leave the group: the size-1 group is fine once its only row is masked
    adv = pass_at_k_advantages(
        t(1.0, 2.0, 5.0, 3.0), torch.tensor([0, 0, 0, 1]), k=2, valid=t(1.0, 1.0, 1.0, 0.0), normalize_std=False
    )
    # group {1, 2, 5}, k = 2: maxima of {1,2},{1,5},{2,5} = 2, 5, 5 -> R = 4; m = (2+5)/2, (2+5)/2, 5
    close(adv, t(-0.5, -0.5, 1.0, 0.0))
    # n = k: the only subset is the whole group, so every advantage is 0
    close(pass_at_k_advantages(t([1.0, 2.0]), k=2), t([0.0, 0.0]))
    # 0/1 rewards with fewer than k wrong rows: every k-subset passes, R = 1, sigma = 0, A = 0
    close(pass_at_k_advantages(t([1.0, 1.0, 1.0, 0.0]), k=2, eps=0.0), t([0.0, 0.0, 0.0, 0.0]))
    # all rows masked: zeros, no error, whatever k
    close(pass_at_k_advantages(t([1.0, 2.0]), k=5, valid=t([0.0, 0.0])), t([0.0, 0.0]))
    # masked NaN is ignored, a valid one refused
    close(
        pass_at_k_advantages(t([math.nan, 2.0, 1.0]), k=1, valid=t([0.0, 1.0, 1.0]), normalize_std=False),
        t([0.0, 0.5, -0.5]),
    )
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


# ---------------------------------------------------------------------------------------------
# REINFORCE++-baseline
# ---------------------------------------------------------------------------------------------
def rpp_baseline_reference(scores, mask, ids, kl, kl_coef, eps, moments=None):
    b, s = mask.shape
    row_ok = [any(mask[i, j] != 0 for j in range(s)) for i in range(b)]
    groups = groups_of(ids.tolist(), row_ok)
    ret = torch.zeros(b, s, dtype=F64)
    for rows in groups.values():
        mean = sum(float(scores[i]) for i in rows) / max(len(rows), 1)
        for i in rows:
            centered = float(scores[i]) - mean if len(rows) > 1 else 0.0
            to_go = 0.0
            for j in reversed(range(s)):
                if mask[i, j] != 0:
                    to_go += float(kl[i, j]) if kl is not None else 0.0
                    ret[i, j] = centered - kl_coef * to_go
    vals = [float(ret[i, j]) for i in range(b) for j in range(s) if mask[i, j] != 0]
    if moments is None:
        n = len(vals)
        mu = sum(vals) / n if n else 0.0
        var = sum((v - mu) ** 2 for v in vals) / max(n - 1, 1)
    else:
        n, s1, s2 = (float(v) for v in moments)
        mu = s1 / n
        var = (s2 - s1 * mu) / max(n - 1, 1)
    adv = torch.zeros(b, s, dtype=F64)
    for i in range(b):
        for j in range(s):
            if mask[i, j] != 0:
                adv[i, j] = (float(ret[i, j]) - mu) / math.sqrt(var + eps)
    return adv, ret


def test_reinforce_pp_baseline_closed_form():
    # group 0: rows 0, 1 (scores 1, 0) -> centered +-0.5; group 5: row 2 alone -> 0; row 3 fully masked
    scores = t(1.0, 0.0, 7.0, 9.0)
    mask = t([1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    ids = torch.tensor([0, 0, 5, 0])  # row 3 is in group 0 but masked: not in its mean
    adv, ret = reinforce_pp_baseline_advantages(scores, mask, ids, eps=0.0)
    close(ret, t([0.5, 0.5, 0.0], [0.0, -0.5, -0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]))
    vals = torch.tensor([0.5, 0.5, -0.5, -0.5, 0.0], dtype=F64)
    expected = torch.zeros(4, 3, dtype=F64)
    expected[mask != 0] = (vals - vals.mean()) / vals.std()  # Bessel, the valid tokens in row-major order
    close(adv, expected)
    # KL shaping: kl = 0.1 everywhere, coef 2 -> returns minus 0.2 * (valid tokens still to come)
    _, ret = reinforce_pp_baseline_advantages(scores, mask, ids, kl=torch.full((4, 3), 0.1, dtype=F64), kl_coef=2.0)
    close(ret, t([0.5 - 0.4, 0.5 - 0.2, 0.0], [0.0, -0.5 - 0.4, -0.5 - 0.2], [-0.2, 0.0, 0.0], [0.0, 0.0, 0.0]))


def random_token_batch(seed, b, s, n_groups):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, generator=g, dtype=F64)
    mask = (torch.rand(b, s, generator=g) < 0.7).to(F64)
    ids = torch.randint(0, n_groups, (b,), generator=g)
    kl = torch.randn(b, s, generator=g, dtype=F64).abs()
    return scores, mask, ids, kl


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 7),
    s=st.integers(1, 6),
    n_groups=st.integers(1, 3),
    kl_coef=st.sampled_from([0.0, 0.3]),
    eps=st.sampled_from([1e-8, 0.5]),
)
def test_reinforce_pp_baseline_matches_loop(seed, b, s, n_groups, kl_coef, eps):
    scores, mask, ids, kl = random_token_batch(seed, b, s, n_groups)
    adv, ret = reinforce_pp_baseline_advantages(scores, mask, ids, kl=kl, kl_coef=kl_coef, eps=eps)
    adv_ref, ret_ref = rpp_baseline_reference(scores, mask, ids, kl, kl_coef, eps)
    close(ret, ret_ref)
    close(adv, adv_ref)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(2, 8), s=st.integers(1, 5), cut=st.integers(1, 3))
def test_reinforce_pp_baseline_split_invariance(seed, b, s, cut):
    """Whole groups per part + summed moments == one call on the whole batch."""
    scores, mask, ids, kl = random_token_batch(seed, b, s, 4)
    whole, _ = reinforce_pp_baseline_advantages(scores, mask, ids, kl=kl, kl_coef=0.1)
    parts = [ids < cut, ids >= cut]
    rets = [reinforce_pp_baseline_advantages(scores[p], mask[p], ids[p], kl=kl[p], kl_coef=0.1)[1] for p in parts]
    moments = sum(masked_moments(r, mask[p]) for r, p in zip(rets, parts))
    for p in parts:
        adv, _ = reinforce_pp_baseline_advantages(
            scores[p], mask[p], ids[p], kl=kl[p], kl_coef=0.1, batch_moments=moments
        )
        close(adv, whole[p])


def test_reinforce_pp_baseline_edge_cases():
    mask = t([1.0, 1.0], [1.0, 0.0])
    ids = torch.tensor([0, 1])
    # every group of size 1 and no KL: all returns 0, advantages 0
    adv, ret = reinforce_pp_baseline_advantages(t(1.0, 2.0), mask, ids)
    assert torch.equal(adv, torch.zeros(2, 2, dtype=F64)) and torch.equal(ret, torch.zeros(2, 2, dtype=F64))
    # empty mask: zeros, no error; NaN on a fully masked row is ignored, on a valid row refused
    adv, _ = reinforce_pp_baseline_advantages(t(math.nan, 2.0), torch.zeros(2, 2, dtype=F64), ids)
    assert torch.equal(adv, torch.zeros(2, 2, dtype=F64))
    with pytest.raises(InputError, match="reinforce_pp_baseline_advantages: argument 'scores' expected finite"):
        reinforce_pp_baseline_advantages(t(math.nan, 2.0), mask, ids)
    with pytest.raises(
        InputError, match="argument 'kl' expected a per-token KL tensor since kl_coef=0.5, received None"
    ):
        reinforce_pp_baseline_advantages(t(1.0, 2.0), mask, ids, kl_coef=0.5)
    with pytest.raises(InputError, match="'eps'"):
        reinforce_pp_baseline_advantages(t(1.0, 2.0), mask, ids, eps=-1.0)
    with pytest.raises(InputError, match="'mask' expected a 0/1 mask"):
        reinforce_pp_baseline_advantages(t(1.0, 2.0), mask * 2, ids)
    with pytest.raises(ShapeError):
        reinforce_pp_baseline_advantages(t(1.0, 2.0, 3.0), mask, ids)


# ---------------------------------------------------------------------------------------------
# ReMax
# ---------------------------------------------------------------------------------------------
def test_remax_closed_form():
    close(remax_advantages(t(1.0, 0.5, 2.0), t(0.5, 0.5, 3.0)), t(0.5, 0.0, -1.0))
    # [n_groups, group_size] with one greedy score per prompt, and a masked row
    adv = remax_advantages(t([1.0, 2.0], [0.0, 4.0]), t(1.5, 1.0), valid=t([1.0, 1.0], [0.0, 1.0]))
    close(adv, t([-0.5, 0.5], [0.0, 3.0]))
    # one sample per prompt is ReMax's normal case; a masked NaN is ignored
    close(remax_advantages(t(math.nan, 2.0), t(0.0, 1.0), valid=t(0.0, 1.0)), t(0.0, 1.0))
    with pytest.raises(
        InputError,
        match=r"remax_advantages: argument 'greedy_scores' expected a tensor of shape "
        r"\(2, 2\) or \(2,\), received f64\[3\]",
    ):
        remax_advantages(t([1.0, 2.0], [0.0, 4.0]), t(1.0, 2.0, 3.0))
    with pytest.raises(InputError, match="'greedy_scores' expected finite"):
        remax_advantages(t(1.0, 2.0), t(1.0, math.inf))


# ---------------------------------------------------------------------------------------------
# OPO
# ---------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 10), n_groups=st.integers(1, 4))
def test_opo_matches_loop(seed, n, n_groups):
    scores, ids, valid = random_groups(seed, n, n_groups)
    lengths = torch.randint(0, 6, (n,), generator=torch.Generator().manual_seed(seed + 1))
    adv = opo_advantages(scores, lengths, ids, valid=valid)
    expected = [0.0] * n
    for rows in groups_of(ids.tolist(), valid.tolist()).values():
        total = sum(int(lengths[i]) for i in rows)
        if len(rows) < 2 or total == 0:
            continue
        base = sum(int(lengths[i]) * float(scores[i]) for i in rows) / total
        for i in rows:
            expected[i] = float(scores[i]) - base
    close(adv, torch.tensor(expected, dtype=F64))


def test_opo_closed_form_and_edge_cases():
    # lengths 1 and 3: b = (1 * 1 + 3 * 0) / 4 = 0.25
    close(opo_advantages(t([1.0, 0.0]), torch.tensor([[1, 3]])), t([0.75, -0.25]))
    close(opo_advantages(t([1.0, 0.0]), t([2.0, 2.0])), t([0.5, -0.5]))  # equal lengths: GRPO's mean
    close(opo_advantages(t([5.0]), torch.tensor([[4]])), t([0.0]))  # group of size 1
    close(opo_advantages(t([1.0, 0.0]), torch.tensor([[0, 0]])), t([0.0, 0.0]))  # no tokens at all
    close(
        opo_advantages(t([1.0, 0.0, 9.0]), torch.tensor([[1, 3, 1]]), valid=t([1.0, 1.0, 0.0])), t([0.75, -0.25, 0.0])
    )
    with pytest.raises(
        InputError, match=r"opo_advantages: argument 'lengths' expected finite values >= 0 on valid rows"
    ):
        opo_advantages(t([1.0, 0.0]), torch.tensor([[1, -3]]))
    with pytest.raises(InputError, match="argument 'lengths' expected a tensor of the shape of scores"):
        opo_advantages(t([1.0, 0.0]), torch.tensor([1, 3]))


# ---------------------------------------------------------------------------------------------
# GPG
# ---------------------------------------------------------------------------------------------
def gpg_reference(scores, ids, valid, normalize, eps, counts=None):
    groups = groups_of(ids.tolist(), valid.tolist())
    informative = {gid for gid, rows in groups.items() if len(rows) > 1 and len({float(scores[i]) for i in rows}) > 1}
    b = sum(len(rows) for rows in groups.values())
    b_valid = sum(len(groups[gid]) for gid in informative)
    if counts is not None:
        b, b_valid = (float(c) for c in counts)
    alpha = b / b_valid if b_valid > 0 else 0.0
    out = [0.0] * len(scores)
    for gid in informative:
        rows = groups[gid]
        xs = [float(scores[i]) for i in rows]
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        for i, x in zip(rows, xs):
            out[i] = alpha * (x - mean) / ((std + eps) if normalize else 1.0)
    return torch.tensor(out, dtype=F64)


def test_gpg_closed_form():
    # B = 6 rows; group 1 is constant (uninformative) -> B_valid = 4, alpha = 1.5
    scores = t([1.0, 0.0], [1.0, 1.0], [2.0, 0.0])
    close(gpg_advantages(scores), t([0.75, -0.75], [0.0, 0.0], [1.5, -1.5]))
    close(gpg_batch_counts(scores), torch.tensor([6.0, 4.0], dtype=F64))
    # normalize_std: (s - mean) / (std + eps), std of (1, 0) = sqrt(1/2)
    close(
        gpg_advantages(scores, normalize_std=True, eps=0.0),
        1.5 * t([0.5, -0.5], [0.0, 0.0], [1.0, -1.0]) / t([math.sqrt(0.5)] * 2, [1.0] * 2, [math.sqrt(2.0)] * 2),
    )
    # nothing informative: zeros; an explicit batch_counts overrides this call's
    close(gpg_advantages(t([1.0, 1.0], [3.0, 3.0])), torch.zeros(2, 2, dtype=F64))
    close(gpg_advantages(t([1.0, 0.0]), batch_counts=torch.tensor([8.0, 2.0], dtype=F64)), t([2.0, -2.0]))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 10),
    n_groups=st.integers(1, 4),
    ties=st.booleans(),
    normalize=st.booleans(),
)
def test_gpg_matches_loop(seed, n, n_groups, ties, normalize):
    scores, ids, valid = random_groups(seed, n, n_groups, ties=ties)
    close(
        gpg_advantages(scores, ids, valid=valid, normalize_std=normalize, eps=1e-3),
        gpg_reference(scores, ids, valid, normalize, 1e-3),
    )


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 12), cut=st.integers(1, 3))
def test_gpg_split_invariance(seed, n, cut):
    scores, ids, valid = random_groups(seed, n, 4, ties=True)
    whole = gpg_advantages(scores, ids, valid=valid)
    parts = [ids < cut * 7 - 3, ids >= cut * 7 - 3]  # whole groups per part
    counts = sum(gpg_batch_counts(scores[p], ids[p], valid=valid[p]) for p in parts)
    for p in parts:
        close(gpg_advantages(scores[p], ids[p], valid=valid[p], batch_counts=counts), whole[p])


def test_gpg_validation():
    with pytest.raises(
        InputError,
        match=r"gpg_advantages: argument 'batch_counts' expected finite "
        r"\(B, B_valid\) with 0 <= B_valid <= B, received \[1.0, 2.0\]",
    ):
        gpg_advantages(t([1.0, 0.0]), batch_counts=torch.tensor([1.0, 2.0], dtype=F64))
    with pytest.raises(InputError, match="'scores' expected finite"):
        gpg_advantages(t([1.0, math.nan]))
    with pytest.raises(InputError, match="'eps'"):
        gpg_advantages(t([1.0, 0.0]), eps=math.inf)


# ---------------------------------------------------------------------------------------------
# Optimal token baseline
# ---------------------------------------------------------------------------------------------
def otb_reference(rewards, mask, ids, logprobs, spi2, isw=None):
    """Per group and response position (k-th valid token), plain Python."""
    b, s = mask.shape
    ret = torch.zeros(b, s, dtype=F64)
    energy = torch.zeros(b, s, dtype=F64)
    position = {}
    for i in range(b):
        valid_cols = [j for j in range(s) if mask[i, j] != 0]
        to_go = 0.0
        for j in reversed(valid_cols):
            to_go += float(rewards[i, j])
            ret[i, j] = to_go
        acc = 0.0
        for k, j in enumerate(valid_cols):
            w = max(1.0 - 2.0 * math.exp(float(logprobs[i, j])) + float(spi2[i, j]), 0.0)
            if isw is not None:
                w *= float(isw[i, j]) ** 2
            acc += w
            energy[i, j] = acc
            position[(i, j)] = k
    cells: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for (i, j), k in position.items():
        cells.setdefault((int(ids[i]), k), []).append((i, j))
    adv = torch.zeros(b, s, dtype=F64)
    for members in cells.values():
        if len(members) < 2:
            continue
        den = sum(float(energy[i, j]) for i, j in members)
        if den > 0:
            base = sum(float(ret[i, j]) * float(energy[i, j]) for i, j in members) / den
        else:
            base = sum(float(ret[i, j]) for i, j in members) / len(members)
        for i, j in members:
            adv[i, j] = float(ret[i, j]) - base
    return adv, ret


def random_otb_batch(seed, b, s, n_groups):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, 5, generator=g, dtype=F64) * 2
    probs = torch.softmax(logits, -1)
    tokens = torch.randint(0, 5, (b, s), generator=g)
    logprobs = torch.log(probs.gather(-1, tokens[..., None]))[..., 0]
    spi2 = (probs * probs).sum(-1)
    mask = (torch.rand(b, s, generator=g) < 0.75).to(F64)
    rewards = torch.randn(b, s, generator=g, dtype=F64) * (torch.rand(b, s, generator=g) < 0.3)
    ids = torch.randint(0, n_groups, (b,), generator=g)
    isw = torch.rand(b, s, generator=g, dtype=F64) * 2
    return rewards, mask, ids, logprobs, spi2, isw


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 7),
    s=st.integers(1, 7),
    n_groups=st.integers(1, 3),
    with_is=st.booleans(),
)
def test_optimal_token_baseline_matches_loop(seed, b, s, n_groups, with_is):
    rewards, mask, ids, logprobs, spi2, isw = random_otb_batch(seed, b, s, n_groups)
    isw = isw if with_is else None
    adv, ret = optimal_token_baseline_advantages(rewards, mask, ids, logprobs, spi2, is_weights=isw)
    adv_ref, ret_ref = otb_reference(rewards, mask, ids, logprobs, spi2, isw)
    close(ret, ret_ref)
    close(adv, adv_ref)


def test_optimal_token_baseline_closed_form():
    # Two rows of one group, responses of 2 tokens; the second row's tokens sit after a hole.
    mask = t([1.0, 1.0, 0.0], [0.0, 1.0, 1.0])
    rewards = t([0.0, 1.0, 0.0], [0.0, 0.0, 3.0])
    # pi = 1/2 for every sampled token, sum pi^2 = 1/2 -> w = 1 - 1 + 1/2 = 1/2 for row 0;
    # row 1: pi = 1/4, sum pi^2 = 1/4 -> w = 1 - 1/2 + 1/4 = 3/4
    logprobs = torch.log(t([0.5, 0.5, 0.5], [0.25, 0.25, 0.25]))
    spi2 = t([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
    adv, ret = optimal_token_baseline_advantages(rewards, mask, torch.tensor([4, 4]), logprobs, spi2)
    close(ret, t([1.0, 1.0, 0.0], [0.0, 3.0, 3.0]))
    # position 1: W = 1/2 and 3/4 -> B = (1 * 1/2 + 3 * 3/4) / (5/4) = 2.2
    # position 2: W = 1 and 3/2   -> B = (1 * 1 + 3 * 3/2) / (5/2) = 2.2
    close(adv, t([1.0 - 2.2, 1.0 - 2.2, 0.0], [0.0, 3.0 - 2.2, 3.0 - 2.2]))
    # groups of size 1 (and a lone tail position): advantage exactly 0
    adv, _ = optimal_token_baseline_advantages(rewards, mask, torch.tensor([4, 5]), logprobs, spi2)
    assert torch.equal(adv, torch.zeros(2, 3, dtype=F64))
    mask_tail = t([1.0, 1.0, 1.0], [0.0, 1.0, 1.0])
    adv, _ = optimal_token_baseline_advantages(rewards, mask_tail, torch.tensor([4, 4]), logprobs, spi2)
    assert adv[0, 2] == 0.0 and adv[0, 0] != 0.0
    # zero energy everywhere (deterministic tokens): the plain mean of the returns is the baseline
    adv, _ = optimal_token_baseline_advantages(
        rewards, mask, torch.tensor([4, 4]), torch.zeros(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64)
    )
    close(adv, t([-1.0, -1.0, 0.0], [0.0, 1.0, 1.0]))


def test_optimal_token_baseline_edge_cases():
    rewards, mask, ids, logprobs, spi2, _ = random_otb_batch(0, 3, 4, 1)
    adv, ret = optimal_token_baseline_advantages(rewards, torch.zeros(3, 4, dtype=F64), ids, logprobs, spi2)
    assert torch.equal(adv, torch.zeros(3, 4, dtype=F64)) and torch.equal(ret, torch.zeros(3, 4, dtype=F64))
    bad = logprobs.clone()
    bad[0, 0] = math.nan
    with pytest.raises(InputError, match="optimal_token_baseline_advantages: argument 'logprobs' expected finite"):
        optimal_token_baseline_advantages(rewards, torch.ones(3, 4, dtype=F64), ids, bad, spi2)
    masked = torch.ones(3, 4, dtype=F64)
    masked[0, 0] = 0.0
    optimal_token_baseline_advantages(rewards, masked, ids, bad, spi2)  # NaN under the mask is fine
    with pytest.raises(ShapeError):
        optimal_token_baseline_advantages(rewards, mask, ids[:2], logprobs, spi2)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(2, 7))
def test_token_estimators_permutation_equivariant(seed, b):
    """Permuting the rows permutes the outputs (group statistics do not depend on row order)."""
    rewards, mask, ids, logprobs, spi2, isw = random_otb_batch(seed, b, 5, 2)
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(seed))
    a, r = optimal_token_baseline_advantages(rewards, mask, ids, logprobs, spi2, is_weights=isw)
    ap, rp = optimal_token_baseline_advantages(
        rewards[perm], mask[perm], ids[perm], logprobs[perm], spi2[perm], is_weights=isw[perm]
    )
    close(ap, a[perm])
    close(rp, r[perm])
    scores = rewards.sum(-1)
    a, _ = reinforce_pp_baseline_advantages(scores, mask, ids, kl=isw, kl_coef=0.2)
    ap, _ = reinforce_pp_baseline_advantages(scores[perm], mask[perm], ids[perm], kl=isw[perm], kl_coef=0.2)
    torch.testing.assert_close(ap, a[perm], rtol=1e-12, atol=1e-12)
    lengths = mask.sum(-1)
    close(opo_advantages(scores[perm], lengths[perm], ids[perm]), opo_advantages(scores, lengths, ids)[perm])
    close(gpg_advantages(scores[perm], ids[perm]), gpg_advantages(scores, ids)[perm])


# ---------------------------------------------------------------------------------------------
# Shared: no input mutation, dtypes
# ---------------------------------------------------------------------------------------------
def _all_new_estimators():
    rewards, mask, ids, logprobs, spi2, isw = random_otb_batch(3, 4, 5, 2)
    scores = rewards.sum(-1)
    valid = t(1.0, 1.0, 0.0, 1.0)
    lengths = mask.sum(-1)
    return [
        (pass_at_k_advantages, (scores, ids), dict(k=1, valid=valid)),
        (reinforce_pp_baseline_advantages, (scores, mask, ids), dict(kl=isw, kl_coef=0.1)),
        (masked_moments, (rewards, mask), {}),
        (remax_advantages, (scores, scores.flip(0)), dict(valid=valid)),
        (opo_advantages, (scores, lengths, ids), dict(valid=valid)),
        (gpg_advantages, (scores, ids), dict(valid=valid, normalize_std=True)),
        (gpg_batch_counts, (scores, ids), dict(valid=valid)),
        (optimal_token_baseline_advantages, (rewards, mask, ids, logprobs, spi2), dict(is_weights=isw)),
    ]


@pytest.mark.parametrize("index", range(8))
def test_new_estimators_do_not_modify_inputs(index):
    fn, args, kwargs = _all_new_estimators()[index]
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    copies, versions = [a.clone() for a in tensors], [a._version for a in tensors]
    fn(*args, **kwargs)
    for a, c, v in zip(tensors, copies, versions, strict=True):
        assert a._version == v and torch.equal(a, c)


@pytest.mark.parametrize("index", [0, 1, 3, 4, 5, 7])
def test_new_estimators_float32_in_float32_out(index):
    fn, args, kwargs = _all_new_estimators()[index]
    cast = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    kw = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()}
    out64, out32 = fn(*args, **kwargs), fn(*cast, **kw)
    out64 = out64 if isinstance(out64, tuple) else (out64,)
    out32 = out32 if isinstance(out32, tuple) else (out32,)
    for a, b in zip(out32, out64, strict=True):
        assert a.dtype == torch.float32 and b.dtype == F64
        torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# whiten
# ---------------------------------------------------------------------------------------------
def _whiten_reference(x, mask, shift=True, eps=1e-8):
    """numpy in float64: mean and Bessel-corrected variance over the valid entries."""
    import numpy as np

    xs, ms = x.double().numpy(), mask.numpy() != 0
    valid = xs[ms]
    mean = valid.mean() if shift else 0.0
    out = np.where(ms, (xs - mean) / np.sqrt(valid.var(ddof=1) + eps), 0.0)
    return torch.from_numpy(out)


@pytest.mark.parametrize("shift", [True, False])
def test_whiten_matches_numpy_and_keeps_masked_zero(shift):
    from fnppo.advantages import whiten

    g = torch.Generator().manual_seed(0)
    x = 3.0 + 2.0 * torch.randn(4, 7, generator=g)
    mask = (torch.rand(4, 7, generator=g) > 0.3).to(torch.int64)
    x_masked_nan = torch.where(mask != 0, x, torch.full_like(x, float("nan")))  # masked values are ignored
    out = whiten(x_masked_nan, mask, shift_mean=shift)
    assert out.dtype == x.dtype
    torch.testing.assert_close(out.double(), _whiten_reference(x, mask, shift), atol=1e-6, rtol=0)
    assert torch.all(out[mask == 0] == 0)
    if shift:
        valid = out[mask != 0].double()
        assert abs(valid.mean().item()) < 1e-6 and abs(valid.std().item() - 1) < 1e-6


def test_whiten_parts_with_batch_moments_equal_the_whole():
    from fnppo.advantages import masked_moments, whiten

    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.2).to(torch.int64)
    whole = whiten(x, mask)
    moments = masked_moments(x[:2], mask[:2]) + masked_moments(x[2:], mask[2:])
    parts = torch.cat([whiten(x[:2], mask[:2], batch_moments=moments), whiten(x[2:], mask[2:], batch_moments=moments)])
    torch.testing.assert_close(parts, whole, atol=1e-12, rtol=0)
    assert not torch.allclose(whiten(x[:2], mask[:2]), whole[:2])  # local statistics differ


def test_whiten_constant_values_and_bad_inputs():
    from fnppo.advantages import whiten

    x, mask = torch.full((2, 3), 5.0), torch.ones(2, 3, dtype=torch.int64)
    assert torch.all(whiten(x, mask, eps=0.0) == 0)
    with pytest.raises(InputError, match="eps"):
        whiten(x, mask, eps=-1.0)
    with pytest.raises(InputError, match="batch_moments"):
        whiten(x, mask, batch_moments=torch.tensor([-1.0, 0.0, 0.0], dtype=torch.float64))
    with pytest.raises(InputError, match="values"):
        whiten(torch.tensor([[float("nan"), 1.0]]), torch.ones(1, 2, dtype=torch.int64))


# =============================================================================================
# GDPO and MaxRL: float64 loops from the formulas, at 1e-12
# =============================================================================================
def _loop_groups(ids: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, gid in enumerate(ids):
        groups.setdefault(gid, []).append(i)
    return groups


@pytest.mark.parametrize("eps", [1e-6, 0.25])
@pytest.mark.parametrize("seed", range(5))
def test_gdpo_matches_float64_loop(seed, eps):
    from fnppo.core.advantages import gdpo_advantages

    g = torch.Generator().manual_seed(seed)
    n, k = 12, 3
    rewards = torch.randint(0, 3, (n, k), generator=g).double() + 0.1 * torch.rand(
        n, k, generator=g, dtype=torch.float64
    )
    ids = torch.randint(0, 4, (n,), generator=g)
    ids[0] = 99  # a group of one
    weights = torch.rand(k, generator=g, dtype=torch.float64) + 0.5
    got = gdpo_advantages(rewards, ids, weights=weights, eps=eps)
    groups = _loop_groups(ids.tolist())
    total = [0.0] * n
    for col in range(k):
        r = rewards[:, col].tolist()
        for members in groups.values():
            if len(members) < 2:
                continue
            mean = sum(r[i] for i in members) / len(members)
            std = math.sqrt(sum((r[i] - mean) ** 2 for i in members) / (len(members) - 1))
            for i in members:
                total[i] += float(weights[col]) * (r[i] - mean) / (std + eps)
    mean = sum(total) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in total) / (n - 1))
    want = torch.tensor([(x - mean) / (std + eps) for x in total], dtype=torch.float64)
    assert (got - want).abs().max().item() <= 1e-12
    # summing first (GRPO on the summed reward) is a different estimator
    assert not torch.allclose(got, grpo_advantages(rewards @ weights, ids))


def test_gdpo_keeps_reward_combinations_apart():
    """The paper's example: a group with rewards (0, 1) and (0, 2) on two binary rewards; GRPO on the
    sum gives the same advantages to (0,1)-vs-(1,1) and (0,2)-vs-..., GDPO does not collapse them."""
    from fnppo.core.advantages import gdpo_advantages

    a = gdpo_advantages(torch.tensor([[0.0, 0.0], [1.0, 1.0]]), torch.tensor([0, 0]))
    b = gdpo_advantages(torch.tensor([[0.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]))
    assert a[1] > 0 and b[1] > 0 and a.tolist() == pytest.approx(b.tolist())  # whitened: both +-0.707
    assert a[1].item() == pytest.approx(1 / math.sqrt(2), rel=1e-5)


@pytest.mark.parametrize("eps", [1e-6, 0.25])
@pytest.mark.parametrize("seed", range(5))
def test_maxrl_matches_float64_loop(seed, eps):
    from fnppo.core.advantages import maxrl_advantages

    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 2, (15,), generator=g).double()
    ids = torch.randint(0, 5, (15,), generator=g)
    ids[3] = 77  # a group of one: 0
    got = maxrl_advantages(scores, ids, eps=eps)
    want = [0.0] * 15
    for members in _loop_groups(ids.tolist()).values():
        if len(members) < 2:
            continue
        mean = sum(float(scores[i]) for i in members) / len(members)
        for i in members:
            want[i] = (float(scores[i]) - mean) / (mean + eps) if mean + eps else 0.0
    assert (got - torch.tensor(want, dtype=torch.float64)).abs().max().item() <= 1e-12
    rows = maxrl_advantages(scores[:12].reshape(3, 4))  # the [groups, size] form: the same rule
    assert torch.equal(rows.reshape(-1), maxrl_advantages(scores[:12], torch.arange(3).repeat_interleave(4)))
    # a success in a group passing 1 of 4: (1 - 1/4) / (1/4) = 3
    assert maxrl_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)[0, 0].item() == 3.0
    with raises_message("maxrl_advantages", "eps", "a finite number >= 0", "-1.0"):
        maxrl_advantages(scores, ids, eps=-1.0)


def test_maxrl_refuses_negative_scores():
    """Negative scores gave +-1e6 and flipped a success's sign ((s - mean) / mean with mean <= 0)."""
    from fnppo.core.advantages import maxrl_advantages

    for eps in (1e-6, 0.5):
        with raises_message("maxrl_advantages", "scores", "scores >= 0", "with min -1.0"):
            maxrl_advantages(torch.tensor([[1.0, -1.0, 0.5, 0.0]]), eps=eps)
    # scores in [0, 1] that are not 0/1 (probabilities of success) are fine; all zero: 0
    got = maxrl_advantages(torch.tensor([[0.5, 0.25, 0.0, 0.0]], dtype=torch.float64), eps=0.0)
    assert got.tolist() == [[(0.5 - 0.1875) / 0.1875, (0.25 - 0.1875) / 0.1875, -1.0, -1.0]]
    assert maxrl_advantages(torch.zeros(2, 3), eps=0.0).tolist() == [[0.0] * 3] * 2


def test_gdpo_refuses_rewards_without_a_column_and_gives_zeros_for_equal_rewards():
    """No reward column raised torch's "stack expects a non-empty TensorList"; all-equal (e.g. all-zero)
    rewards have no signal: every advantage exactly 0, whatever eps."""
    from fnppo.core.advantages import gdpo_advantages

    with raises_message("gdpo_advantages", "rewards", "k >= 1 reward columns", "[4,0]"):
        gdpo_advantages(torch.zeros(4, 0), torch.tensor([0, 0, 1, 1]))
    for eps in (0.0, 1e-6, 0.5):
        assert gdpo_advantages(torch.zeros(4, 2), torch.tensor([0, 0, 1, 1]), eps=eps).tolist() == [0.0] * 4
