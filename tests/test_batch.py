"""Tests for samples and micro-batches: Sample, collate_microbatch, unpack_per_sample, split_batch, SplitPlan."""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fnppo.core.batching import split as S
from fnppo.core.batching.collate import collate_microbatch, unpack_per_sample
from fnppo.core.batching.sample import LAYOUTS, Microbatch, Sample, padding_multiple
from fnppo.core.batching.split import SplitPlan, split_batch
from fnppo.core.batching.splits import base as splits_base
from fnppo.core.batching.splits.count import ByCount
from fnppo.core.batching.splits.size import BySize
from fnppo.core.batching.splits.tokens import ByTokens
from fnppo.core.errors import InputError, ShapeError
from tests.messages import raises_message

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MM_KEYS = ("image_grid_thw", "pixel_values")


# ---------------------------------------------------------------------------------------------
# Strategies and an independent reference
# ---------------------------------------------------------------------------------------------
def _mm_item(key: str, k: int, gen: torch.Generator) -> torch.Tensor:
    if key == "pixel_values":
        return torch.randn(k, 3, generator=gen)
    return torch.randint(1, 5, (k, 3), generator=gen)


@st.composite
def sample_lists(draw, min_size: int = 1, max_size: int = 6, max_prompt: int = 7, max_response: int = 7):
    """Valid sample lists: empty responses, all-masked responses, mixed/absent multi-modal items."""
    n = draw(st.integers(min_size, max_size))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    with_old = draw(st.booleans())
    with_ref = draw(st.booleans())
    with_rollout = draw(st.booleans())
    out = []
    for _ in range(n):
        p = draw(st.integers(1, max_prompt))
        r = draw(st.integers(0, max_response))
        mask_kind = draw(st.sampled_from(["none", "ones", "zeros", "random", "bool"]))
        mask = {
            "none": None,
            "ones": torch.ones(r),
            "zeros": torch.zeros(r),
            "random": torch.randint(0, 2, (r,), generator=gen).float(),
            "bool": torch.randint(0, 2, (r,), generator=gen).bool(),
        }[mask_kind]
        keys = draw(st.lists(st.sampled_from(MM_KEYS), unique=True, max_size=2))
        mm = {k: _mm_item(k, draw(st.integers(0, 2)), gen) for k in keys}
        out.append(
            Sample(
                prompt_ids=torch.randint(0, 100, (p,), generator=gen),
                response_ids=torch.randint(0, 100, (r,), generator=gen),
                advantages=torch.randn(r, generator=gen) if draw(st.booleans()) else None,
                old_logprobs=-torch.rand(r, generator=gen) if with_old else None,
                ref_logprobs=-torch.rand(r, generator=gen) if with_ref else None,
                rollout_logprobs=-torch.rand(r, generator=gen, dtype=torch.float64) if with_rollout else None,
                response_mask=mask,
                multi_modal=mm,
            )
        )
    return out


def _values(s: Sample, name: str) -> list[float]:
    v = getattr(s, name)
    if name == "response_mask":
        return [1.0] * s.response_len if v is None else [float(x) for x in v.tolist()]
    return [0.0] * s.response_len if v is None else [float(x) for x in v.float().tolist()]


def reference_rows(s: Sample, i: int, width: int, pad_id: int) -> dict[str, list]:
    """Straightforward per-position construction of one sample's row of width ``width``."""
    x, y = s.prompt_ids.tolist(), s.response_ids.tolist()
    z, P, L = x + y, len(x), len(x) + len(y)
    row = {
        "input_ids": [z[t] if t < L else pad_id for t in range(width)],
        "labels": [z[t + 1] if t + 1 < L else 0 for t in range(width)],
        "position_ids": [t if t < L else 0 for t in range(width)],
        "seq_ids": [i if t < L else -1 for t in range(width)],
    }
    for name, src in (
        ("loss_mask", "response_mask"),
        ("old_logprobs", "old_logprobs"),
        ("advantages", "advantages"),
        ("ref_logprobs", "ref_logprobs"),
        ("rollout_logprobs", "rollout_logprobs"),
    ):
        vals = [0.0] * width
        for j, v in enumerate(_values(s, src)):
            vals[P - 1 + j] = v
        row[name] = vals
    return row


def reference_collate(samples: list[Sample], layout: str, m: int, pad_id: int = 0) -> dict[str, list]:
    lens = [s.prompt_len + s.response_len for s in samples]
    if layout == "packed":
        rows = [
            reference_rows(s, i, math.ceil(L / m) * m, pad_id)
            for i, (s, L) in enumerate(zip(samples, lens, strict=True))
        ]
        return {k: [sum((r[k] for r in rows), [])] for k in rows[0]}
    width = math.ceil(max(lens) / m) * m
    rows = [reference_rows(s, i, width, pad_id) for i, s in enumerate(samples)]
    return {k: [r[k] for r in rows] for k in rows[0]}


def _snapshot(samples: list[Sample]):
    leaves = optree.tree_leaves(samples)
    return [(t, t._version, t.clone()) for t in leaves]


def _assert_untouched(snap) -> None:
    for t, version, copy in snap:
        assert t._version == version
        assert torch.equal(t, copy)


def _s(p: int, r: int, **kw) -> Sample:
    return Sample(prompt_ids=torch.arange(1, p + 1), response_ids=torch.arange(1, r + 1), **kw)


# ---------------------------------------------------------------------------------------------
# Sample
# ---------------------------------------------------------------------------------------------
def test_sample_from_lists_dtypes_and_scalar_advantage():
    s = Sample.from_lists([1, 2], [3, 4, 5], advantages=0.5, old_logprobs=[-1, -2, -3], response_mask=[1, 0, 1])
    assert s.prompt_ids.dtype == torch.int64 and s.response_ids.dtype == torch.int64
    assert s.advantages.dtype == torch.float32 and s.advantages.tolist() == [0.5, 0.5, 0.5]
    assert s.old_logprobs.tolist() == [-1.0, -2.0, -3.0]
    assert s.response_mask.tolist() == [1.0, 0.0, 1.0]
    assert s.ref_logprobs is None and s.multi_modal == {}
    assert len(s) == 5 and s.prompt_len == 2 and s.response_len == 3


@pytest.mark.parametrize(
    "kwargs, arg, expected, received",
    [
        (
            dict(prompt_ids=torch.tensor([], dtype=torch.int64), response_ids=torch.tensor([1])),
            "prompt_ids",
            "a non-empty prompt (length >= 1)",
            "i64[0]",
        ),
        (
            dict(prompt_ids=torch.tensor([[1]]), response_ids=torch.tensor([1])),
            "prompt_ids",
            "a 1-D integer tensor",
            "i64[1,1]",
        ),
        (
            dict(prompt_ids=torch.tensor([1.0]), response_ids=torch.tensor([1])),
            "prompt_ids",
            "a 1-D integer tensor",
            "f32[1]",
        ),
        (dict(prompt_ids=[1, 2], response_ids=torch.tensor([1])), "prompt_ids", "a 1-D integer tensor", "list [1, 2]"),
        (
            dict(prompt_ids=torch.tensor([1]), response_ids=torch.tensor([1, 2]), advantages=torch.zeros(3)),
            "advantages",
            "length 2 (the response length)",
            "f32[3]",
        ),
        (
            dict(
                prompt_ids=torch.tensor([1]),
                response_ids=torch.tensor([1, 2]),
                old_logprobs=torch.zeros(2, dtype=torch.int64),
            ),
            "old_logprobs",
            "a floating tensor of length 2",
            "i64[2]",
        ),
        (
            dict(prompt_ids=torch.tensor([1]), response_ids=torch.tensor([1]), response_mask=torch.ones(1, 1)),
            "response_mask",
            "None or a 1-D tensor of length 1",
            "f32[1,1]",
        ),
        (
            dict(prompt_ids=torch.tensor([1]), response_ids=torch.tensor([1]), multi_modal={"img": torch.tensor(1.0)}),
            "multi_modal['img']",
            "a tensor with dim 0 indexing items",
            "f32[]",
        ),
    ],
)
def test_sample_validation(kwargs, arg, expected, received):
    with raises_message("Sample", arg, expected, received):
        Sample(**kwargs)


def test_sample_is_pytree_and_none_stays_none():
    s = Sample.from_lists([1, 2], [3], multi_modal={"img": torch.ones(1, 2)})
    leaves = optree.tree_leaves(s)
    assert len(leaves) == 3  # prompt, response, the image; the None fields have no leaves
    doubled = optree.tree_map(lambda t: t * 2, s)
    assert isinstance(doubled, Sample)
    assert doubled.prompt_ids.tolist() == [2, 4] and doubled.advantages is None
    assert torch.equal(doubled.multi_modal["img"], torch.full((1, 2), 2.0))
    # A tree of non-tensors is a valid tree_map result (no validation on unflatten).
    shapes = optree.tree_map(lambda t: tuple(t.shape), s)
    assert shapes.prompt_ids == (2,)


# ---------------------------------------------------------------------------------------------
# collate_microbatch
# ---------------------------------------------------------------------------------------------
def _hand_samples():
    a = Sample.from_lists(
        [5, 6],
        [7, 8, 9],
        response_mask=[1, 0, 1],
        advantages=2.0,
        old_logprobs=[-0.1, -0.2, -0.3],
        multi_modal={"img": torch.ones(2, 3)},
    )
    b = Sample.from_lists([3], [], old_logprobs=[])
    return [a, b]


def test_collate_packed_hand_example():
    mb = collate_microbatch(_hand_samples(), layout="packed", pad_to_multiple_of=4, pad_token_id=99)
    # segments: a = 5 tokens -> 8, b = 1 token -> 4
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 99, 99, 99, 3, 99, 99, 99]]
    assert mb.labels.tolist() == [[6, 7, 8, 9, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0]]
    assert mb.seq_ids.tolist() == [[0, 0, 0, 0, 0, -1, -1, -1, 1, -1, -1, -1]]
    assert mb.loss_mask.tolist() == [[0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert mb.advantages.tolist() == [[0, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert torch.allclose(mb.old_logprobs, torch.tensor([[0, -0.1, -0.2, -0.3] + [0.0] * 8]))
    assert mb.cu_seqlens.tolist() == [0, 8, 12] and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == 8 and mb.attention_mask is None
    assert mb.ref_logprobs is None and mb.rollout_logprobs is None
    assert mb.multi_modal_counts["img"].tolist() == [2, 0]
    assert mb.sample_index.tolist() == [0, 1] and mb.num_samples == 2
    assert mb.segment_lens == (8, 4) and mb.seq_lens == (5, 1)


def test_collate_padded_hand_example():
    mb = collate_microbatch(_hand_samples(), layout="padded", pad_to_multiple_of=4, sample_index=[7, 3])
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 0]]
    assert mb.labels.tolist() == [[6, 7, 8, 9, 0, 0, 0, 0], [0] * 8]
    assert mb.loss_mask.tolist() == [[0, 1, 0, 1, 0, 0, 0, 0], [0] * 8]
    assert mb.attention_mask.tolist() == [[True] * 5 + [False] * 3, [True] + [False] * 7]
    assert mb.seq_ids.tolist() == [[0] * 5 + [-1] * 3, [1] + [-1] * 7]
    assert mb.cu_seqlens is None and mb.max_seqlen is None
    assert mb.sample_index.tolist() == [7, 3]


@pytest.mark.parametrize("layout", LAYOUTS)
@SETTINGS
@given(samples=sample_lists(), m=st.integers(1, 5), pad_id=st.integers(0, 3))
def test_collate_matches_reference(layout, samples, m, pad_id):
    snap = _snapshot(samples)
    mb = collate_microbatch(samples, layout=layout, pad_to_multiple_of=m, pad_token_id=pad_id)
    _assert_untouched(snap)
    ref = reference_collate(samples, layout, m, pad_id)
    for name in ("input_ids", "labels", "position_ids", "seq_ids"):
        t = getattr(mb, name)
        assert t.dtype == torch.int64 and t.tolist() == ref[name], name
    for name in ("loss_mask", "advantages"):
        t = getattr(mb, name)
        assert t.dtype == torch.float32
        assert torch.equal(t, torch.tensor(ref[name], dtype=torch.float32)), name
    for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):  # all samples or none: None, never zeros
        t = getattr(mb, name)
        if getattr(samples[0], name) is None:
            assert t is None
        else:
            assert t.dtype == torch.float32 and torch.equal(t, torch.tensor(ref[name], dtype=torch.float32)), name
    assert mb.input_ids.shape[-1] % m == 0
    if layout == "packed":
        assert mb.input_ids.shape[0] == 1
        seg = [math.ceil((s.prompt_len + s.response_len) / m) * m for s in samples]
        assert mb.cu_seqlens.tolist() == [sum(seg[:k]) for k in range(len(seg) + 1)]
        assert mb.max_seqlen == max(seg) and mb.attention_mask is None
    else:
        assert mb.input_ids.shape[0] == len(samples)
        assert torch.equal(mb.attention_mask, mb.seq_ids >= 0) and mb.attention_mask.dtype == torch.bool


@pytest.mark.parametrize("layout", LAYOUTS)
@SETTINGS
@given(samples=sample_lists(), m=st.integers(1, 4))
def test_masks_align_with_labels(layout, samples, m):
    """loss_mask=1 only where the label is a (kept) response token of the position's own sample."""
    mb = collate_microbatch(samples, layout=layout, pad_to_multiple_of=m)
    on = mb.loss_mask != 0
    assert bool((mb.seq_ids[on] >= 0).all())
    # every label under the mask is the next input token of the same sample
    nxt_same = torch.zeros_like(on)
    nxt_same[:, :-1] = (mb.seq_ids[:, 1:] == mb.seq_ids[:, :-1]) & (mb.seq_ids[:, :-1] >= 0)
    assert bool(nxt_same[on].all())
    assert torch.equal(mb.labels[:, :-1][nxt_same[:, :-1]], mb.input_ids[:, 1:][nxt_same[:, :-1]])
    assert bool((mb.labels[~nxt_same] == 0).all())
    # number of trained tokens = number of response tokens with mask 1
    assert int(on.sum()) == sum(int(sum(_values(s, "response_mask"))) for s in samples)
    # values vanish outside the response-label positions (prompt and padding)
    for name in ("old_logprobs", "advantages"):
        if getattr(mb, name) is None:  # no sample has old_logprobs
            continue
        pos = torch.zeros_like(on)
        # positions that hold a response label, built from the seq_ids / prompt lengths
        for b in range(pos.shape[0]):
            for t in range(pos.shape[1]):
                k = int(mb.seq_ids[b, t])
                if k < 0:
                    continue
                start = t - int(mb.position_ids[b, t])
                rel = t - start - (samples[k].prompt_len - 1)
                pos[b, t] = 0 <= rel < samples[k].response_len
        assert bool((getattr(mb, name)[~pos] == 0).all())


@pytest.mark.parametrize("layout", LAYOUTS)
@SETTINGS
@given(samples=sample_lists(), m=st.integers(1, 4))
def test_collate_then_unpack_returns_inputs(layout, samples, m):
    mb = collate_microbatch(samples, layout=layout, pad_to_multiple_of=m)
    responses = unpack_per_sample(mb.labels, mb)
    for s, got in zip(samples, responses, strict=True):
        assert torch.equal(got, s.response_ids)  # every response token exactly once, in order
    for name in ("old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs"):
        if getattr(mb, name) is None:
            continue
        for s, got in zip(samples, unpack_per_sample(getattr(mb, name), mb), strict=True):
            want = getattr(s, name)
            want = torch.zeros(s.response_len) if want is None else want.float()
            assert torch.equal(got, want), name
    for s, got in zip(samples, unpack_per_sample(mb.loss_mask, mb), strict=True):
        assert got.tolist() == _values(s, "response_mask")
    # prompts are recovered from input_ids and seq_ids
    for k, s in enumerate(samples):
        toks = mb.input_ids[mb.seq_ids == k]
        assert torch.equal(toks[: s.prompt_len], s.prompt_ids) and toks.numel() == len(s)


def test_unpack_shape_error_and_gradient():
    samples = _hand_samples()
    mb = collate_microbatch(samples, layout="packed", pad_to_multiple_of=4)
    with pytest.raises(ShapeError) as err:
        unpack_per_sample(torch.zeros(1, 5), mb)
    assert str(err.value) == (
        "fnppo.core.batching.collate.unpack_per_sample: argument 'values' expected shape (1, 12) (that of "
        "mb.input_ids), received f32[1,5]"
    )
    with raises_message("unpack_per_sample", "values", "Shaped[Tensor, 'batch seq']", "f32[12]", ShapeError):
        unpack_per_sample(torch.zeros(12), mb)
    x = torch.zeros(1, 12, requires_grad=True)
    parts = unpack_per_sample(x * 3.0, mb)
    sum(p.sum() for p in parts).backward()
    # gradient 3 on the label positions of a's response (1, 2, 3), 0 elsewhere
    assert x.grad.tolist() == [[0, 3, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0]]


def test_multi_modal_union_and_mixed():
    gen = torch.Generator().manual_seed(0)
    a = _s(2, 1, multi_modal={"pixel_values": torch.randn(2, 3, generator=gen)})
    b = _s(1, 2)  # text only
    c = _s(
        3,
        0,
        multi_modal={"pixel_values": torch.randn(1, 3, generator=gen), "image_grid_thw": torch.tensor([[1, 2, 2]])},
    )
    mb = collate_microbatch([a, b, c])
    assert sorted(mb.multi_modal) == ["image_grid_thw", "pixel_values"]
    assert torch.equal(
        mb.multi_modal["pixel_values"], torch.cat([a.multi_modal["pixel_values"], c.multi_modal["pixel_values"]])
    )
    assert mb.multi_modal_counts["pixel_values"].tolist() == [2, 0, 1]
    assert mb.multi_modal_counts["image_grid_thw"].tolist() == [0, 0, 1]
    assert torch.equal(mb.multi_modal["image_grid_thw"], torch.tensor([[1, 2, 2]]))
    # no images at all, and a key present with zero items
    text = collate_microbatch([b, _s(1, 1)])
    assert text.multi_modal == {} and text.multi_modal_counts == {}
    empty = collate_microbatch([b, _s(1, 1, multi_modal={"pixel_values": torch.zeros(0, 3)})])
    assert empty.multi_modal["pixel_values"].shape == (0, 3)
    assert empty.multi_modal_counts["pixel_values"].tolist() == [0, 0]


@pytest.mark.parametrize(
    "item, received",
    [
        (torch.zeros(1, 4), "f32[1,4] on cpu"),  # another trailing shape
        (torch.zeros(2, 3, dtype=torch.float16), "f16[2,3] on cpu"),  # another dtype
        (torch.zeros(1, 3, device="meta"), "f32[1,3] on meta"),  # another device
    ],
    ids=["shape", "dtype", "device"],
)
def test_multi_modal_mismatch_is_an_error(item, received):
    a = _s(1, 1, multi_modal={"pixel_values": torch.zeros(1, 3)})
    b = _s(1, 1)  # no item: does not count
    c = _s(1, 1, multi_modal={"pixel_values": item})
    with pytest.raises(InputError) as err:
        collate_microbatch([a, b, c])
    assert str(err.value) == (
        "collate_microbatch: argument 'samples[2].multi_modal['pixel_values']' expected items like samples[0]'s: "
        f"trailing shape (3,), torch.float32, on cpu, received {received}"
    )


def test_microbatch_tree_map_to_device_keeps_none_and_static():
    mb = collate_microbatch(_hand_samples(), layout="packed", pad_to_multiple_of=4)
    moved = optree.tree_map(lambda x: x.to("meta"), mb)
    assert isinstance(moved, Microbatch)
    assert moved.ref_logprobs is None and moved.rollout_logprobs is None and moved.attention_mask is None
    assert moved.input_ids.device.type == "meta" and moved.cu_seqlens.device.type == "meta"
    assert moved.multi_modal["img"].device.type == "meta" and moved.multi_modal_counts["img"].device.type == "meta"
    assert (moved.layout, moved.max_seqlen, moved.prompt_lens, moved.response_lens) == ("packed", 8, (2, 1), (3, 0))
    leaves, spec = optree.tree_flatten(mb)
    # 9 per-token/meta tensors (no ref/rollout/attention_mask) + 2 multi-modal entries
    assert len(leaves) == 11 and all(isinstance(t, torch.Tensor) for t in leaves)
    paths = [optree.tree_paths(mb)[k] for k in range(len(leaves))]
    assert ("input_ids",) in paths and ("multi_modal", "img") in paths
    back = optree.tree_unflatten(spec, leaves)
    assert back.input_ids is mb.input_ids and back.layout == "packed"
    padded = collate_microbatch(_hand_samples(), layout="padded")
    assert optree.tree_map(lambda x: x.to("meta"), padded).cu_seqlens is None
    assert optree.tree_structure(padded) != optree.tree_structure(mb)  # layout is static metadata


def test_microbatch_is_frozen():
    mb = collate_microbatch(_hand_samples())
    with pytest.raises(dataclasses.FrozenInstanceError, match="input_ids"):
        mb.input_ids = mb.labels  # type: ignore[misc]


@pytest.mark.parametrize(
    "make, kwargs, arg, expected, received",
    [
        (lambda: [], {}, "samples", "a non-empty sequence of Sample", "an empty sequence"),
        (lambda: [_s(2, 2)], dict(layout="thd"), "layout", "one of ('packed', 'padded')", "'thd'"),
        (lambda: [_s(2, 2)], dict(pad_to_multiple_of=0), "pad_to_multiple_of", "an int >= 1", "0"),
        (
            lambda: [_s(2, 2), _s(3, 3)],
            dict(max_seq_len=5),
            "samples[1]",
            "at most max_seq_len=5 tokens",
            "6 tokens (prompt 3 + response 3)",
        ),
        (
            lambda: [_s(2, 2, response_mask=torch.tensor([1.0, 0.5]))],
            {},
            "samples[0].response_mask",
            "a 0/1 mask",
            "f32[2] containing 0.5",
        ),
        (
            lambda: [_s(2, 2, response_mask=torch.tensor([2, 0]))],
            {},
            "samples[0].response_mask",
            "a 0/1 mask",
            "i64[2] containing 2",
        ),
        (
            lambda: [_s(2, 2), _s(1, 2, advantages=torch.tensor([0.0, float("nan")]))],
            {},
            "samples[1].advantages",
            "finite values",
            "f32[2] with 1 NaN/inf entries",
        ),
        (
            lambda: [_s(1, 1, old_logprobs=torch.tensor([float("-inf")]))],
            {},
            "samples[0].old_logprobs",
            "finite values",
            "f32[1] with 1 NaN/inf entries",
        ),
        (
            lambda: [_s(1, 1, ref_logprobs=torch.tensor([float("inf")]))],
            {},
            "samples[0].ref_logprobs",
            "finite values",
            "f32[1] with 1 NaN/inf entries",
        ),
        (
            lambda: [_s(1, 1, rollout_logprobs=torch.tensor([float("nan")]))],
            {},
            "samples[0].rollout_logprobs",
            "finite values",
            "f32[1] with 1 NaN/inf entries",
        ),
        (
            lambda: [_s(1, 1, ref_logprobs=torch.zeros(1)), _s(1, 1)],
            {},
            "samples[1].ref_logprobs",
            "a tensor (samples[0] has ref_logprobs; all samples or none)",
            "None",
        ),
        (
            lambda: [_s(1, 1), _s(1, 1, rollout_logprobs=torch.zeros(1)), _s(2, 1)],
            {},
            "samples[0].rollout_logprobs",
            "a tensor (samples[1] has rollout_logprobs; all samples or none)",
            "None",
        ),
        (
            lambda: [_s(3, 1)],
            dict(vocab_size=3),
            "samples[0].prompt_ids",
            "values in [0, 3)",
            "i64[3] with values in [1, 3]",
        ),
        (
            lambda: [Sample.from_lists([1], [-4])],
            {},
            "samples[0].response_ids",
            "values in [0, ",
            "i64[1] with values in [-4, -4]",
        ),
        (
            lambda: [_s(1, 1), _s(1, 1)],
            dict(sample_index=[0]),
            "sample_index",
            "2 indices (one per sample)",
            "1 indices",
        ),
    ],
)
def test_collate_errors(make, kwargs, arg, expected, received):
    with pytest.raises(InputError) as err:
        collate_microbatch(make(), **kwargs)
    head, sep, got = str(err.value).partition(", received ")
    assert sep and head.startswith(f"collate_microbatch: argument '{arg}' expected "), str(err.value)
    assert expected in head and got.startswith(received), (str(err.value), expected, received)


def test_collate_mixed_devices_is_an_error():
    a = _s(1, 1)
    b = Sample(prompt_ids=torch.tensor([1], device="meta"), response_ids=torch.tensor([1], device="meta"))
    with raises_message(
        "collate_microbatch", "samples[1].prompt_ids", "a tensor on cpu (the device of samples[0])", "i64[1] on meta"
    ):
        collate_microbatch([a, b])


def test_padding_multiple():
    assert padding_multiple() == 1
    assert padding_multiple(4) == 4
    assert padding_multiple(2, 3) == 12  # 2*cp chunks, each split over tp
    assert padding_multiple(1, 2) == 4
    with raises_message("padding_multiple", "cp_size", "an int >= 1", "0"):
        padding_multiple(1, 0)


# ---------------------------------------------------------------------------------------------
# split_batch / SplitPlan
# ---------------------------------------------------------------------------------------------
def _lens(*lengths: int) -> list[Sample]:
    return [_s(1, L - 1) for L in lengths]


def _groups_tokens(plan: SplitPlan, lengths: list[int]) -> list[int]:
    return [sum(lengths[i] for i in g) for g in plan.microbatches]


def test_split_fixed_number_and_size():
    samples = _lens(*range(2, 12))  # 10 samples
    plan = split_batch(samples, num_microbatches=3)
    assert plan.microbatches == ((0, 1, 2, 3), (4, 5, 6), (7, 8, 9))
    assert plan.inverse == tuple(range(10))
    plan = split_batch(samples, microbatch_size=4)
    assert plan.microbatches == ((0, 1, 2, 3), (4, 5, 6), (7, 8, 9))
    assert split_batch(samples, microbatch_size=20).microbatches == (tuple(range(10)),)
    assert split_batch(samples, num_microbatches=10).num_microbatches == 10


def test_split_token_budget_balances_hand_example():
    # FFD needs 4 micro-batches of <= 10 tokens for 5,5,5,5,4,4,4,4 (36 tokens); balanced: 9 each.
    lengths = [5, 4, 5, 4, 5, 4, 5, 4]
    plan = split_batch(_lens(*lengths), max_tokens_per_microbatch=10)
    assert plan.num_microbatches == 4
    assert _groups_tokens(plan, lengths) == [9, 9, 9, 9]
    assert all(len(g) == 2 for g in plan.microbatches)


def test_split_token_budget_falls_back_to_first_fit_decreasing():
    # LPT on 2 groups puts 6|5,4 then 3 on the 6 and 2 fits nowhere; FFD finds 6+4 | 5+3+2.
    lengths = [6, 5, 4, 3, 2]
    plan = split_batch(_lens(*lengths), max_tokens_per_microbatch=10)
    assert plan.microbatches == ((0, 2), (1, 3, 4))


def test_split_padded_budget_counts_rows_times_longest():
    lengths = [8, 2, 2, 2]
    # padded: one row of 8 makes every row 8 wide, so 8 + 2 costs 16 tokens
    plan = split_batch(_lens(*lengths), max_tokens_per_microbatch=12, layout="padded")
    for g in plan.microbatches:
        mb = collate_microbatch([_lens(*lengths)[i] for i in g], layout="padded")
        assert mb.input_ids.numel() <= 12
    assert plan.microbatches == ((0,), (1, 2, 3))
    # packed, same budget: 8 + 2 + 2 = 12 fits, then 2 alone
    assert split_batch(_lens(*lengths), max_tokens_per_microbatch=12).num_microbatches == 2


def test_split_padding_counts_against_budget():
    # 3 tokens padded to 4 each: four samples are 16 collated tokens, not 12
    plan = split_batch(_lens(3, 3, 3, 3), max_tokens_per_microbatch=12, pad_to_multiple_of=4)
    assert plan.num_microbatches == 2
    assert split_batch(_lens(3, 3, 3, 3), max_tokens_per_microbatch=12).num_microbatches == 1


@pytest.mark.parametrize(
    "samples, kwargs, arg, expected, received",
    [
        ([], dict(num_microbatches=1), "samples", "a non-empty sequence of Sample", "an empty sequence"),
        (_lens(2, 3), {}, "num_microbatches/microbatch_size/max_tokens_per_microbatch", "exactly one of them", "none"),
        (
            _lens(2, 3),
            dict(num_microbatches=1, microbatch_size=1),
            "num_microbatches/microbatch_size/max_tokens_per_microbatch",
            "exactly one of them",
            "['num_microbatches', 'microbatch_size']",
        ),
        (
            _lens(2, 3),
            dict(num_microbatches=3),
            "num_microbatches",
            "at most the batch size 2 (no empty micro-batches)",
            "3",
        ),
        (_lens(2, 3), dict(num_microbatches=0), "num_microbatches", "an int >= 1", "0"),
        (_lens(2, 3), dict(microbatch_size=-1), "microbatch_size", "an int >= 1", "-1"),
        (
            _lens(2, 3, 9),
            dict(max_tokens_per_microbatch=8),
            "samples[2]",
            "at most max_tokens_per_microbatch=8 tokens (a single sample longer than the token budget cannot be split)",
            "9 tokens (prompt 1 + response 8)",
        ),
        (
            _lens(2, 7),
            dict(max_tokens_per_microbatch=7, pad_to_multiple_of=4),
            "samples[1]",
            "at most max_tokens_per_microbatch=7 tokens",
            "8 tokens (prompt 1 + response 6, padded to a multiple of 4)",
        ),
        (
            _lens(2, 7),
            dict(num_microbatches=1, max_seq_len=6),
            "samples[1]",
            "at most max_seq_len=6 tokens",
            "7 tokens (prompt 1 + response 6)",
        ),
        (_lens(2, 7), dict(num_microbatches=1, layout="bshd"), "layout", "one of ('packed', 'padded')", "'bshd'"),
    ],
)
def test_split_errors(samples, kwargs, arg, expected, received):
    with raises_message("split_batch", arg, expected, received):
        split_batch(samples, **kwargs)


def test_split_plan_validation_and_helpers():
    plan = SplitPlan.from_groups([[2, 0], [1]])
    assert plan.order == (2, 0, 1) and plan.inverse == (1, 2, 0)
    assert plan.apply(["a", "b", "c"]) == [["c", "a"], ["b"]]
    assert plan.restore([["C", "A"], ["B"]]) == ["A", "B", "C"]
    with raises_message("SplitPlan.restore", "per_microbatch", "group sizes [2, 1]", "[1, 2]"):
        plan.restore([["C"], ["A", "B"]])
    with raises_message("SplitPlan.apply", "samples", "3 samples (the planned batch)", "1"):
        plan.apply(["a"])
    with raises_message("SplitPlan", "microbatches", "non-empty groups partitioning range(3)", "((0, 0), (1,))"):
        SplitPlan.from_groups([[0, 0], [1]])
    with raises_message("SplitPlan", "microbatches", "non-empty groups partitioning range(1)", "((0,), ())"):
        SplitPlan.from_groups([[0], []])
    with raises_message("SplitPlan", "inverse", "the inverse of the concatenated order [1, 0]", "(0, 1)"):
        SplitPlan(microbatches=((1,), (0,)), inverse=(0, 1))


@st.composite
def split_case(draw):
    lengths = draw(st.lists(st.integers(1, 20), min_size=1, max_size=14))
    m = draw(st.integers(1, 4))
    layout = draw(st.sampled_from(LAYOUTS))
    longest = max(math.ceil(L / m) * m for L in lengths)
    budget = draw(st.integers(longest, longest * 4))
    return lengths, m, layout, budget


@SETTINGS
@given(case=split_case())
def test_split_token_budget_properties(case):
    lengths, m, layout, budget = case
    samples = _lens(*lengths)
    snap = _snapshot(samples)
    plan = split_batch(samples, max_tokens_per_microbatch=budget, pad_to_multiple_of=m, layout=layout)
    _assert_untouched(snap)
    assert plan == split_batch(samples, max_tokens_per_microbatch=budget, pad_to_multiple_of=m, layout=layout)
    n = len(samples)
    assert sorted(plan.order) == list(range(n))  # every sample (so every response token) exactly once
    assert all(len(g) > 0 for g in plan.microbatches)
    # the budget is a hard cap on what collate produces
    for g in plan.microbatches:
        mb = collate_microbatch([samples[i] for i in g], layout=layout, pad_to_multiple_of=m, sample_index=list(g))
        assert mb.input_ids.numel() <= budget
        assert mb.sample_index.tolist() == list(g)
    # first-fit quality: all but one micro-batch are more than half full (packed), so k <= 2T/B + 1
    if layout == "packed":
        total = sum(math.ceil(L / m) * m for L in lengths)
        assert plan.num_microbatches <= math.floor(2 * total / budget) + 1
    # the inverse permutation restores the original order
    per_mb = [[("tag", i) for i in g] for g in plan.microbatches]
    assert plan.restore(per_mb) == [("tag", i) for i in range(n)]
    assert [s for group in plan.apply(samples) for s in group] == [samples[i] for i in plan.order]


@SETTINGS
@given(case=split_case(), extra=st.integers(0, 14))
def test_split_token_budget_under_agreed_count(case, extra):
    """A larger count agreed over DP: exactly that many non-empty micro-batches, still under the cap."""
    lengths, m, layout, budget = case
    samples = _lens(*lengths)
    k_local = split_batch(
        samples, max_tokens_per_microbatch=budget, pad_to_multiple_of=m, layout=layout
    ).num_microbatches
    agreed = min(len(samples), k_local + extra)
    with mock.patch.object(S, "_agree", lambda k, n, g: (max(k, agreed), n)):
        plan = split_batch(
            samples, max_tokens_per_microbatch=budget, pad_to_multiple_of=m, layout=layout, dp_group=object()
        )
    assert plan.num_microbatches == agreed
    assert sorted(plan.order) == list(range(len(samples)))
    for g in plan.microbatches:
        assert len(g) > 0
        mb = collate_microbatch([samples[i] for i in g], layout=layout, pad_to_multiple_of=m)
        assert mb.input_ids.numel() <= budget


def test_split_to_moves_shortest_of_fullest_group():
    assert splits_base.split_to([[0, 1, 2], [3]], 3) == [[0, 1], [3], [2]]
    assert splits_base.split_to([[0, 1], [2, 3]], 4) == [[0], [2], [1], [3]]


def test_split_agreed_count_above_batch_size_is_an_error_on_every_rank():
    with mock.patch.object(S, "_agree", lambda k, n, g: (5, 2)):
        with raises_message(
            "split_batch",
            "samples",
            "at least 5 samples on every data-parallel rank",
            "2 samples on some rank (3 here)",
        ):
            split_batch(_lens(2, 2, 2), num_microbatches=1, dp_group=object())


@SETTINGS
@given(n=st.integers(1, 20), data=st.data())
def test_split_fixed_modes_properties(n, data):
    samples = _lens(*([2] * n))
    k = data.draw(st.integers(1, n))
    plan = split_batch(samples, num_microbatches=k)
    sizes = [len(g) for g in plan.microbatches]
    assert len(sizes) == k and max(sizes) - min(sizes) <= 1 and plan.order == tuple(range(n))
    b = data.draw(st.integers(1, n + 2))
    plan = split_batch(samples, microbatch_size=b)
    assert plan.num_microbatches == math.ceil(n / b) and max(len(g) for g in plan.microbatches) <= b
    assert plan.order == tuple(range(n))


# ---------------------------------------------------------------------------------------------
# Fuzzing: arbitrary (also invalid) inputs -> a result or a documented InputError
# ---------------------------------------------------------------------------------------------
@st.composite
def fuzz_samples(draw):
    samples = draw(sample_lists(min_size=0, max_size=5, max_prompt=5, max_response=5))
    out = []
    for s in samples:
        r = s.response_len
        corrupt = draw(st.sampled_from(["none", "none", "mask2", "nan_adv", "inf_old", "drop_ref"]))
        if corrupt == "mask2" and r:
            s = Sample(
                s.prompt_ids,
                s.response_ids,
                s.advantages,
                s.old_logprobs,
                s.ref_logprobs,
                s.rollout_logprobs,
                torch.full((r,), 2.0),
                s.multi_modal,
            )
        elif corrupt == "nan_adv" and r:
            s = Sample(
                s.prompt_ids,
                s.response_ids,
                torch.full((r,), float("nan")),
                s.old_logprobs,
                s.ref_logprobs,
                s.rollout_logprobs,
                s.response_mask,
                s.multi_modal,
            )
        elif corrupt == "inf_old" and r:
            s = Sample(
                s.prompt_ids,
                s.response_ids,
                s.advantages,
                torch.full((r,), float("-inf")),
                s.ref_logprobs,
                s.rollout_logprobs,
                s.response_mask,
                s.multi_modal,
            )
        elif corrupt == "drop_ref":
            s = Sample(
                s.prompt_ids,
                s.response_ids,
                s.advantages,
                s.old_logprobs,
                None,
                s.rollout_logprobs,
                s.response_mask,
                s.multi_modal,
            )
        out.append(s)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    samples=fuzz_samples(),
    layout=st.sampled_from(LAYOUTS),
    m=st.integers(1, 4),
    mode=st.sampled_from(["num", "size", "tokens"]),
    size=st.integers(1, 40),
    max_seq_len=st.one_of(st.none(), st.integers(1, 12)),
)
def test_fuzz_split_then_collate(samples, layout, m, mode, size, max_seq_len):
    kw = {
        "num": dict(num_microbatches=size % 6 + 1),
        "size": dict(microbatch_size=size % 6 + 1),
        "tokens": dict(max_tokens_per_microbatch=size),
    }[mode]
    try:
        plan = split_batch(samples, pad_to_multiple_of=m, layout=layout, max_seq_len=max_seq_len, **kw)
    except InputError:
        return
    for g, group in zip(plan.microbatches, plan.apply(samples), strict=True):
        try:
            mb = collate_microbatch(
                group, layout=layout, pad_to_multiple_of=m, max_seq_len=max_seq_len, sample_index=list(g)
            )
        except InputError:
            continue
        assert mb.num_samples == len(g)
        if mode == "tokens":
            assert mb.input_ids.numel() <= size
        got = unpack_per_sample(mb.labels, mb)
        assert [t.tolist() for t in got] == [s.response_ids.tolist() for s in group]


# ---------------------------------------------------------------------------------------------
# Data parallel: the micro-batch count is agreed over the group (2 gloo ranks, real Megatron groups)
# ---------------------------------------------------------------------------------------------
def _dp_rank_fn():
    from fnppo.megatron.parallel import current_layout

    lay = current_layout()
    r = lay.dp_rank
    # budget 8: rank 0 needs 2 micro-batches (4+4, 4+4), rank 1 needs 4 (8, 8, 8, 8)
    plan = split_batch(
        _lens(*([4, 4, 4, 4] if r == 0 else [8, 8, 8, 8])), max_tokens_per_microbatch=8, dp_group=lay.dp_group
    )
    # rank 0 has 2 samples, rank 1 needs 3 micro-batches: every rank must fail, none may hang
    try:
        split_batch(_lens(*([4, 4] if r == 0 else [8, 8, 8])), max_tokens_per_microbatch=8, dp_group=lay.dp_group)
        err = None
    except InputError as e:
        err = str(e)
    return lay.dp, plan.microbatches, err


@pytest.mark.slow
def test_split_agrees_over_dp_group():
    from fnppo.testing import run_ranks

    (dp0, mbs0, err0), (dp1, mbs1, err1) = run_ranks(_dp_rank_fn, 2)
    assert dp0 == dp1 == 2
    assert mbs0 == ((0,), (1,), (2,), (3,)) and mbs1 == ((0,), (1,), (2,), (3,))
    for err in (err0, err1):
        assert (
            err is not None and "at least 3 samples on every data-parallel rank" in err and "received 2 samples" in err
        )


def test_split_as_one_value_is_the_flat_keywords():
    """``split_batch(samples, ByTokens(10))`` is ``split_batch(samples, max_tokens_per_microbatch=10)``
    (and likewise ByCount / BySize); the step configs take the value and refuse it beside a flat
    keyword, and refuse anything that is not a split rule (the former ``(name, size)`` pair included)."""
    from fnppo.steps.config import CriticConfig, StepConfig

    samples = _lens(5, 5, 5, 5, 4, 4, 4, 4, 3)
    for value, flat in (
        (ByCount(3), "num_microbatches"),
        (BySize(4), "microbatch_size"),
        (ByTokens(10), "max_tokens_per_microbatch"),
    ):
        assert value.flat == flat
        assert split_batch(samples, value) == split_batch(samples, **{flat: value.n})
        assert StepConfig(split=value).splitting == StepConfig(**{flat: value.n}).splitting == value
        assert StepConfig(**{flat: value.n}).split_arg == flat and StepConfig(split=value).split_arg == "split"
        with raises_message("StepConfig", flat, "None when split is given", str(value.n)):
            StepConfig(split=value, **{flat: value.n})
    assert CriticConfig().splitting == ByCount(1) and CriticConfig().split_arg == "num_microbatches"
    with raises_message("split_batch", "num_microbatches", "None when split is given", "2"):
        split_batch(samples, BySize(2), num_microbatches=2)
    with raises_message("fnppo.ByTokens", "n", "an int >= 1", "0"):
        ByTokens(0)
    with raises_message("CriticConfig", "split", "a split rule (ByCount, BySize, ByTokens", "('num_microbatches', 2)"):
        CriticConfig(split=("num_microbatches", 2))
    assert not hasattr(S, "as_split")  # one way to say a split: the rule itself
