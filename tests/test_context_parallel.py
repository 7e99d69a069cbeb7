"""Context parallelism: the load-balanced sharding (pure) and exact attention over gloo CP ranks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnppo.core.context_parallel import cp_token_index, shard_microbatch, shard_tokens, unshard_tokens
from fnppo.core.errors import InputError
from fnppo.testing import run_ranks, synthetic_samples


@st.composite
def _segments(draw):
    cp = draw(st.integers(1, 4))
    chunks = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
    lengths = [2 * cp * c for c in chunks]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cp, cu


@settings(max_examples=60, deadline=None)
@given(_segments(), st.integers(0, 2**31 - 1))
def test_unshard_of_shard_is_identity(case, seed):
    cp, cu = case
    total = cu[-1]
    x = torch.randn(3, total, generator=torch.Generator().manual_seed(seed))
    shards = [shard_tokens(x, cu, cp, r) for r in range(cp)]
    assert all(s.shape == (3, total // cp) for s in shards)
    torch.testing.assert_close(unshard_tokens(shards, cu), x, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(_segments())
def test_ranks_hold_chunks_r_and_mirror(case):
    """Plain-python reference: segment k, chunk size c; rank r holds chunks r and 2cp-1-r."""
    cp, cu = case
    for r in range(cp):
        expected = []
        for a, b in zip(cu, cu[1:]):
            c = (b - a) // (2 * cp)
            expected += list(range(a + r * c, a + (r + 1) * c)) + list(
                range(a + (2 * cp - 1 - r) * c, a + (2 * cp - r) * c)
            )
        assert cp_token_index(cu, cp, r).tolist() == expected
    owned = sorted(i for r in range(cp) for i in cp_token_index(cu, cp, r).tolist())
    assert owned == list(range(cu[-1]))


def test_bad_segment_length_is_refused():
    with pytest.raises(InputError, match="divisible by 2\\*cp = 4"):
        cp_token_index([0, 4, 6], 2, 0)


def test_shard_microbatch_keeps_global_positions_and_segments():
    import fnppo

    samples = synthetic_samples(3, seed=1)
    mb = fnppo.collate_microbatch(samples, pad_to_multiple_of=4)
    parts = [shard_microbatch(mb, 2, r) for r in range(2)]
    for name in ("input_ids", "position_ids", "labels", "loss_mask", "old_logprobs", "advantages", "seq_ids"):
        torch.testing.assert_close(unshard_tokens([getattr(p, name) for p in parts], mb.cu_seqlens), getattr(mb, name))
    assert all(torch.equal(p.cu_seqlens, mb.cu_seqlens) and p.max_seqlen == mb.max_seqlen for p in parts)
    assert sum(float(p.loss_mask.sum()) for p in parts) == float(mb.loss_mask.sum())


# --------------------------------------------------------------------------------------------
# attention over the CP group vs a dense float64 reference
# --------------------------------------------------------------------------------------------
def _dense_reference(q, k, v, cu, scale):
    """Plain float64 document-causal attention with explicit GQA expansion."""
    total = q.shape[0]
    seg = torch.zeros(total, dtype=torch.int64)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        seg[a:b] = i
    idx = torch.arange(total)
    allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(-1), v)


def _attention_cases(n_cases: int) -> float:
    from megatron.core import parallel_state as ps

    import fnppo
    from fnppo.core.context_parallel import context_parallel_attention

    layout = fnppo.parallel.current_layout()
    group = ps.get_context_parallel_group()
    cp, rank = group.size(), group.rank()
    assert (layout.cp, layout.cp_rank) == (cp, rank) and layout.cp_group is group
    assert layout.dp_cp_group.size() == layout.dp * cp
    g = torch.Generator().manual_seed(5)
    worst = 0.0
    for case in range(n_cases):
        lens = [
            2 * cp * int(torch.randint(0, 6, (), generator=g)) for _ in range(int(torch.randint(1, 5, (), generator=g)))
        ]
        if sum(lens) == 0:
            lens[0] = 2 * cp
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        total, heads, groups, dim = cu[-1], 4, 2 if case % 2 else 4, 8
        q, k, v = (torch.randn(total, h, dim, generator=g, dtype=torch.float64) for h in (heads, groups, groups))
        dout = torch.randn(total, heads, dim, generator=g, dtype=torch.float64)
        scale = 1.0 / math.sqrt(dim)
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = _dense_reference(*full, cu, scale)
        ref.backward(dout)
        local = [shard_tokens(t, cu, cp, rank, dim=0).requires_grad_(True) for t in (q, k, v)]
        out = context_parallel_attention(*local, torch.tensor(cu, dtype=torch.int32), group, softmax_scale=scale)
        out.backward(shard_tokens(dout, cu, cp, rank, dim=0))
        pairs = [(out, shard_tokens(ref.detach(), cu, cp, rank, dim=0))]
        pairs += [(a.grad, shard_tokens(b.grad, cu, cp, rank, dim=0)) for a, b in zip(local, full)]
        for got, want in pairs:
            err = float((got.detach() - want).abs().max() / want.abs().max().clamp_min(1e-12))
            assert err < 1e-10, f"case {case} cu={cu}: rel err {err:.2e}"
            worst = max(worst, err)
    return worst


def test_attention_matches_dense_reference_cp2():
    worst = run_ranks(_attention_cases, 2, 12, cp=2)
    print(f"cp=2 attention vs dense float64: worst rel err {max(worst):.2e}")
