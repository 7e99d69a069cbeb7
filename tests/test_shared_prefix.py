"""Shared-prefix packing: a prompt group forwarded with its prompt once, the same numbers as unshared.

Pure parts (no ranks): the collated layout against the formula (every sample's tokens, labels,
positions and values where the unshared layout has them, a group of one collated as without
sharing), the attention against a float64 masked reference (values and gradients, NaN isolation),
the planner (groups whole or cut with the prompt repeated, token budgets in computed tokens, the
agreed count) and the refusals. Ranks: log-probs, entropies, the loss and the gradients shared vs
unshared under one process (dense, a token budget, the fused head, the critic, LoRA; and against a
plain-torch float64 GPT), TP=2, PP=2, DP=2 and MoE with EP=2 (routes recorded and replayed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fnppo
from fnppo.batching import ByCount, BySize, ByTokens, SharedPrefix
from fnppo.core.batching import split as S
from fnppo.core.batching.collate import collate_microbatch, pad_microbatch, unpack_per_sample
from fnppo.core.batching.prefix import prompt_groups
from fnppo.core.batching.sample import Sample
from fnppo.core.batching.split import split_batch
from fnppo.core.errors import InputError
from fnppo.megatron.packed_attention import shared_prefix_attention
from fnppo.testing import run_ranks, tiny_model_config
from tests.messages import check_message, raises_message
from tests.step_helpers import rel_err

F64 = torch.float64
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def grouped(sizes=(3, 3, 1, 3, 2), seed: int = 0, vocab: int = 64, prompt=(2, 7), response=(1, 7), **extra):
    """Samples in prompt groups of ``sizes`` (each group's samples consecutive), per-token values
    drawn around plausible ones; the second group declares its group id instead of relying on equal prompts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, size in enumerate(sizes):
        p = int(torch.randint(prompt[0], prompt[1], (), generator=g))
        ids = torch.randint(0, vocab, (p,), generator=g)
        for _ in range(size):
            r = int(torch.randint(response[0], response[1], (), generator=g))
            mask = torch.ones(r)
            if r > 2:
                mask[1] = 0.0
            out.append(
                Sample(
                    prompt_ids=ids.clone(),
                    response_ids=torch.randint(0, vocab, (r,), generator=g),
                    advantages=torch.randn(r, generator=g),
                    old_logprobs=-2.0 + 0.3 * torch.randn(r, generator=g),
                    ref_logprobs=-2.0 + 0.3 * torch.randn(r, generator=g),
                    values=0.3 * torch.randn(r, generator=g),
                    returns=torch.randn(r, generator=g),
                    response_mask=mask,
                    group=100 + k if k == 1 else None,
                    **extra,
                )
            )
    return out


# ---------------------------------------------------------------------------------------------
# The collated layout
# ---------------------------------------------------------------------------------------------
@SETTINGS
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4), seed=st.integers(0, 99), m=st.integers(1, 4))
def test_collated_layout_keeps_every_sample_where_the_formula_puts_it(sizes, seed, m):
    """Sample i with tokens z (prompt P, response R): z[:P-1] at its prefix span, z[P-1:] at its
    segment, labels z[t+1] (0 after the last), positions t, response values at segment + j, the
    prompt once per group; unpack gives the samples' values back; a group of one is the unshared
    collation field for field."""
    samples = grouped(tuple(sizes), seed=seed, prompt=(1, 6))
    mb = collate_microbatch(samples, share_prefix=True, pad_to_multiple_of=m)
    plain = collate_microbatch(samples, pad_to_multiple_of=m)
    groups = prompt_groups(samples)
    saved = sum((len(g) - 1) * (samples[g[0]].prompt_len - 1) for g in groups)
    assert mb.input_ids.shape[1] <= plain.input_ids.shape[1] - saved + m * len(groups)
    row = {k: getattr(mb, k)[0] for k in ("input_ids", "labels", "position_ids", "seq_ids", "loss_mask", "advantages")}
    for i, s in enumerate(samples):
        z = torch.cat([s.prompt_ids, s.response_ids])
        p, r = s.prompt_len, s.response_len
        a, seg = mb.spans[i]
        where = torch.cat([torch.arange(a, a + p - 1), torch.arange(seg, seg + r + 1)])
        assert torch.equal(row["input_ids"][where], z)
        assert torch.equal(row["labels"][where], torch.cat([z[1:], torch.zeros(1, dtype=z.dtype)]))
        assert torch.equal(row["position_ids"][where], torch.arange(p + r))
        assert torch.equal(row["seq_ids"][seg : seg + r + 1], torch.full((r + 1,), i))
        assert torch.equal(row["loss_mask"][seg : seg + r], s.response_mask)
        assert torch.equal(row["advantages"][seg : seg + r], s.advantages)
    assert [v.tolist() for v in unpack_per_sample(mb.advantages, mb)] == [s.advantages.tolist() for s in samples]
    assert float(mb.loss_mask.sum()) == float(plain.loss_mask.sum())  # every response token once
    # a group of one: the unshared collation
    alone = [samples[g[0]] for g in groups]
    one, two = (
        collate_microbatch(alone, share_prefix=True, pad_to_multiple_of=m),
        collate_microbatch(alone, pad_to_multiple_of=m),
    )
    for name in ("input_ids", "labels", "position_ids", "seq_ids", "loss_mask", "advantages", "cu_seqlens"):
        assert torch.equal(getattr(one, name), getattr(two, name)), name
    # padding to one length adds a run of its own; nothing real moves
    padded = pad_microbatch(mb, mb.input_ids.shape[1] + 5)
    assert padded.branch_ids[0, -5:].unique().numel() == 1 and int(padded.branch_ids[0, -1]) > int(mb.branch_ids.max())
    assert [v.tolist() for v in unpack_per_sample(padded.advantages, padded)] == [
        s.advantages.tolist() for s in samples
    ]


def test_routes_of_a_group_fill_the_prefix_once_and_each_segment():
    g = torch.Generator().manual_seed(3)

    def rows(n):  # [n tokens, 2 MoE layers, top-2] of distinct experts out of 4
        return torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(2 * n)]).view(n, 2, 2).to(torch.int32)

    prompt = torch.tensor([5, 6, 7])
    samples = []
    shared = rows(2)  # the prompt's first two tokens
    for r in (2, 4):
        own = rows(r)  # the last prompt token and r - 1 response tokens: the engine's len - 1 rows
        samples.append(Sample(prompt_ids=prompt, response_ids=torch.arange(r), routed_experts=torch.cat([shared, own])))
    mb = collate_microbatch(samples, share_prefix=True)
    routes = mb.routed_experts[0]
    assert torch.equal(routes[0:2], shared)
    for s, (_, seg) in zip(samples, mb.spans, strict=True):
        r = s.response_len
        assert torch.equal(routes[seg : seg + r], s.routed_experts[2:])
        assert bool((routes[seg + r] == -1).all())  # no route for the last token: the router chooses


# ---------------------------------------------------------------------------------------------
# The attention
# ---------------------------------------------------------------------------------------------
def _dense_reference(q, k, v, branch, root, scale):
    """float64 attention with the rule written out: j <= i and branch(j) in {branch(i), root(i)}."""
    t = q.shape[0]
    i = torch.arange(t)
    allowed = (i[:, None] >= i[None, :]) & ((branch[None, :] == branch[:, None]) | (branch[None, :] == root[:, None]))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_attention_equals_the_rule_in_float64(backend):
    samples = grouped((3, 1, 2), seed=5, prompt=(1, 6))
    mb = collate_microbatch(samples, share_prefix=True, pad_to_multiple_of=3)
    t = mb.input_ids.shape[1]
    g = torch.Generator().manual_seed(0)
    dtype = F64 if backend == "sdpa" else torch.float32  # flex runs eagerly on the CPU, forward only
    q, k, v = (torch.randn(t, h, 8, generator=g, dtype=dtype, requires_grad=backend == "sdpa") for h in (4, 2, 2))
    out = shared_prefix_attention(q, k, v, mb.branch_ids[0], mb.root_ids[0], backend=backend)
    ref = _dense_reference(q.double(), k.double(), v.double(), mb.branch_ids[0], mb.root_ids[0], 8**-0.5)
    assert float((out.double() - ref).abs().max()) <= (1e-12 if dtype == F64 else 2e-6)
    if backend == "sdpa":
        w = torch.randn(out.shape, generator=g, dtype=F64)
        got = torch.autograd.grad((out * w).sum(), (q, k, v))
        want = torch.autograd.grad((ref * w).sum(), (q, k, v))
        for a, b in zip(got, want, strict=True):
            assert float((a - b).abs().max()) <= 1e-12


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_a_nan_in_one_segment_reaches_neither_its_siblings_nor_the_prefix(backend):
    samples = grouped((3,), seed=1, prompt=(4, 6))
    mb = collate_microbatch(samples, share_prefix=True)
    t = mb.input_ids.shape[1]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, h, 8, generator=g) for h in (4, 2, 2))
    _, seg1 = mb.spans[1]
    v = v.clone()
    v[seg1 + 1, 0, 3] = float("nan")
    with torch.no_grad():
        out = shared_prefix_attention(q, k, v, mb.branch_ids[0], mb.root_ids[0], backend=backend)
    bad = torch.isnan(out).any(-1).any(-1)
    own = torch.zeros(t, dtype=torch.bool)
    own[seg1 : seg1 + samples[1].response_len + 1] = True
    assert not bool((bad & ~own).any())  # neither the prefix nor the other segments
    assert bool(bad[seg1 + 1 : seg1 + samples[1].response_len + 1].all())  # the tokens that see it


# ---------------------------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------------------------
def test_groups_are_kept_whole_and_a_budget_counts_computed_tokens():
    samples = grouped((4, 4, 2), seed=2, prompt=(6, 7), response=(1, 4))
    for i in range(len(samples)):
        samples[i] = dataclasses.replace(samples[i], group=None)
    plan = split_batch(samples, ByCount(3), packing=SharedPrefix())
    assert [sorted(g) for g in plan.microbatches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # the budget is a cap on the collated (shared) micro-batch, which holds more samples than unshared
    budget = max(collate_microbatch(samples[:4], share_prefix=True).input_ids.numel(), 20)
    shared = split_batch(samples, ByTokens(budget), packing=SharedPrefix())
    for g in shared.microbatches:
        assert collate_microbatch([samples[i] for i in g], share_prefix=True).input_ids.numel() <= budget
    assert shared.num_microbatches < split_batch(samples, ByTokens(budget)).num_microbatches
    # a group larger than the budget is cut into sub-groups that repeat the prompt
    small = collate_microbatch(samples[:2], share_prefix=True).input_ids.numel()
    cut = split_batch(samples, ByTokens(small), packing=SharedPrefix())
    for g in cut.microbatches:
        assert collate_microbatch([samples[i] for i in g], share_prefix=True).input_ids.numel() <= small
    # ... and refused with split_groups=False, naming the group
    with raises_message(
        "split_batch",
        "samples[0]",
        "keeps the group (samples[0], samples[1], samples[2], samples[3]) whole",
        "a group of 4 samples",
    ):
        split_batch(samples, ByTokens(small), packing=SharedPrefix(split_groups=False))
    # more micro-batches agreed over data-parallel ranks than whole groups: refused on every rank
    with mock.patch.object(S, "_agree", lambda k, n, g: (max(k, 4), n)):
        with raises_message(
            "split_batch", "samples", "at least 4 prompt groups (kept whole", "3 prompt groups on some rank"
        ):
            split_batch(samples, ByCount(3), packing=SharedPrefix(split_groups=False), dp_group=object())
    # more micro-batches than groups: groups halved, the prompt repeated; BySize counts samples
    assert split_batch(samples, ByCount(6), packing=SharedPrefix()).num_microbatches == 6
    assert all(len(g) <= 3 for g in split_batch(samples, BySize(3), packing=SharedPrefix()).microbatches)


@SETTINGS
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5), seed=st.integers(0, 50), extra=st.integers(0, 8))
def test_shared_plans_hold_their_cap_and_the_agreed_count(sizes, seed, extra):
    samples = grouped(tuple(sizes), seed=seed)
    longest = max(len(s) for s in samples)
    budget = longest + 3 * seed % 20
    plan = split_batch(samples, ByTokens(budget), packing=SharedPrefix())
    agreed = min(len(samples), plan.num_microbatches + extra)
    with mock.patch.object(S, "_agree", lambda k, n, g: (max(k, agreed), n)):
        wider = split_batch(samples, ByTokens(budget), packing=SharedPrefix(), dp_group=object())
    assert wider.num_microbatches == agreed
    for p in (plan, wider):
        assert sorted(p.order) == list(range(len(samples))) and all(p.microbatches)
        for g in p.microbatches:
            assert collate_microbatch([samples[i] for i in g], share_prefix=True).input_ids.numel() <= budget


def test_core_refusals():
    samples = grouped((2, 2), seed=4)
    liar = dataclasses.replace(samples[3], prompt_ids=samples[3].prompt_ids + 1)  # declares group 101, other prompt
    with raises_message(
        "split_batch", "samples[3].prompt_ids", "the prompt of samples[2] (both declare group=101", "tokens) (vs"
    ):
        split_batch([*samples[:3], liar], ByCount(1), packing=SharedPrefix())
    with raises_message("collate_microbatch", "samples[3].prompt_ids", "the prompt of samples[2]", "tokens) (vs"):
        collate_microbatch([*samples[:3], liar], share_prefix=True)
    image = dataclasses.replace(samples[1], multi_modal={"images": torch.zeros(1, 3)})
    with raises_message(
        "split_batch", "samples[1].multi_modal", "no multi-modal items with shared-prefix packing", "['images']"
    ):
        split_batch([samples[0], image], ByCount(1), packing=SharedPrefix())
    routes = [torch.tensor([[[0, 1]]] * len(s), dtype=torch.int32) for s in samples[:2]]
    routes[1][0, 0, 0] = 3
    routed = [dataclasses.replace(s, routed_experts=r) for s, r in zip(samples[:2], routes, strict=True)]
    with raises_message(
        "collate_microbatch",
        "samples[1].routed_experts",
        "the routes of samples[0] on the shared prompt tokens",
        "other experts",
    ):
        collate_microbatch(routed, share_prefix=True)
    with raises_message("split_batch", "layout", "'packed' with shared-prefix packing", "'padded'"):
        split_batch(samples, ByCount(1), packing=SharedPrefix(), layout="padded")
    with raises_message("collate_microbatch", "layout", "'packed' with share_prefix=True", "'padded'"):
        collate_microbatch(samples, share_prefix=True, layout="padded")
    for bad in ("yes", 1, None):
        with raises_message("fnppo.SharedPrefix", "split_groups", "a bool", repr(bad)):
            SharedPrefix(split_groups=bad)
    with raises_message("StepConfig", "packing", "None or a fnppo.batching.SharedPrefix", "'shared'"):
        fnppo.StepConfig(packing="shared")
    with raises_message("CriticConfig", "layout", "'packed' with shared-prefix packing", "'padded'"):
        fnppo.CriticConfig(packing=SharedPrefix(), layout="padded")
    for bad in (-1, True, 1.5, "a"):
        with raises_message("Sample", "group", "None or an int >= 0", ""):
            dataclasses.replace(samples[0], group=bad)


# ---------------------------------------------------------------------------------------------
# Steps on ranks: shared vs unshared, and a plain-torch float64 GPT
# ---------------------------------------------------------------------------------------------
def gpt_float64(weights: dict, ids: torch.Tensor, *, layers: int, heads: int = 4, groups: int = 2, eps: float = 1e-6):
    """Logits ``[L, vocab]`` of the tiny GPT (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied
    embeddings) in float64, written from the architecture: Megatron's fused QKV rows per query
    group are ``[q heads, k, v]``, its gated MLP's first half the gate."""
    w = {k: v.double() for k, v in weights.items()}
    x = w["embedding.word_embeddings.weight"][ids]
    n, hidden = x.shape
    dim = hidden // heads
    inv = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=F64) / dim)
    angles = torch.outer(torch.arange(n, dtype=F64), inv)
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

    def rope(t):
        return t * cos + torch.cat([-t[..., dim // 2 :], t[..., : dim // 2]], -1) * sin

    def rms(t, weight):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) * weight

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(layers):
        p = f"decoder.layers.{layer}."
        qkv = (rms(x, w[p + "input_layernorm.weight"]) @ w[p + "self_attention.linear_qkv.weight"].T).view(
            n, groups, heads // groups + 2, dim
        )
        q = rope(qkv[:, :, :-2].reshape(n, heads, dim))
        k = rope(qkv[:, :, -2]).repeat_interleave(heads // groups, 1)
        v = qkv[:, :, -1].repeat_interleave(heads // groups, 1)
        probs = (torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)).masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", probs, v).reshape(n, hidden) @ w[p + "self_attention.linear_proj.weight"].T
        gate, up = (rms(x, w[p + "pre_mlp_layernorm.weight"]) @ w[p + "mlp.linear_fc1.weight"].T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.linear_fc2.weight"].T
    return rms(x, w["decoder.final_layernorm.weight"]) @ w["embedding.word_embeddings.weight"].T


def _reference(weights: dict, samples: list, layers: int) -> dict:
    """Per-sample log-probs and entropies of every response token, and the gradient of the
    on-policy clipped loss (token-mean: ``-sum mask * A * exp(lp - old) / sum mask``), in float64."""
    params = {k: v.double().requires_grad_(True) for k, v in weights.items()}
    lps, ents, terms, count = [], [], [], 0.0
    for s in samples:
        z = torch.cat([s.prompt_ids, s.response_ids])
        logp = gpt_float64(params, z, layers=layers).log_softmax(-1)[s.prompt_len - 1 : len(z) - 1]
        lp = logp.gather(-1, s.response_ids[:, None]).squeeze(-1)
        lps.append(lp.detach())
        ents.append(-(logp.exp() * logp).sum(-1).detach())
        ratio = torch.exp(lp - s.old_logprobs.double())
        terms.append(-(s.response_mask.double() * s.advantages.double() * ratio).sum())
        count += float(s.response_mask.sum())
    loss = torch.stack(terms).sum() / count
    grads = torch.autograd.grad(loss, list(params.values()))
    return {"lp": lps, "ent": ents, "grads": dict(zip(params, grads, strict=True))}


def _state(model_cfg, head: str = "lm", lora: bool = False):
    chunks = fnppo.build_gpt(model_cfg, head=head)
    fnppo.models.layout_invariant_init(chunks, seed=3, std=0.2 if model_cfg.num_experts else None)
    if lora:
        fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(rank=4, alpha=8.0, seed=5))
        full = fnppo.models.gather_full_weights(chunks, adapters=True)
        g = torch.Generator().manual_seed(5)
        fnppo.models.load_full_weights(
            chunks, {k: 0.3 * torch.randn(t.shape, generator=g) for k, t in full.items()}, adapters=True
        )
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    opt = fnppo.build_optimizer(ddp, lr=1e-3, adam_eps=10.0, clip_grad=0.0)
    return fnppo.TrainState(model=ddp, optimizer=opt)


@contextlib.contextmanager
def _grads(state) -> Iterator[dict]:
    """The trained parameters' ``main_grad`` as :func:`fnppo.megatron.grads.finalize_grads` hands
    them to the optimizer, by name (as tests/step_helpers.finalized_grads, for frozen weights too)."""
    import fnppo.steps.schedule as step_module

    real, out = step_module.finalize_grads, {}

    def spy(model, **kw):
        stats = real(model, **kw)
        for c in model:
            for n, p in fnppo.megatron.unwrap.unwrap_model(c).named_parameters():
                if p.requires_grad:
                    out[n] = p.main_grad.detach().clone()
        return stats

    step_module.finalize_grads = spy
    try:
        yield out
    finally:
        step_module.finalize_grads = real


def _policy_run(model_cfg, samples, packing, *, lora=False, replay=False, **cfg_kw) -> dict:
    """compute_logprobs (with entropies; with ``replay`` also the recorded routes, replayed) and
    one train_step's finalized gradients on this rank."""
    from fnppo.core.losses import Aggregation, KLPenalty, LossConfig, ppo_clip

    state = _state(model_cfg, lora=lora)
    kl = cfg_kw.pop("kl", True)
    loss = LossConfig(
        policy=ppo_clip(),
        agg=Aggregation(cfg_kw.pop("agg", "token-mean")),
        entropy_coef=0.01 if kl else 0.0,
        kl=KLPenalty(0.05, "k3") if kl else None,
    )
    cfg = fnppo.StepConfig(loss=loss, packing=packing, **cfg_kw)
    out: dict = {"weights": fnppo.models.gather_full_weights(state.model)}
    if replay:
        _, _, routes = fnppo.compute_logprobs(state.model, samples, config=cfg, return_routing=True)
        out["routes"] = routes
        samples = [dataclasses.replace(s, routed_experts=r) for s, r in zip(samples, routes, strict=True)]
    out["lp"], out["ent"] = fnppo.compute_logprobs(state.model, samples, with_entropy=True, config=cfg)
    if not kl:  # on-policy: the ratio is 1 and nothing is clipped
        samples = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(samples, out["lp"], strict=True)]
    with _grads(state) as out["grads"]:
        _, out["metrics"] = fnppo.train_step(state, samples, cfg)
    return out


def _critic_run(model_cfg, samples, packing) -> dict:
    state = _state(model_cfg, head="value")
    cfg = fnppo.CriticConfig(packing=packing)
    out = {"values": fnppo.compute_values(state.model, samples, config=cfg)}
    with _grads(state) as out["grads"]:
        _, out["metrics"] = fnppo.critic_step(state, samples, cfg)
    return out


def _one_process_worker() -> dict:
    model_cfg = tiny_model_config(num_layers=2, tie_embeddings=True)
    samples = grouped()
    out = {}
    for name, packing in (("plain", None), ("shared", SharedPrefix())):
        out[name] = {
            "step": _policy_run(model_cfg, samples, packing, kl=False),
            "fused-budget": _policy_run(
                model_cfg,
                samples,
                packing,
                max_tokens_per_microbatch=20,
                agg="seq-mean-token-mean",
                fns=fnppo.StepFns.fused(),
            ),
            "lora": _policy_run(model_cfg, samples, packing, lora=True, num_microbatches=2),
            "critic": _critic_run(model_cfg, samples, packing),
        }
    return out


def _parallel_worker(moe: bool) -> dict:
    layout = fnppo.parallel.current_layout()
    model_cfg = tiny_model_config(num_layers=2, tie_embeddings=not moe, moe=moe)
    samples = fnppo.shard_for_data_parallel(grouped(), layout)
    out = {}
    for name, packing in (("plain", None), ("shared", SharedPrefix())):
        out[name] = _policy_run(model_cfg, samples, packing, replay=moe, num_microbatches=2)
        out[name].pop("weights")
    return out


def _assert_same(plain: dict, shared: dict, what: str) -> None:
    """Shared equals unshared: log-probs/entropies/values to fp32 rounding, the loss metrics, and every
    finalized gradient within 1e-6 of the largest entry of its tensor."""
    for key in ("lp", "ent", "values", "routes"):
        for a, b in zip(plain.get(key, []), shared.get(key, []), strict=True):
            if key == "routes":
                assert torch.equal(a, b), f"{what}: {key}"
            else:
                torch.testing.assert_close(b, a, rtol=1e-6, atol=2e-6, msg=f"{what}: {key}")
    for key in ("loss", "pg_loss", "entropy", "kl_loss", "vf_loss", "grad_norm"):
        if key in plain["metrics"]:
            r, g = plain["metrics"][key], shared["metrics"][key]
            assert abs(g - r) <= 1e-6 * max(abs(r), 1e-6), f"{what}: {key} {g} vs {r}"
    assert plain["grads"].keys() == shared["grads"].keys()
    for name, ref in plain["grads"].items():
        if float(ref.abs().max()) > 0:
            err = rel_err(shared["grads"][name], ref)
            assert err <= 1e-6, f"{what}: gradient of {name} rel err {err:.2e}"


def test_shared_equals_unshared_and_a_float64_gpt_in_one_process():
    out = run_ranks(_one_process_worker, 1)[0]
    for case in ("step", "fused-budget", "lora", "critic"):
        _assert_same(out["plain"][case], out["shared"][case], case)
    shared = out["shared"]["step"]
    onpolicy = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(grouped(), shared["lp"], strict=True)]
    ref = _reference(shared["weights"], onpolicy, layers=2)
    for got, want in zip(shared["lp"], ref["lp"], strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    for got, want in zip(shared["ent"], ref["ent"], strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    for name, want in ref["grads"].items():
        assert rel_err(shared["grads"][name], want) <= 1e-4, name


@pytest.mark.parametrize(
    "moe,layout",
    [(False, dict(tp=2)), (False, dict(pp=2)), (False, {}), (True, dict(ep=2))],
    ids=["tp2", "pp2", "dp2", "moe-ep2"],
)
def test_shared_equals_unshared_on_two_ranks(moe, layout):
    for rank, out in enumerate(run_ranks(_parallel_worker, 2, moe, **layout)):
        _assert_same(out["plain"], out["shared"], f"rank {rank}")


def _model_refusals() -> dict:
    """compute_logprobs / train_step with shared-prefix packing where it is not exact, and the
    same calls without it (they run)."""
    from unittest import mock as umock

    from tests.messages import messages_of

    layout = fnppo.parallel.current_layout()
    samples = fnppo.shard_for_data_parallel(grouped((2, 2)), layout)
    shared = fnppo.StepConfig(packing=SharedPrefix())
    calls = {}
    if layout.cp > 1:
        state = _state(tiny_model_config())
        calls["cp"] = lambda: fnppo.train_step(state, samples, shared)
        calls["cp-unshared"] = lambda: fnppo.compute_logprobs(state.model, samples)
        return messages_of(calls)
    from fnppo.megatron.vlm_model import build_vlm
    from tests.test_vlm import _lm_cfg, _vision

    vlm = build_vlm(_lm_cfg(), _vision())
    calls["vlm"] = lambda: fnppo.compute_logprobs(vlm, samples, config=shared)
    invariant = fnppo.build_gpt(tiny_model_config(batch_invariant=True))
    plain = fnppo.build_gpt(tiny_model_config())
    calls["invariant"] = lambda: fnppo.compute_logprobs(invariant, samples, config=shared)
    calls["invariant-unshared"] = lambda: fnppo.compute_logprobs(invariant, samples)
    with umock.patch("fnppo.steps.checks.uses_transformer_engine", lambda core: True):
        calls["te"] = messages_of({"te": lambda: fnppo.compute_logprobs(plain, samples, config=shared)})["te"]

    def own_collate(group, **kw):
        return fnppo.collate_microbatch(group, **kw)

    own = dataclasses.replace(shared, fns=fnppo.StepFns(collate=own_collate))
    calls["collate"] = lambda: fnppo.compute_logprobs(plain, samples, config=own)
    calls["collate-unshared"] = lambda: fnppo.compute_logprobs(
        plain, samples, config=dataclasses.replace(own, packing=None)
    )
    te = calls.pop("te")
    out = messages_of(calls)
    out["te"] = te
    return out


def test_shared_prefix_is_refused_where_it_is_not_exact():
    got = run_ranks(_model_refusals, 1)[0]
    expected = {
        "invariant": ("None with the batch-invariant mode", "SharedPrefix(split_groups=True)"),
        "te": ("None with Transformer Engine's layer spec", "SharedPrefix("),
        "vlm": ("None with a vision-language model", "SharedPrefix("),
    }
    for case, (want, received) in expected.items():
        check_message(InputError(got[case]), InputError, "compute_logprobs", "config.packing", want, received)
    check_message(
        InputError(got["collate"]),
        InputError,
        "compute_logprobs",
        "config.fns.collate",
        "collate_microbatch with shared-prefix packing",
        "own_collate",
    )
    assert got["invariant-unshared"] == "no error" and got["collate-unshared"] == "no error"
    (cp,) = {m for m in (r["cp"] for r in run_ranks(_model_refusals, 2, cp=2))}
    check_message(
        InputError(cp),
        InputError,
        "train_step",
        "config.packing",
        "None with context parallelism (cp=2)",
        "SharedPrefix(",
    )
