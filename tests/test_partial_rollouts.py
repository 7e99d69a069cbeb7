"""Per-token policy versions (partial rollouts), one process: ``Sample.versions`` / ``Sample.staleness``,
their collation, ``Staleness.prepare`` (ages, refusals, expiry, metrics) and ``loglinear_decoupled``
with each token's own age against a float64 loop written from AReaL's formula.

The step over real Megatron ranks (every split and layout) is ``tests/test_partial_rollouts_step.py``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fnppo
from fnppo.batching import pad_microbatch, unpack_per_sample
from fnppo.core.batching.context_parallel import shard_microbatch, shard_tokens, unshard_tokens
from fnppo.core.losses import LossConfig, Staleness, loglinear_decoupled, ppo_loss
from fnppo.core.metrics import finalize_metrics
from tests.loss_helpers import (
    float64_default,  # noqa: F401 - float64 default dtype for this module
    grad_of,
    leaf,
    random_batch,
    unchanged_check,
)
from tests.messages import raises_message

EXACT = {"rtol": 1e-12, "atol": 1e-12}


def _samples(n: int = 5, seed: int = 0, *, versions: bool = True, masks: bool = True) -> list[fnppo.Sample]:
    """Samples of varied lengths with rollout log-probs and non-decreasing per-token versions in [6, 10]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = 1 + i % 3, 2 + (3 * i) % 5
        v = (6 + torch.randint(0, 3, (1,), generator=g) + torch.randint(0, 2, (r,), generator=g).cumsum(0)).clamp_max(
            10
        )
        mask = None
        if masks and i % 2 == 1:
            mask = torch.ones(r)
            mask[0] = 0.0
        out.append(
            fnppo.Sample(
                prompt_ids=torch.randint(0, 50, (p,), generator=g),
                response_ids=torch.randint(0, 50, (r,), generator=g),
                advantages=torch.randn(r, generator=g),
                rollout_logprobs=-1.5 + 0.3 * torch.randn(r, generator=g),
                old_logprobs=-1.5 + 0.3 * torch.randn(r, generator=g),
                response_mask=mask,
                versions=v if versions else None,
            )
        )
    return out


# =============================================================================================
# Sample and collation
# =============================================================================================
def test_sample_carries_versions_and_from_lists_broadcasts_one_version():
    s = fnppo.Sample.from_lists([1, 2], [3, 4, 5], versions=[4, 5, 5], staleness=2)
    assert s.versions.dtype == torch.int64 and s.versions.tolist() == [4, 5, 5]
    assert s.staleness.tolist() == [2, 2, 2]  # a scalar: one value per sample
    kept = fnppo.Sample(torch.tensor([1]), torch.tensor([2, 3]), versions=torch.tensor([1, 2], dtype=torch.int16))
    assert kept.versions.dtype == torch.int16  # any integer dtype, as given
    empty = fnppo.Sample.from_lists([1], [], versions=[])
    assert empty.versions.shape == (0,)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_collate_places_each_tokens_age_at_its_label_position(layout):
    samples, _ = Staleness(max_staleness=4).prepare(_samples(), current_version=10)
    mb = fnppo.collate_microbatch(samples, layout=layout, pad_to_multiple_of=4)
    assert mb.staleness.dtype == torch.float32 and mb.staleness.shape == mb.loss_mask.shape
    expected = torch.zeros_like(mb.staleness)  # a loop over the documented alignment: position P - 1 + j
    offset = 0
    for i, s in enumerate(samples):
        row, start = (0, offset) if layout == "packed" else (i, 0)
        for j in range(s.response_len):
            expected[row, start + s.prompt_len - 1 + j] = float(10 - int(s.versions[j]))
        offset += mb.segment_lens[i]
    assert torch.equal(mb.staleness, expected)
    for s, back in zip(samples, unpack_per_sample(mb.staleness, mb), strict=True):
        assert torch.equal(back, s.staleness.float())
    longer = pad_microbatch(mb, mb.input_ids.shape[1] + 3)
    assert longer.staleness.shape == longer.input_ids.shape
    assert torch.equal(longer.staleness[:, : mb.staleness.shape[1]], mb.staleness)
    assert not longer.staleness[:, mb.staleness.shape[1] :].any()
    assert fnppo.collate_microbatch(_samples(versions=False), layout=layout).staleness is None


def test_context_parallel_shards_carry_their_tokens_ages():
    samples, _ = Staleness(max_staleness=4).prepare(_samples(6), current_version=10)
    mb = fnppo.collate_microbatch(samples, layout="packed", pad_to_multiple_of=4)  # 2 * cp
    shards = [shard_microbatch(mb, 2, rank) for rank in range(2)]
    for rank, shard in enumerate(shards):
        assert torch.equal(shard.staleness, shard_tokens(mb.staleness, mb.cu_seqlens, 2, rank))
        assert torch.equal(shard.staleness != 0, shard_tokens(mb.staleness != 0, mb.cu_seqlens, 2, rank))
    assert torch.equal(unshard_tokens([s.staleness for s in shards], mb.cu_seqlens), mb.staleness)


# =============================================================================================
# Staleness.prepare
# =============================================================================================
def _loop_metrics(samples, current, max_staleness):
    """Token-level metrics by a loop over the tokens in the loss (response_mask 1) before expiry."""
    ages, expired = [], 0
    for s in samples:
        for j in range(s.response_len):
            if s.response_mask is None or float(s.response_mask[j]) != 0:
                age = current - int(s.versions[j])
                ages.append(age)
                expired += age > max_staleness
    return sum(ages) / len(ages), float(max(ages)), expired / len(ages)


def test_prepare_gives_each_token_its_age_and_leaves_the_batch_unchanged():
    batch = _samples()
    check = unchanged_check(
        {f"{i}.{k}": getattr(s, k) for i, s in enumerate(batch) for k in ("versions", "advantages")}
    )
    out, m = Staleness(max_staleness=4, proximal="behaviour").prepare(batch, current_version=10)
    check()
    assert all(s.staleness is None for s in batch)
    for s, o in zip(batch, out, strict=True):
        assert o.staleness.tolist() == [10 - int(v) for v in s.versions]
        assert o.response_mask is s.response_mask and torch.equal(o.versions, s.versions)
    mean, top, frac = _loop_metrics(batch, 10, 4)
    assert m == {
        "offpolicy/token_staleness_mean": pytest.approx(mean, rel=1e-12),
        "offpolicy/token_staleness_max": top,
        "offpolicy/expired_token_frac": frac,
        "offpolicy/old_logprob_forward": 0.0,
    }
    assert frac == 0.0 and top >= 3.0 and 0.0 < mean < top  # varied ages, none expired


@pytest.mark.parametrize("mask_dtype", [None, torch.float32, torch.bool, torch.int64])
def test_expire_tokens_masks_the_older_tokens_and_counts_them(mask_dtype):
    batch = _samples(masks=False)
    if mask_dtype is not None:  # a mask that already leaves out one of the tokens to expire
        i = next(i for i, s in enumerate(batch) if bool((10 - s.versions > 2).any()))
        masks = [torch.ones(s.response_len, dtype=mask_dtype) for s in batch]
        masks[i] = masks[i].index_fill(0, (10 - batch[i].versions > 2).nonzero()[0], 0)
        batch = [dataclasses.replace(s, response_mask=m) for s, m in zip(batch, masks, strict=True)]
    out, m = Staleness(max_staleness=2, expire="tokens").prepare(batch, current_version=10)
    mean, top, frac = _loop_metrics(batch, 10, 2)
    assert 0.0 < frac < 1.0 and m["offpolicy/expired_token_frac"] == pytest.approx(frac, rel=1e-12)
    assert (
        m["offpolicy/token_staleness_mean"] == pytest.approx(mean, rel=1e-12)
        and m["offpolicy/token_staleness_max"] == top
    )
    for s, o in zip(batch, out, strict=True):
        before = torch.ones(s.response_len) if s.response_mask is None else s.response_mask.float()
        want = before * (10 - s.versions <= 2).float()
        got = o.response_mask if o.response_mask is not None else torch.ones(s.response_len)
        assert torch.equal(got.float(), want), (s.versions, got)
        assert o.response_mask is None or o.response_mask.dtype == (
            s.response_mask.dtype if s.response_mask is not None else torch.float32
        )
    # the expired tokens leave the loss: a micro-batch of the prepared samples has fewer tokens
    kept = fnppo.collate_microbatch(out).loss_mask.sum()
    assert float(kept) == pytest.approx((1 - frac) * fnppo.collate_microbatch(batch).loss_mask.sum())


def test_prepare_with_one_version_per_sample_matches_uniform_per_token_versions():
    bare = _samples(versions=False)
    per_sample, m1 = Staleness(max_staleness=3).prepare(bare, current_version=9, versions=[9, 8, 7, 6, 9])
    per_token = [
        dataclasses.replace(s, versions=torch.full((s.response_len,), v)) for s, v in zip(bare, [9, 8, 7, 6, 9])
    ]
    tokens, m2 = Staleness(max_staleness=3).prepare(per_token, current_version=9)
    assert m1 == m2
    for a, b in zip(per_sample, tokens, strict=True):
        assert torch.equal(a.staleness, b.staleness) and a.versions is None


# =============================================================================================
# loglinear_decoupled with per-token ages
# =============================================================================================
def _ages(seed: int, shape: tuple[int, int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6, shape, generator=g).double()  # 0 and 1 included: alpha 0


def test_loglinear_decoupled_with_per_token_ages_matches_float64_loop():
    """alpha = (K - 1) / K with each token's own K (0 for K <= 1): value and gradient at 1e-12."""
    lp0, _, adv, mask, _, _, rollout = random_batch(71, 4, 6)
    ages = _ages(3, (4, 6))
    cfg = LossConfig(policy=loglinear_decoupled(staleness=4, weight_cap=1.05), bypass_old_logprobs=True)
    lp = leaf(lp0)
    loss, m = ppo_loss(lp, None, adv, mask, cfg, rollout_logprobs=rollout, staleness=ages)
    lp64 = leaf(lp0)
    terms, seen = [], set()
    for p in [(b, j) for b in range(4) for j in range(6) if mask[b, j] != 0]:
        k = int(ages[p])
        seen.add(k)
        alpha = (k - 1) / k if k > 1 else 0.0
        a, behav = float(adv[p]), float(rollout[p])
        prox = behav + alpha * (float(lp64[p].detach()) - behav)
        w = min(math.exp(prox - behav), 1.05)
        r = torch.exp(lp64[p] - prox)
        pg = torch.maximum(-a * r, -a * torch.clamp(r, 0.8, 1.2))
        pg = torch.minimum(pg, torch.tensor(-a * 3.0, dtype=torch.float64)) if a < 0 else pg
        terms.append(w * pg)
    assert {0, 1} & seen and len(seen) >= 4  # several ages, and some with alpha = 0
    expected = sum(terms) / len(terms)
    torch.testing.assert_close(loss, expected, **EXACT)
    torch.testing.assert_close(grad_of(loss, lp), grad_of(expected, lp64), **EXACT)
    got = finalize_metrics(m)
    assert got["token_staleness"] == pytest.approx(float((ages * mask).sum() / mask.sum()), rel=1e-6)
    scalar, _ = ppo_loss(lp0, None, adv, mask, cfg, rollout_logprobs=rollout)  # the loss's own K = 4 for every token
    assert abs(float(scalar) - float(loss)) > 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 7])
def test_uniform_per_token_ages_give_the_per_sample_loss_bit_for_bit(dtype, k):
    lp0, _, adv, mask, _, _, rollout = (t.to(dtype) for t in random_batch(5 + k, 3, 7))
    cfg = LossConfig(policy=loglinear_decoupled(staleness=k, weight_cap=2.0), bypass_old_logprobs=True)
    lp_a, lp_b = leaf(lp0), leaf(lp0)
    scalar, m_a = ppo_loss(lp_a, None, adv, mask, cfg, rollout_logprobs=rollout)
    ages = torch.full_like(lp0, float(k)).masked_fill(mask == 0, 123.0)  # off the mask: never read
    tokens, m_b = ppo_loss(lp_b, None, adv, mask, cfg, rollout_logprobs=rollout, staleness=ages)
    assert torch.equal(scalar, tokens)
    assert torch.equal(grad_of(scalar, lp_a), grad_of(tokens, lp_b))
    assert all(torch.equal(m_a[key], m_b[key]) for key in m_a)


@pytest.mark.parametrize("cuts", [(1,), (1, 3), (2, 3)])
def test_per_token_ages_are_split_invariant(cuts):
    lp0, _, adv, mask, _, _, rollout = random_batch(11, 4, 5)
    ages = _ages(12, (4, 5))
    cfg = LossConfig(policy=loglinear_decoupled(staleness=2), bypass_old_logprobs=True)
    lp = leaf(lp0)
    full, _ = ppo_loss(lp, None, adv, mask, cfg, rollout_logprobs=rollout, staleness=ages)
    bounds = [0, *cuts, 4]
    lp2 = leaf(lp0)
    n = mask.sum()
    parts = [
        ppo_loss(
            lp2[i:j], None, adv[i:j], mask[i:j], cfg, rollout_logprobs=rollout[i:j], staleness=ages[i:j], normalizer=n
        )[0]
        for i, j in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    torch.testing.assert_close(sum(parts), full, **EXACT)
    torch.testing.assert_close(grad_of(sum(parts), lp2), grad_of(full, lp), **EXACT)


def test_packed_and_padded_micro_batches_give_the_same_loss():
    samples, _ = Staleness(max_staleness=4, proximal="behaviour").prepare(_samples(6, seed=3), current_version=10)
    cfg = LossConfig(policy=loglinear_decoupled(staleness=4), bypass_old_logprobs=True)
    out = {}
    for layout in ("packed", "padded"):
        mb = fnppo.collate_microbatch(samples, layout=layout, pad_to_multiple_of=2)
        lp = leaf(mb.old_logprobs.double())  # stands in for the model's log-probs
        loss, _ = ppo_loss(
            lp,
            None,
            mb.advantages.double(),
            mb.loss_mask,
            cfg,
            rollout_logprobs=mb.rollout_logprobs.double(),
            staleness=mb.staleness,
            seq_ids=mb.seq_ids,
        )
        out[layout] = (loss, unpack_per_sample(grad_of(loss, lp), mb))
    torch.testing.assert_close(out["packed"][0], out["padded"][0], **EXACT)
    for a, b in zip(out["packed"][1], out["padded"][1], strict=True):
        torch.testing.assert_close(a, b, **EXACT)


# =============================================================================================
# Refused by name, before anything changes
# =============================================================================================
R3 = torch.tensor([3, 4, 5])


def _sample(**kw):
    return fnppo.Sample(prompt_ids=torch.tensor([1, 2]), response_ids=R3, **kw)


def _prepare(batch, current=10, **kw):
    return Staleness(max_staleness=kw.pop("max_staleness", 2), **kw).prepare(batch, current)


def _two(v0, v1):
    return [_sample(versions=v0), _sample(versions=v1)]


def _loss_with_ages(ages):
    x = torch.full((1, 3), -1.0)
    cfg = LossConfig(policy=loglinear_decoupled(staleness=2), bypass_old_logprobs=True)
    return ppo_loss(x, None, x, torch.tensor([[1.0, 1.0, 0.0]]), cfg, rollout_logprobs=x, staleness=ages)


REFUSALS = {
    "versions-float": (
        lambda: _sample(versions=torch.tensor([1.0, 2.0, 3.0], dtype=torch.float32)),
        "Sample",
        "versions",
        "1-D integer tensor of length 3",
        "f32[3]",
    ),
    "versions-bool": (
        lambda: _sample(versions=torch.tensor([True, False, True])),
        "Sample",
        "versions",
        "1-D integer tensor",
        "bool[3]",
    ),
    "versions-list": (
        lambda: _sample(versions=[1, 2, 3]),
        "Sample",
        "versions",
        "1-D integer tensor",
        "list [1, 2, 3]",
    ),
    "versions-2d": (
        lambda: _sample(versions=torch.ones(3, 1, dtype=torch.long)),
        "Sample",
        "versions",
        "1-D integer tensor",
        "i64[3,1]",
    ),
    "versions-wrong-length": (
        lambda: _sample(versions=torch.tensor([1, 2])),
        "Sample",
        "versions",
        "length 3 (the response length)",
        "i64[2]",
    ),
    "versions-negative": (
        lambda: _sample(versions=torch.tensor([1, -1, 2])),
        "Sample",
        "versions",
        "integers >= 0",
        "minimum -1",
    ),
    "staleness-negative": (
        lambda: _sample(staleness=torch.tensor([0, 0, -2])),
        "Sample",
        "staleness",
        "integers >= 0",
        "minimum -2",
    ),
    "from-lists-fractional": (
        lambda: fnppo.Sample.from_lists([1], [3, 4], versions=[1.5, 2]),
        "Sample",
        "versions",
        "integer tensor",
        "f64[2]",  # (the default dtype of this module: 1.5 is refused, never truncated to 1)
    ),
    "from-lists-str": (
        lambda: fnppo.Sample.from_lists([1], [3, 4], versions="12"),
        "Sample",
        "versions",
        "integer tensor",
        "str '12'",
    ),
    "collate-some-samples-only": (
        lambda: fnppo.collate_microbatch([_sample(versions=R3), _sample()]),
        "collate_microbatch",
        "samples[1].versions",
        "(samples[0] has versions; all samples or none)",
        "None",
    ),
    "prepare-newer": (
        lambda: _prepare(_two(R3 + 5, R3 + 6)),
        "Staleness.prepare",
        "batch[1].versions",
        "versions <= 10 (the version being trained",
        "token 2 of version 11 (staleness -1)",
    ),
    "prepare-older": (
        lambda: _prepare(_two(R3 + 5, R3 + 4)),
        "Staleness.prepare",
        "batch[1].versions",
        "versions in [8, 10] (max_staleness=2",
        "token 0 of version 7 (staleness 3)",
    ),
    "prepare-some-samples-only": (
        lambda: _prepare([_sample(versions=R3), _sample()]),
        "Staleness.prepare",
        "batch[1].versions",
        "all samples or none",
        "None",
    ),
    "prepare-no-versions": (
        lambda: _prepare([_sample()]),
        "Staleness.prepare",
        "batch[0].versions",
        "per-token versions on every sample",
        "None",
    ),
    "prepare-versions-twice": (
        lambda: Staleness(max_staleness=9).prepare([_sample(versions=R3)], 9, versions=[9]),
        "Staleness.prepare",
        "versions",
        "None when the samples carry per-token versions",
        "list of 1",
    ),
    "prepare-versions-per-sample-count": (
        lambda: Staleness(max_staleness=9).prepare([_sample()], 9, versions=[9, 9]),
        "Staleness.prepare",
        "versions",
        "a sequence of 1 ints (one per sample)",
        "2 versions",
    ),
    "prepare-versions-per-sample-bool": (
        lambda: Staleness(max_staleness=9).prepare([_sample()], 9, versions=[True]),
        "Staleness.prepare",
        "versions[0]",
        "an int >= 0",
        "True",
    ),
    "prepare-current-bool": (
        lambda: _prepare([_sample(versions=R3)], True),
        "Staleness.prepare",
        "current_version",
        "an int >= 0",
        "True",
    ),
    "prepare-current-negative": (
        lambda: _prepare([_sample(versions=R3)], -1),
        "Staleness.prepare",
        "current_version",
        "an int >= 0",
        "-1",
    ),
    "prepare-current-str": (
        lambda: _prepare([_sample(versions=R3)], "5"),
        "Staleness.prepare",
        "current_version",
        "an int >= 0",
        "'5'",
    ),
    "prepare-current-float": (
        lambda: _prepare([_sample(versions=R3)], 5.0),
        "Staleness.prepare",
        "current_version",
        "an int >= 0",
        "5.0",
    ),
    "prepare-empty": (
        lambda: _prepare([]),
        "Staleness.prepare",
        "batch",
        "a non-empty sequence of Sample",
        "an empty sequence",
    ),
    "expire-unknown": (
        lambda: Staleness(expire="sometimes"),
        "Staleness",
        "expire",
        "one of ['refuse', 'tokens']",
        "'sometimes'",
    ),
    "expire-bool": (lambda: Staleness(expire=True), "Staleness", "expire", "one of ['refuse', 'tokens']", "True"),
    "loss-ages-negative": (
        lambda: _loss_with_ages(torch.tensor([[1.0, -1.0, 0.0]])),
        "ppo_loss",
        "staleness",
        "whole numbers >= 0",
        "containing -1.0",
    ),
    "loss-ages-fractional": (
        lambda: _loss_with_ages(torch.tensor([[1.5, 1.0, 0.0]])),
        "ppo_loss",
        "staleness",
        "whole numbers >= 0",
        "containing 1.5",
    ),
    "loss-ages-nan": (
        lambda: _loss_with_ages(torch.tensor([[1.0, math.nan, 0.0]])),
        "ppo_loss",
        "staleness",
        "finite values",
        "1 NaN/inf",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_by_name(case):
    call, fn, arg, expected, received = REFUSALS[case]
    with raises_message(fn, arg, expected, received):
        call()


def test_ages_off_the_mask_are_never_read():
    """A negative, fractional or NaN age where the loss mask is 0 changes nothing."""
    good, _ = _loss_with_ages(torch.tensor([[1.0, 2.0, 0.0]]))
    for bad in (-3.0, 0.5, math.nan):
        got, _ = _loss_with_ages(torch.tensor([[1.0, 2.0, bad]]))
        assert torch.equal(got, good)


def test_a_refused_batch_changes_nothing():
    batch = _two(R3 + 5, R3 + 4)
    check = unchanged_check({f"{i}": s.versions for i, s in enumerate(batch)})
    with pytest.raises(fnppo.InputError):
        _prepare(batch)
    check()
    assert all(s.staleness is None and s.response_mask is None for s in batch)
