"""The teacher's top-k and the cross-entropy mask on samples and micro-batches: construction checks,
value checks, collation (packed and padded), context-parallel sharding and padding."""

from __future__ import annotations

import math

import pytest
import torch

from fnppo.core.batching.collate import collate_microbatch, pad_microbatch, unpack_per_sample
from fnppo.core.batching.context_parallel import shard_microbatch
from fnppo.core.batching.sample import Sample
from fnppo.core.batching.teacher import check_teacher_values
from fnppo.core.errors import InputError
from tests.messages import raises_message

V = 20


def _sample(p, r, k=3, seed=0, ce=None, mask=None):
    g = torch.Generator().manual_seed(seed)
    lq, ids = torch.log_softmax(torch.randn(r, V, generator=g), -1).topk(k, dim=-1)
    return Sample(
        prompt_ids=torch.randint(0, V, (p,), generator=g),
        response_ids=torch.randint(0, V, (r,), generator=g),
        teacher_topk_ids=ids,
        teacher_topk_logprobs=lq,
        ce_mask=ce,
        response_mask=mask,
    )


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_collation_puts_each_response_tokens_top_k_at_its_label_position(layout):
    samples = [
        _sample(3, 4, seed=1, ce=torch.tensor([1.0, 0.0, 1.0, 1.0])),
        _sample(2, 2, seed=2),
        _sample(5, 3, seed=3),
    ]
    mb = collate_microbatch(samples, layout=layout, pad_to_multiple_of=4)
    assert mb.teacher_topk_ids.shape[:2] == mb.input_ids.shape and mb.teacher_topk_ids.shape[2] == 3
    ids = mb.teacher_topk_ids
    lps = mb.teacher_topk_logprobs
    for i, s in enumerate(samples):
        row, off = (0, sum(mb.segment_lens[:i])) if layout == "packed" else (i, 0)
        start = off + s.prompt_len - 1
        assert torch.equal(ids[row, start : start + s.response_len], s.teacher_topk_ids)
        assert torch.equal(lps[row, start : start + s.response_len], s.teacher_topk_logprobs)
    outside = mb.loss_mask == 0
    assert bool((ids[outside] == 0).all()) and bool((lps[outside] == 0).all())
    # the CE mask: sample 0's own, the others' response masks (all ones), at the loss positions
    ce = unpack_per_sample(mb.ce_mask, mb)
    assert torch.equal(ce[0], samples[0].ce_mask) and torch.equal(ce[1], torch.ones(2))
    assert float(mb.ce_mask[outside].abs().sum()) == 0.0


def test_padding_and_context_parallel_shards_keep_the_top_k_with_its_token():
    samples = [_sample(3, 5, seed=4), _sample(2, 3, seed=5)]
    mb = collate_microbatch(samples, layout="packed", pad_to_multiple_of=4)
    padded = pad_microbatch(mb, mb.input_ids.shape[1] + 4)
    assert torch.equal(padded.teacher_topk_ids[:, : mb.input_ids.shape[1]], mb.teacher_topk_ids)
    assert float(padded.teacher_topk_logprobs[:, mb.input_ids.shape[1] :].abs().sum()) == 0.0
    shards = [shard_microbatch(mb, 2, r) for r in range(2)]
    for sh in shards:
        assert sh.teacher_topk_ids.shape[:2] == sh.labels.shape
    pairs = sorted(
        (tuple(sh.teacher_topk_ids[0, t].tolist()), int(sh.labels[0, t]), float(sh.loss_mask[0, t]))
        for sh in shards
        for t in range(sh.labels.shape[1])
    )
    whole = sorted(
        (tuple(mb.teacher_topk_ids[0, t].tolist()), int(mb.labels[0, t]), float(mb.loss_mask[0, t]))
        for t in range(mb.labels.shape[1])
    )
    assert pairs == whole


def test_sample_construction_refuses_bad_shapes():
    ids = torch.tensor([[1, 2], [3, 4]])
    lps = torch.tensor([[-0.1, -2.0], [-0.5, -1.0]])
    base = dict(prompt_ids=torch.tensor([1]), response_ids=torch.tensor([2, 3]))
    with raises_message("Sample", "teacher_topk_logprobs", "both or neither", "None"):
        Sample(**base, teacher_topk_ids=ids)
    with raises_message("Sample", "teacher_topk_ids", "an integer tensor [2, k]", "f32[2,2]"):
        Sample(**base, teacher_topk_ids=lps, teacher_topk_logprobs=lps)
    with raises_message("Sample", "teacher_topk_logprobs", "the ids' shape [2, 2]", "f32[2,1]"):
        Sample(**base, teacher_topk_ids=ids, teacher_topk_logprobs=lps[:, :1])
    with raises_message("Sample", "ce_mask", "length 2", "f32[3]"):
        Sample(**base, ce_mask=torch.ones(3))


def test_teacher_values_are_refused_by_name():
    def with_(**kw):
        s = _sample(2, 3, seed=6)
        return Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, **kw)

    good = _sample(2, 3, seed=7)
    ids = good.teacher_topk_ids.clone()
    lps = good.teacher_topk_logprobs.clone()
    cases = {
        "out of range": (
            dict(teacher_topk_ids=ids.clone().index_fill_(1, torch.tensor([0]), V)),
            "teacher_topk_ids",
            "token ids in [0, 20)",
        ),
        "negative": (
            dict(teacher_topk_ids=ids.clone().index_fill_(1, torch.tensor([2]), -1)),
            "teacher_topk_ids",
            "token ids in [0, 20)",
        ),
        "repeated": (dict(teacher_topk_ids=ids[:, [0, 0, 1]]), "teacher_topk_ids", "distinct ids in each row"),
        "unsorted": (
            dict(teacher_topk_logprobs=lps.flip(-1), teacher_topk_ids=ids.flip(-1)),
            "teacher_topk_logprobs",
            "sorted by descending log-prob",
        ),
        "above 0": (dict(teacher_topk_logprobs=lps + 5.0), "teacher_topk_logprobs", "log-probs in [-inf, 0]"),
        "NaN": (
            dict(teacher_topk_logprobs=lps.clone().index_fill_(1, torch.tensor([1]), math.nan)),
            "teacher_topk_logprobs",
            "log-probs in [-inf, 0]",
        ),
        "ce mask": (dict(ce_mask=torch.tensor([1.0, 0.5, 0.0])), "ce_mask", "a 0/1 mask"),
    }
    for kw, arg, expected in cases.values():
        bad = with_(**{**dict(teacher_topk_ids=ids, teacher_topk_logprobs=lps), **kw})
        with raises_message("collate_microbatch", f"samples[1].{arg}", expected, ""):
            collate_microbatch([good, bad], vocab_size=V)
    minus_inf = with_(
        teacher_topk_ids=ids, teacher_topk_logprobs=lps.clone().index_fill_(1, torch.tensor([2]), -math.inf)
    )
    collate_microbatch([good, minus_inf], vocab_size=V)  # -inf: a token the teacher never produces, accepted
    ties = with_(teacher_topk_ids=ids, teacher_topk_logprobs=torch.full_like(lps, -1.5))
    collate_microbatch([good, ties], vocab_size=V)  # ties in any order
    with raises_message("check", "batch[0].teacher_topk_ids", "k <= the vocabulary size 2", "k = 3"):
        check_teacher_values("check", [good], 2, arg="batch")
    plain = Sample(prompt_ids=torch.tensor([1]), response_ids=torch.tensor([2, 3, 4]))
    with raises_message("collate_microbatch", "samples[1].teacher_topk_ids", "all samples or none", "None"):
        collate_microbatch([good, plain])
    other_k = _sample(2, 3, k=2, seed=8)
    with pytest.raises(InputError, match=r"samples\[1\]\.teacher_topk_ids' expected k = 3 columns"):
        collate_microbatch([good, other_k])
