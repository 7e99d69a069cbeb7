"""Routing replay (fnppo.megatron.routing) over real Megatron on CPU.

The model has a dense first layer and three MoE layers (global layers 1, 2, 3 are MoE layers 0, 1,
2), so the route of MoE layer ``j`` must reach the router of global layer ``j + 1`` on whichever
pipeline stage (and virtual stage) holds it. One process records the routes of the base weights
(``full0``) and computes every reference; the layouts (CP=2 x EP=2; TP=2 with sequence
parallelism x PP=2 with virtual pipeline 2 x EP=2) repeat the record and the replay on the
weights whose routers were redrawn (``full1``), where replay and free routing differ. What the
routers really chose is read by forward hooks on Megatron's routers, independently of fnppo's
record, and checked against positions computed here from the sample lengths.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fnppo
from fnppo.core.losses import Aggregation, LossConfig, ppo_clip
from fnppo.testing import run_ranks, synthetic_samples
from tests.messages import check_message, messages_of
from tests.test_moe import _cfg as _moe_cfg
from tests.test_moe import _compare

N = 8
TOPK = 2
PAD = 4  # packed micro-batches have padding inside segments (and CP=2 needs multiples of 4)
MOE_LAYERS = 3
REL = 1e-5
NMB = 4  # micro-batches (the interleaved schedule on gloo needs more micro-batches than stages)


def _cfg(**kw) -> fnppo.ModelConfig:
    return _moe_cfg(num_layers=4, moe_layer_freq=(0, 1, 1, 1), **kw)


def _samples():
    return synthetic_samples(N, seed=5)


def _layout_samples():
    """Samples of 7 tokens (one padding position per packed segment): every micro-batch has the same
    length, so the interleaved schedule's padding to one length adds no router tokens."""
    return synthetic_samples(N, seed=6, prompt_len=(3, 3), response_len=(4, 4))


def _step(nmb: int = NMB, layout: str = "packed") -> fnppo.StepConfig:
    loss = LossConfig(policy=ppo_clip(), agg=Aggregation("token-mean"), entropy_coef=0.01)
    return fnppo.StepConfig(loss=loss, num_microbatches=nmb, pad_to_multiple_of=PAD, layout=layout)


def _state(full: dict, cfg: fnppo.ModelConfig | None = None, **build_kw) -> fnppo.TrainState:
    chunks = fnppo.build_gpt(cfg or _cfg(), **build_kw)
    fnppo.models.load_full_weights(chunks, full)
    ddp = fnppo.wrap_ddp(chunks)
    return fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=10.0, adam_eps=10.0, clip_grad=0.0))


def _with(samples, **fields):
    """``samples`` with per-sample fields replaced (lists, one entry per sample)."""
    return [dataclasses.replace(s, **{k: v[i] for k, v in fields.items()}) for i, s in enumerate(samples)]


class _RouterTap:
    """Forward hooks on every Megatron router: (global layer, input rows, routing map, probs) per call."""

    def __init__(self, model) -> None:
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.handles = [r.register_forward_hook(self._hook) for r in fnppo.megatron.moe.routers(model)]

    def _hook(self, module, args, output) -> None:
        hidden = args[0].detach().reshape(-1, args[0].shape[-1]).double()
        self.calls.append((module.layer_number - 1, hidden, output[1].detach().clone(), output[0].detach().double()))

    def close(self) -> list:
        for h in self.handles:
            h.remove()
        return self.calls


class _FifoTap:
    """Forward pre-hooks on every router: (global layer, targets kept for the backward) per call."""

    def __init__(self, model) -> None:
        self.calls: list[tuple[int, int]] = []
        self.handles = [r.register_forward_pre_hook(self._hook) for r in fnppo.megatron.moe.routers(model)]

    def _hook(self, module, args) -> None:
        self.calls.append((module.layer_number - 1, len(module.router_replay.replay_backward_list)))

    def close(self) -> list:
        for h in self.handles:
            h.remove()
        return self.calls


# Recomputation settings and the global layers whose router runs again in the backward.
PARTIAL_RECOMPUTE = {
    "selective_moe": (dict(recompute_granularity="selective", recompute_modules=["moe"]), {1, 2, 3}),
    "selective_core_attn": (dict(recompute_granularity="selective", recompute_modules=["core_attn"]), set()),
    "block_2": (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2), {1}),
}


# --------------------------------------------------------------------------------------------
# one process: the record, every reference, recomputation, 300 experts, the refusals
# --------------------------------------------------------------------------------------------
def _reference() -> dict:
    cfg = _cfg()
    chunks = fnppo.build_gpt(cfg)
    fnppo.models.layout_invariant_init(chunks, seed=11, std=0.2)
    full0 = fnppo.models.gather_full_weights(chunks)
    full1 = dict(full0)
    g = torch.Generator().manual_seed(99)
    for name in full1:
        if name.endswith("router.weight"):  # the routers changed, everything else equal
            full1[name] = torch.randn(full1[name].shape, generator=g) * 0.2
    samples = _samples()
    out: dict = {"full0": full0, "full1": full1, "lengths": [len(s) for s in samples]}

    s0 = _state(full0)
    tap = _RouterTap(s0.model)
    lp0, _, routes = fnppo.compute_logprobs(s0.model, samples, config=_step(), return_routing=True)
    out.update(routes=routes, lp0=lp0, tap_record=tap.close())
    out["weights0"] = {k: v for k, v in full0.items() if k.endswith("router.weight")}
    replayed = _with(samples, routed_experts=routes)
    out["lp0_replay"], _ = fnppo.compute_logprobs(s0.model, replayed, config=_step())
    out["lp0_replay_padded"], _ = fnppo.compute_logprobs(s0.model, replayed, config=_step(3, "padded"))
    engine = _with(samples, routed_experts=[r[:-1] for r in routes])  # no route for the last token
    tap = _RouterTap(s0.model)
    out["lp0_engine"], _ = fnppo.compute_logprobs(s0.model, engine, config=_step())
    out["tap_engine"] = tap.close()
    out["collated_engine"] = fnppo.collate_microbatch(engine[:2], pad_to_multiple_of=PAD).routed_experts

    # an optimizer step (no replay) changes the routers: free routing moves, replay does not
    stepped, _ = fnppo.train_step(_state(full0), _with(samples, old_logprobs=lp0), _step())
    _, _, out["routes_after_step"] = fnppo.compute_logprobs(stepped.model, samples, config=_step(), return_routing=True)
    tap = _RouterTap(stepped.model)
    out["lp_after_step_replay"], _ = fnppo.compute_logprobs(stepped.model, replayed, config=_step())
    out["tap_after_step"] = tap.close()
    out["weights_after_step"] = {
        k: v for k, v in fnppo.models.gather_full_weights(stepped.model).items() if k.endswith("router.weight")
    }

    # the redrawn routers: the references of the layouts
    out.update(_layout_cases(full0, full1, None))
    # the replayed training step of the layouts, recomputing activations in the backward
    layout_samples = _layout_samples()
    out["layout_lengths"] = [len(s) for s in layout_samples]
    old = out["lp1_replay"]
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    s1 = _state(full1, _cfg(extra=recompute))
    tap = _RouterTap(s1.model)
    replayed_layout = _with(layout_samples, routed_experts=out["layout_routes"], old_logprobs=old)
    _, out["train_recompute"] = fnppo.train_step(s1, replayed_layout, _step())
    out["tap_train"] = tap.close()
    s1 = _state(full1, _cfg(extra=recompute))
    _, out["train_recompute_free"] = fnppo.train_step(s1, _with(layout_samples, old_logprobs=old), _step())

    for name, (extra, _) in PARTIAL_RECOMPUTE.items():
        s1 = _state(full1, _cfg(extra=extra))
        tap = _FifoTap(s1.model)
        _, out[f"train_{name}"] = fnppo.train_step(s1, replayed_layout, _step())
        out[f"fifo_{name}"] = tap.close()

    out["wide"] = _wide_model()
    out["errors"] = _error_cases(s0, samples, routes)
    return out


def _layout_cases(full0: dict, full1: dict, routes0: list | None, **build_kw) -> dict:
    """What every layout computes: its own record on ``full0``, then free log-probs and, replaying
    ``routes0`` (None: its own record), log-probs and a training step on ``full1``."""
    layout = fnppo.parallel.current_layout()
    samples = fnppo.shard_for_data_parallel(_layout_samples(), layout)
    out: dict = {}
    s0 = _state(full0, **build_kw)
    tap = _RouterTap(s0.model) if routes0 is None else None
    _, _, out["layout_routes"] = fnppo.compute_logprobs(s0.model, samples, config=_step(), return_routing=True)
    if tap is not None:  # how clear the choices are: the gap between the k-th and (k+1)-th logit
        gaps = []
        for layer, hidden, _, _ in tap.close():
            logits = hidden @ full0[f"decoder.layers.{layer}.mlp.router.weight"].double().T
            top = logits.topk(TOPK + 1, dim=-1).values
            gaps.append((top[:, TOPK - 1] - top[:, TOPK]).min())
        out["margin"] = float(min(gaps))
    routes0 = out["layout_routes"] if routes0 is None else fnppo.shard_for_data_parallel(routes0, layout)
    s1 = _state(full1, **build_kw)
    replayed = _with(samples, routed_experts=routes0)
    out["lp1_replay"], _ = fnppo.compute_logprobs(s1.model, replayed, config=_step())
    out["lp1_free"], _ = fnppo.compute_logprobs(s1.model, samples, config=_step())
    s1, metrics = fnppo.train_step(s1, _with(replayed, old_logprobs=out["lp1_replay"]), _step())
    out["train"] = {"metrics": metrics, "weights": fnppo.models.gather_full_weights(s1.model)}
    return out


def _wide_model() -> dict:
    """300 experts: recorded as int16 (uint8 would wrap above 255), replayed bit for bit."""
    cfg = fnppo.ModelConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=16,
        vocab_size=64,
        max_seq_len=32,
        num_experts=300,
        moe_topk=TOPK,
        moe_ffn_hidden_size=4,
    )
    chunks = fnppo.build_gpt(cfg)
    fnppo.models.layout_invariant_init(chunks, seed=3, std=0.5)
    samples = _samples()
    lp, _, routes = fnppo.compute_logprobs(chunks, samples, return_routing=True)
    lp2, _ = fnppo.compute_logprobs(chunks, _with(samples, routed_experts=routes))
    as_uint8 = _with(samples, routed_experts=[r.to(torch.uint8) for r in routes])
    return {
        "routes": routes,
        "lp": lp,
        "lp_replay": lp2,
        "errors": messages_of({"uint8": lambda: fnppo.compute_logprobs(chunks, as_uint8)}),
    }


def _error_cases(state, samples: list, routes: list) -> dict:
    dense = fnppo.build_gpt(
        fnppo.ModelConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=32, vocab_size=64, max_seq_len=32
        )
    )
    model = state.model

    def changed(i: int, token: int, layer: int, experts: list[int]):
        r = [t.clone() for t in routes]
        r[i][token, layer] = torch.tensor(experts, dtype=r[i].dtype)
        return _with(samples, routed_experts=r)

    no_slot = fnppo.build_gpt(_cfg(), moe_enable_routing_replay=False)  # Megatron's routers without replay slots
    replayed = _with(samples, routed_experts=routes)
    mixed = [replayed[0], samples[1], *replayed[2:]]
    mb = fnppo.collate_microbatch(replayed[:2])
    return messages_of(
        {
            "float": lambda: dataclasses.replace(samples[0], routed_experts=routes[0].float()),
            "rows": lambda: dataclasses.replace(samples[0], routed_experts=routes[0][:-2]),
            "range": lambda: fnppo.compute_logprobs(model, changed(2, 3, 1, [1, 4])),
            "duplicate": lambda: fnppo.train_step(
                state,
                _with(changed(5, 0, 2, [3, 3]), old_logprobs=[torch.zeros(s.response_len) for s in samples]),
                _step(),
            ),
            "layers": lambda: fnppo.compute_logprobs(model, _with(samples, routed_experts=[r[:, :2] for r in routes])),
            "mixed": lambda: fnppo.compute_logprobs(model, mixed),
            "negative": lambda: fnppo.collate_microbatch(changed(0, 1, 0, [-1, 2])[:1]),
            "dense": lambda: fnppo.compute_logprobs(dense, replayed),
            "dense_record": lambda: fnppo.compute_logprobs(dense, samples, return_routing=True),
            "record_replayed": lambda: fnppo.compute_logprobs(model, replayed, return_routing=True),
            "forward_only": lambda: fnppo.forward_only(
                model, [mb], lambda logits, m: None, recorder=fnppo.megatron.routing.RoutingRecorder(4)
            ),
            "no_slot": lambda: fnppo.compute_logprobs(no_slot, replayed),
        }
    )


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_reference, 1)[0]


# --------------------------------------------------------------------------------------------
# checks on the router's own view (hooks), with positions computed from the sample lengths
# --------------------------------------------------------------------------------------------
def _positions(lengths: list[int], nmb: int = NMB) -> list[tuple[int, int]]:
    """(micro-batch, offset of the sample's segment) of every sample: contiguous groups, packed
    segments of round_up(len, PAD)."""
    per = -(-len(lengths) // nmb)
    out, offset = [], 0
    for i, n in enumerate(lengths):
        if i % per == 0:
            offset = 0
        out.append((i // per, offset))
        offset += -(-n // PAD) * PAD
    return out


def _router_view(calls: list) -> dict[tuple[int, int], tuple]:
    """(micro-batch, MoE layer) -> (input rows, routing map, probs, global layer); the calls of a
    layer come in micro-batch order."""
    view, seen = {}, {}
    for layer, hidden, rmap, probs in calls:
        count = seen.get(layer, 0)
        seen[layer] = count + 1
        view[(count, layer - 1)] = (hidden, rmap, probs, layer)
    return view


def _chosen(view: dict, lengths: list[int], moe_layer: int, i: int) -> list[set]:
    m, off = _positions(lengths)[i]
    rmap = view[(m, moe_layer)][1]
    return [set(rmap[off + t].nonzero().flatten().tolist()) for t in range(lengths[i])]


def _recorded(routes: list, moe_layer: int, i: int) -> list[set]:
    return [set(row.tolist()) for row in routes[i][:, moe_layer]]


def test_record_is_what_the_routers_chose(reference):
    """The record (int16, [len, 3, 2]) equals the hooked routing maps of MoE layers 1..3 (the dense layer skipped)."""
    routes, lengths = reference["routes"], reference["lengths"]
    view = _router_view(reference["tap_record"])
    assert sorted({layer for _, _, _, layer in view.values()}) == [1, 2, 3]
    for i, r in enumerate(routes):
        assert r.dtype == torch.int16 and r.shape == (lengths[i], MOE_LAYERS, TOPK)
        for j in range(MOE_LAYERS):
            assert _recorded(routes, j, i) == _chosen(view, lengths, j, i), (i, j)


def test_replay_reproduces_recorded_logprobs_bit_for_bit(reference):
    for got, want in zip(reference["lp0_replay"], reference["lp0"], strict=True):
        assert torch.equal(got, want)
    # an inference engine's routes (no row for the last token): the same log-probs, bit for bit
    for got, want in zip(reference["lp0_engine"], reference["lp0"], strict=True):
        assert torch.equal(got, want)
    # the missing row and the padding hold -1 (the router chooses there), the others stay
    coll, (r0, r1) = reference["collated_engine"], reference["routes"][:2]
    n0 = reference["lengths"][0]
    seg0 = -(-n0 // PAD) * PAD
    assert torch.equal(coll[0, : n0 - 1], r0[:-1].int())
    assert torch.equal(coll[0, n0 - 1 : seg0], torch.full((seg0 - n0 + 1, MOE_LAYERS, TOPK), -1, dtype=torch.int32))
    assert torch.equal(coll[0, seg0 : seg0 + len(r1) - 1], r1[:-1].int())
    assert int((coll[0, seg0:] < 0).all(-1).all(-1).sum()) == -(-len(r1) // PAD) * PAD - len(r1) + 1
    # where the engine gave no route (and on padding) the router chose as when recording
    record, engine = _router_view(reference["tap_record"]), _router_view(reference["tap_engine"])
    for key, (_, rmap, _, _) in record.items():
        assert torch.equal(engine[key][1], rmap), key
    # another micro-batch split and the padded layout force the same experts: the same log-probs
    for got, want in zip(reference["lp0_replay_padded"], reference["lp0"], strict=True):
        assert (got - want).abs().max() <= REL * want.abs().max()


def test_after_a_step_replay_keeps_the_experts_and_free_routing_does_not(reference):
    routes, lengths = reference["routes"], reference["lengths"]
    moved = sum(
        int((a.sort(-1).values != b.sort(-1).values).any(-1).sum())
        for a, b in zip(routes, reference["routes_after_step"])
    )
    total = sum(r.shape[0] * r.shape[1] for r in routes)
    assert moved > total // 10, (moved, total)  # the step changed the routers' choice
    view = _router_view(reference["tap_after_step"])
    for i in range(N):
        for j in range(MOE_LAYERS):
            assert _chosen(view, lengths, j, i) == _recorded(routes, j, i), (i, j)
    # the gate weights are the current router's: softmax over its logits at the forced experts (float64)
    for (m, j), (hidden, _, probs, layer) in view.items():
        w = reference["weights_after_step"][f"decoder.layers.{layer}.mlp.router.weight"].double()
        logits = hidden @ w.T
        for i, (mi, off) in enumerate(_positions(lengths)):
            if mi != m:
                continue
            idx = routes[i][:, j].long()
            rows = torch.arange(lengths[i]) + off
            want = torch.softmax(logits[rows].gather(1, idx), dim=-1)
            assert (probs[rows].gather(1, idx) - want).abs().max() <= 1e-6, (i, j)


def test_train_step_replays_and_recomputation_replays_too(reference):
    """Forward and recomputed forward (in the backward) both force the routes: the router's view
    holds them twice per micro-batch, and the step equals the one without recomputation."""
    routes, lengths = reference["layout_routes"], reference["layout_lengths"]
    calls = reference["tap_train"]
    assert len(calls) == NMB * 2 * MOE_LAYERS  # micro-batches x (forward, recomputation) x layers
    by_layer: dict[int, list] = {}
    for call in calls:
        by_layer.setdefault(call[0], []).append(call)
    for which in (0, 1):  # the forward, then its recomputation in the backward
        view = _router_view([c for layer_calls in by_layer.values() for c in layer_calls[which::2]])
        for i in range(N):
            for j in range(MOE_LAYERS):
                assert _chosen(view, lengths, j, i) == _recorded(routes, j, i), (which, i, j)
    plain, recomputed, free = (
        reference["train"]["metrics"],
        reference["train_recompute"],
        reference["train_recompute_free"],
    )
    for key in ("loss", "grad_norm", "moe_aux_loss"):
        assert abs(recomputed[key] - plain[key]) <= 1e-6 * abs(plain[key]), key
    assert abs(free["grad_norm"] - plain["grad_norm"]) > 1e-3 * plain["grad_norm"]  # replay mattered


@pytest.mark.parametrize("name", sorted(PARTIAL_RECOMPUTE))
def test_routers_outside_the_recomputation_keep_no_targets(reference, name):
    """Selective recomputation without "moe", and "block" recomputation past its layers, leave some
    routers' forward alone: those keep no target for the backward (Megatron's FIFO would grow by one
    per micro-batch), the recomputed ones pop theirs, and the step equals the plain one."""
    recomputed = PARTIAL_RECOMPUTE[name][1]
    calls = reference[f"fifo_{name}"]
    for layer in (1, 2, 3):
        kept = [n for lay, n in calls if lay == layer]
        if layer in recomputed:  # forward and recomputation per micro-batch, each seeing the one target
            assert kept == [1] * (2 * NMB), (layer, kept)
        else:
            assert kept == [0] * NMB, (layer, kept)
    plain, got = reference["train"]["metrics"], reference[f"train_{name}"]
    for key in ("loss", "grad_norm", "moe_aux_loss"):
        assert abs(got[key] - plain[key]) <= 1e-6 * abs(plain[key]), key


def test_300_experts_are_recorded_without_overflow(reference):
    wide = reference["wide"]
    assert all(r.dtype == torch.int16 for r in wide["routes"])
    assert max(int(r.max()) for r in wide["routes"]) > 255
    for got, want in zip(wide["lp_replay"], wide["lp"], strict=True):
        assert torch.equal(got, want)
    check_message(
        fnppo.InputError(wide["errors"]["uint8"]),
        fnppo.InputError,
        "compute_logprobs",
        "batch[0].routed_experts",
        "an integer dtype that holds expert indices up to 299",
        "u8[10,1,2] (max 255)",
    )


ERRORS = {  # case -> (function, argument, expected, received)
    "float": ("Sample", "routed_experts", "None or an integer tensor [tokens, layers, topk]", "f32["),
    "rows": (
        "Sample",
        "routed_experts",
        "rows (one per token of prompt + response; the last token's may be missing)",
        "[",
    ),
    "range": (
        "compute_logprobs",
        "batch[2].routed_experts",
        "expert indices in [0, 4) (the model's num_experts)",
        "experts [1, 4] for token 3, MoE layer 1",
    ),
    "duplicate": (
        "train_step",
        "batch[5].routed_experts",
        "2 distinct experts per token and MoE layer",
        "experts [3, 3] for token 0, MoE layer 2",
    ),
    "layers": (
        "compute_logprobs",
        "batch[0].routed_experts",
        "[tokens, 3, 2] (the model's MoE layers and top-k)",
        ",2,2]",
    ),
    "mixed": (
        "compute_logprobs",
        "batch[1].routed_experts",
        "a tensor (batch[0] has routed_experts; all samples or none)",
        "None",
    ),
    "negative": (
        "collate_microbatch",
        "samples[0].routed_experts",
        "expert indices >= 0",
        "experts [-1, 2] for token 1, MoE layer 0",
    ),
    "dense": ("compute_logprobs", "batch[0].routed_experts", "None (the model has no MoE layers)", "int16["),
    "dense_record": ("compute_logprobs", "return_routing", "False for a model without MoE layers", "True"),
    "record_replayed": ("compute_logprobs", "return_routing", "False when the samples carry routed_experts", "True"),
    "forward_only": (
        "forward_only",
        "recorder",
        "None for micro-batches that carry routed_experts",
        "a RoutingRecorder",
    ),
    "no_slot": (
        "routed",
        "model",
        "MoE routers built with moe_enable_routing_replay=True (fnppo.build_gpt does)",
        "a router without a replay slot",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_routes_are_refused(reference, case):
    check_message(fnppo.InputError(reference["errors"][case]), fnppo.InputError, *ERRORS[case])


# --------------------------------------------------------------------------------------------
# layouts: CP=2 x EP=2, and TP=2 (sequence parallel) x PP=2 (virtual pipeline 2) x EP=2
# --------------------------------------------------------------------------------------------
LAYOUTS = {  # name: (world, run_ranks layout, build_gpt keywords)
    "cp2xep2": (2, dict(cp=2, ep=2), {}),
    "tp2sp-pp2vpp2-ep2": (4, dict(tp=2, pp=2, vpp=2, ep=2, etp=1), dict(sequence_parallel=True)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_record_and_replay_like_one_process(reference, name):
    world, layout, build_kw = LAYOUTS[name]
    results = run_ranks(
        _layout_cases, world, reference["full0"], reference["full1"], reference["layout_routes"], **layout, **build_kw
    )
    # exact agreement of the records needs every choice to be clear of float noise: it is
    assert reference["margin"] > 1e-4, reference["margin"]
    for rank, got in enumerate(results):
        for a, b in zip(got["layout_routes"], reference["layout_routes"], strict=True):
            assert torch.equal(a, b), f"{name} rank {rank}: recorded routes differ"
        for key in ("lp1_replay", "lp1_free"):
            for a, b in zip(got[key], reference[key], strict=True):
                assert (a - b).abs().max() <= REL * b.abs().max(), (name, rank, key)
    assert max(float((a - b).abs().max()) for a, b in zip(reference["lp1_replay"], reference["lp1_free"])) > 0.1
    keys = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_aux_loss_l1", "moe_tokens_l1_e1")
    worst = _compare(reference["train"], results[0]["train"], name, keys)
    print(f"{name}: max relative difference {worst:.2e} (smallest gap at the top-k boundary {reference['margin']:.3g})")


def test_sample_from_lists_takes_routes_as_int32():
    s = fnppo.Sample.from_lists([1, 2], [3], routed_experts=[[[0, 1]], [[1, 2]], [[2, 3]]])
    assert s.routed_experts.dtype == torch.int32 and s.routed_experts.shape == (3, 1, 2)
    engine = torch.tensor([[[0, 1]], [[1, 2]]], dtype=torch.uint8)  # an engine's tensor keeps its dtype, len - 1 rows
    assert fnppo.Sample.from_lists([1, 2], [3], routed_experts=engine).routed_experts.dtype == torch.uint8
