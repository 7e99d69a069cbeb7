"""ByFlops: the token budget of ByTokens, the micro-batches balanced by estimated FLOPs (L + L(L+1)/c)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fnppo.batching import ByFlops, ByTokens
from fnppo.core.batching import split as S
from fnppo.core.batching.collate import collate_microbatch
from fnppo.core.batching.sample import LAYOUTS, Sample
from fnppo.core.batching.split import split_batch
from fnppo.steps.config import StepConfig
from tests.messages import raises_message


def _lens(*lengths: int) -> list[Sample]:
    return [Sample(prompt_ids=torch.arange(1, 2), response_ids=torch.arange(1, n)) for n in lengths]


def _flops(length: int, c: float) -> float:
    """The cost model written from the formula: linear work per token plus causal attention pairs."""
    pairs = sum(range(1, length + 1))  # query t sees keys 0..t
    return float(length) + 2.0 * pairs / c


def _max_load(plan, lengths, c):
    return max(sum(_flops(lengths[i], c) for i in g) for g in plan.microbatches)


def test_flops_balance_differs_from_token_balance_on_a_hand_example():
    # 10,5,5,5,5 (30 tokens) under a 20-token cap: two micro-batches either way. Balanced by tokens
    # (longest first, ties to the first): 10+5 | 5+5+5 (15 | 15 tokens); by cost L + L(L+1)/2 (65 for
    # 10 tokens, 20 for 5): 65 | 20+20+20+20 (65 | 80) instead of 85 | 60.
    lengths = [10, 5, 5, 5, 5]
    by_tokens = split_batch(_lens(*lengths), ByTokens(20))
    by_flops = split_batch(_lens(*lengths), ByFlops(20, c=2.0))
    assert by_tokens.microbatches == ((0, 3), (1, 2, 4))
    assert by_flops.microbatches == ((0,), (1, 2, 3, 4))
    assert _max_load(by_flops, lengths, 2.0) == 80.0 < _max_load(by_tokens, lengths, 2.0) == 85.0
    # with c large the quadratic part vanishes: balanced by tokens again (15 | 15)
    linear = split_batch(_lens(*lengths), ByFlops(20, c=1e9))
    assert sorted(sum(lengths[i] for i in g) for g in linear.microbatches) == [15, 15]


@st.composite
def _case(draw):
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=12))
    budget = draw(st.integers(max(lengths), 3 * max(lengths)))
    c = draw(st.sampled_from([1.0, 16.0, 1e6]))
    return lengths, budget, c, draw(st.sampled_from(LAYOUTS)), draw(st.integers(0, 6))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_case())
def test_flops_split_properties(case):
    """Every sample once, no empty micro-batch, the token cap held on what collate makes, the count
    of ByTokens, and exactly the count agreed over data-parallel ranks when that is larger."""
    lengths, budget, c, layout, extra = case
    samples = _lens(*lengths)
    plan = split_batch(samples, ByFlops(budget, c), layout=layout)
    assert plan.num_microbatches == split_batch(samples, ByTokens(budget), layout=layout).num_microbatches
    agreed = min(len(samples), plan.num_microbatches + extra)
    with mock.patch.object(S, "_agree", lambda k, n, g: (max(k, agreed), n)):
        wider = split_batch(samples, ByFlops(budget, c), layout=layout, dp_group=object())
    for p in (plan, wider):
        assert sorted(p.order) == list(range(len(samples))) and all(p.microbatches)
        for g in p.microbatches:
            assert collate_microbatch([samples[i] for i in g], layout=layout).input_ids.numel() <= budget
    assert wider.num_microbatches == agreed


def test_flops_split_refusals():
    with raises_message(
        "split_batch", "samples[1]", "at most n=8 tokens of ByFlops", "9 tokens (prompt 1 + response 8)"
    ):
        split_batch(_lens(3, 9), ByFlops(8, c=100.0))
    with raises_message("fnppo.ByFlops", "n", "an int >= 1", "0"):
        ByFlops(0, c=1.0)
    for bad in (0.0, -1.0, float("nan"), float("inf"), "4", True):
        with pytest.raises(Exception, match=r"fnppo.ByFlops: argument 'c' expected"):
            ByFlops(8, c=bad)
    assert StepConfig(split=ByFlops(8, c=100.0)).splitting == ByFlops(8, c=100.0)  # a split rule like the others
