"""Context parallelism: the load-balanced sharding (pure) and exact attention over gloo CP ranks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnppo.core.batching.context_parallel import cp_token_index, shard_microbatch, shard_tokens, unshard_tokens
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
    from fnppo.core.batching.context_parallel import context_parallel_attention

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


# --------------------------------------------------------------------------------------------
# batch-invariant mode: the CP shard's attention rows have the bits of one process
# --------------------------------------------------------------------------------------------
def _invariant_attention_cases() -> int:
    from megatron.core import parallel_state as ps

    from fnppo.core.batching.context_parallel import context_parallel_sequence_attention
    from fnppo.core.kernels.invariant import sequence_attention

    group = ps.get_context_parallel_group()
    cp, rank = group.size(), group.rank()
    g = torch.Generator().manual_seed(7)
    checked = 0
    for lens in ([4, 300, 68, 0, 132], [128], [8, 4, 260]):
        cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
        total, heads, groups, dim = cu[-1], 4, 2, 32
        q, k, v = (torch.randn(total, h, dim, generator=g) for h in (heads, groups, groups))
        dout = torch.randn(total, heads, dim, generator=g)
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = sequence_attention(*full, cu, softmax_scale=0.3, block=16)
        ref.backward(dout)
        local = [shard_tokens(t, cu, cp, rank, dim=0).requires_grad_(True) for t in (q, k, v)]
        cu_t = torch.tensor(cu, dtype=torch.int32)
        out = context_parallel_sequence_attention(*local, cu_t, group, softmax_scale=0.3, block=16)
        out.backward(shard_tokens(dout, cu, cp, rank, dim=0))
        assert torch.equal(out.detach(), shard_tokens(ref.detach(), cu, cp, rank, dim=0)), f"lens={lens}: bits differ"
        for a, b in zip(local, full):
            torch.testing.assert_close(a.grad, shard_tokens(b.grad, cu, cp, rank, dim=0), rtol=1e-5, atol=1e-6)
        checked += out.shape[0]
    # a NaN key in one segment never reaches another segment's rows
    cu = [0, 132, 264, 268]
    q, k, v = (torch.randn(268, h, 32, generator=g) for h in (4, 2, 2))
    k[140, 1, 3] = float("nan")
    local = [shard_tokens(t, cu, cp, rank, dim=0) for t in (q, k, v)]
    out = context_parallel_sequence_attention(*local, torch.tensor(cu, dtype=torch.int32), group, block=16)
    pos = cp_token_index(cu, cp, rank)
    other = (pos < 132) | (pos >= 264)
    assert bool(torch.isfinite(out[other]).all()) and bool(torch.isnan(out[pos >= 140]).any())
    return checked


def test_invariant_attention_rows_have_the_bits_of_one_process_cp2():
    """Lengths across several 16-token query blocks (chunks straddling blocks on both ranks): each
    rank's rows equal those of ``sequence_attention`` on the whole pack bit for bit; gradients
    of the shards match the unsharded ones; a NaN key stays in its segment."""
    checked = run_ranks(_invariant_attention_cases, 2, cp=2)
    assert sum(checked) == 504 + 128 + 272  # every token of the three packs, once


# --------------------------------------------------------------------------------------------
# batch-invariant mode, real Megatron: CP=2 log-probs and entropies have the bits of CP=1
# --------------------------------------------------------------------------------------------
# (prompt, response) lengths: segments of 5 to 300 tokens, several 64-token attention blocks
INVARIANT_LENGTHS = ((3, 2), (120, 180), (7, 60), (64, 1), (150, 90), (30, 33), (9, 4))


def _invariant_samples() -> list:
    import fnppo

    g = torch.Generator().manual_seed(11)
    return [
        fnppo.Sample.from_lists(
            torch.randint(0, 64, (p,), generator=g), torch.randint(0, 64, (r,), generator=g), advantages=(-1.0) ** i
        )
        for i, (p, r) in enumerate(INVARIANT_LENGTHS)
    ]


def _invariant_run(old=None) -> dict:
    import dataclasses

    import fnppo
    from fnppo.core.losses import Aggregation, LossConfig, ppo_clip
    from fnppo.testing import tiny_model_config

    layout = fnppo.parallel.current_layout()
    chunks = fnppo.build_gpt(tiny_model_config(max_seq_len=320, kv_channels=32, batch_invariant=True))
    fnppo.models.layout_invariant_init(chunks, seed=3)
    ddp = fnppo.wrap_ddp(chunks)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-3))
    samples = _invariant_samples()
    order = [4, 0, 6, 2, 5, 1, 3]
    one = fnppo.compute_logprobs(state.model, samples, with_entropy=True)
    lp, ent = fnppo.compute_logprobs(state.model, [samples[i] for i in order], with_entropy=True, num_microbatches=3)
    back = sorted(zip(order, lp, ent), key=lambda t: t[0])
    split = ([t[1] for t in back], [t[2] for t in back])
    old = one[0] if old is None else old
    batch = [dataclasses.replace(s, old_logprobs=o) for s, o in zip(samples, old, strict=True)]
    loss = LossConfig(policy=ppo_clip(), agg=Aggregation("token-mean"))
    _, metrics = fnppo.train_step(state, batch, fnppo.StepConfig(loss=loss, num_microbatches=2))
    keys = ("onpolicy/max_abs_logprob_diff", "loss", "grad_norm")
    refused = _other_attention_refused() if layout.cp > 1 else None
    out = {"one": one, "split": split, "metrics": {k: metrics[k] for k in keys}, "refused": refused}
    return out if layout.rank == 0 else {}


class _OtherAttention(torch.nn.Module):
    """A core attention that is not fnppo's (as Transformer Engine's spec has one), built and never run."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__()


def _other_attention_refused() -> str:
    import dataclasses

    import fnppo
    from fnppo.testing import tiny_model_config

    cfg = tiny_model_config(batch_invariant=True)
    spec = fnppo.models.local_layer_spec(cfg)
    attn = spec.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=_OtherAttention))
    spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))
    with pytest.raises(InputError) as err:
        fnppo.build_gpt(cfg, layer_spec=spec)
    return str(err.value)


def _same_bits(ref, got) -> int:
    return sum(int(a.shape != b.shape) or int((a != b).sum()) for a, b in zip(ref, got, strict=True))


def test_batch_invariant_logprobs_under_cp2_have_the_bits_of_cp1():
    """One tiny batch-invariant model, the same full weights without CP (2 data-parallel ranks given the
    same whole batch, each computing it as one process does) and on 2 CP ranks: log-probs
    and entropies of compute_logprobs equal bit for bit in two compositions (one packed micro-batch;
    shuffled into 3), and train_step under CP=2 with old log-probs from CP=1 sees a gap of exactly 0;
    its loss and grad norm match CP=1's to fp32 rounding (the backward is exact, not invariant)."""
    ref = run_ranks(_invariant_run, 2)[0]  # cp=1, dp=2: each rank computes the whole batch alone
    got = run_ranks(_invariant_run, 2, ref["one"][0], cp=2)[0]
    assert all(bool(torch.isfinite(t).all()) for t in ref["one"][0] + ref["one"][1])
    for name, res in (("cp1 split", ref["split"]), ("cp2 one", got["one"]), ("cp2 split", got["split"])):
        diffs = (_same_bits(ref["one"][0], res[0]), _same_bits(ref["one"][1], res[1]))
        assert diffs == (0, 0), f"{name}: (log-prob, entropy) values with other bits than cp1 one: {diffs}"
    assert ref["metrics"]["onpolicy/max_abs_logprob_diff"] == 0.0
    assert got["metrics"]["onpolicy/max_abs_logprob_diff"] == 0.0
    for key in ("loss", "grad_norm"):
        assert math.isclose(got["metrics"][key], ref["metrics"][key], rel_tol=1e-5, abs_tol=1e-7), key
    # another core attention (Transformer Engine's spec) under CP in the mode: refused when built
    assert "argument 'layer_spec' expected a spec whose core attention is fnppo's" in got["refused"]
    assert "_OtherAttention" in got["refused"]
