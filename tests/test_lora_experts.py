"""LoRA on stacked MoE experts (``ModelConfig(moe_experts="stacked")``) against Megatron's
``SequentialMLP`` path, per expert and shared, in one process and under expert parallelism 2.

Both expert modules are built from the same full base weights (``layout_invariant_init``) and take
the same full random adapters (``B`` non-zero, so every ``A`` gets a gradient), then run one
``train_step`` (an Adam step with ``eps = 1``, about the gradient itself). The loss, the grad norm,
the log-probs and the updated full adapters of the stacked experts must equal the SequentialMLP
path's to fp32 rounding (1e-5 relative), in one process and under EP=2; the shared layout's (one
adapter for all experts of a layer, stacked only) must be the same under EP=1 and EP=2, and equal a
float64 plain-torch evaluation of the shared adapter in the sequential model's terms: the
SequentialMLP path with every expert's adapter set to the shared one gives the same log-probs, and
the shared adapter's gradient is the sum of the per-expert gradients there.
"""

from __future__ import annotations

import re
import zlib

import pytest
import torch

import fnppo
from fnppo.core.errors import InputError
from fnppo.megatron.stacked_experts import named_weights
from fnppo.megatron.unwrap import unwrap_model
from fnppo.testing import run_ranks, synthetic_samples
from tests.test_lora import _holds_adapters_only

LORA = dict(rank=4, alpha=12.0, seed=5)
REL = 1e-5


def _cfg(experts: str) -> fnppo.ModelConfig:
    return fnppo.ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        vocab_size=64,
        max_seq_len=32,
        num_experts=4,
        moe_topk=2,
        moe_ffn_hidden_size=48,
        moe_load_balancing="none",
        moe_experts=experts,
    )


def _random(full: dict) -> dict:
    out = {}
    for name, t in full.items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out[name] = torch.randn(t.shape, generator=g) * 0.3
    return out


def _shared_as_per_expert(shared: dict, experts: int) -> dict:
    """Full per-expert adapters (SequentialMLP names) that all equal the shared ones."""
    out = {}
    for name, t in shared.items():
        if ".mlp.experts." in name:
            head, _, tail = name.partition(".mlp.experts.")
            for e in range(experts):
                out[f"{head}.mlp.experts.local_experts.{e}.{tail}"] = t.clone()
        else:
            out[name] = t
    return out


def _run(experts: str, layout: str, adapters: dict | None) -> dict:
    chunks = fnppo.build_gpt(_cfg(experts))
    fnppo.models.layout_invariant_init(chunks, seed=3, std=0.2)
    fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(**LORA, expert_layout=layout))
    init = fnppo.models.gather_full_weights(chunks, adapters=True)
    full = _random(init) if adapters is None else adapters
    fnppo.models.load_full_weights(chunks, full, adapters=True)
    ddp = fnppo.wrap_ddp(chunks)
    every = synthetic_samples(8, seed=7)  # log-probs of all samples on every rank
    lps, _ = fnppo.compute_logprobs(ddp, every)
    off, _ = fnppo.compute_logprobs(ddp, every, params=fnppo.lora.adapters_off(ddp))
    samples = fnppo.shard_for_data_parallel(every)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=0.5, adam_eps=1.0, clip_grad=0.0))
    loss = fnppo.losses.from_flat(loss_agg_mode="token-mean", kl_coef=0.05)
    state, metrics = fnppo.train_step(state, samples, fnppo.StepConfig(loss=loss, num_microbatches=2))
    plain = fnppo.build_gpt(_cfg(experts))  # the same base without adapters: the reference policy
    fnppo.models.layout_invariant_init(plain, seed=3, std=0.2)
    base, _ = fnppo.compute_logprobs(fnppo.wrap_ddp(plain), every)
    grads = {}
    for n, p in named_weights(unwrap_model(ddp[0]), adapters=True):  # stacked: per-expert views
        if "experts" in n:
            main = getattr(p, "main_grad", None)
            grads[n] = (main if main is not None else p._base.main_grad[int(n[-1])]).detach().clone().float()
    return {
        "init": init,
        "full": full,
        "logprobs": torch.cat(lps),
        "off": torch.cat(off),
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "after": fnppo.models.gather_full_weights(state.model, adapters=True),
        "grads": grads,
        "base": torch.cat(base),
        "holds": _holds_adapters_only(state),
        "kinds": sorted({type(m).__name__ for m in unwrap_model(ddp[0]).modules() if "Experts" in type(m).__name__}),
    }


def _dropout_at_eval(full: dict) -> dict:
    """Stacked experts with adapter dropout 0 and 0.5 and the same adapters: the log-probs
    (``compute_logprobs`` runs in eval mode) and one experts module's output in eval and in training
    mode (fixed tokens, routing and seed)."""
    out = {}
    g = torch.Generator().manual_seed(11)
    x, probs = torch.randn(6, 32, generator=g), torch.rand(6, generator=g)
    tokens = torch.tensor([2, 1, 3, 0])
    for p in (0.0, 0.5):
        chunks = fnppo.build_gpt(_cfg("stacked"))
        fnppo.models.layout_invariant_init(chunks, seed=3, std=0.2)
        fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(**LORA, dropout=p))
        fnppo.models.load_full_weights(chunks, full, adapters=True)
        ddp = fnppo.wrap_ddp(chunks)
        lps, _ = fnppo.compute_logprobs(ddp, synthetic_samples(8, seed=7))
        experts = next(m for m in unwrap_model(ddp[0]).modules() if type(m).__name__ == "StackedExperts")
        with torch.no_grad():
            experts.train()
            torch.manual_seed(0)
            train = experts(x, tokens, probs)[0]
            experts.eval()
            torch.manual_seed(0)
            evaluated = experts(x, tokens, probs)[0]
        out[p] = {"logprobs": torch.cat(lps), "train": train, "eval": evaluated}
    return out


def _one_process() -> dict:
    seq = _run("sequential", "per_expert", None)
    out = {"sequential": seq, "stacked": _run("stacked", "per_expert", seq["full"])}
    out["dropout"] = _dropout_at_eval(seq["full"])
    shared = _run("stacked", "shared", None)
    out["shared"] = shared
    out["shared_as_sequential"] = _run("sequential", "per_expert", _shared_as_per_expert(shared["full"], 4))
    return out


def _two_ranks(per_expert: dict, shared: dict) -> dict:
    return {
        "stacked": _run("stacked", "per_expert", per_expert),
        "shared": _run("stacked", "shared", shared),
    }


@pytest.fixture(scope="module")
def one_process():
    return run_ranks(_one_process, 1)[0]


@pytest.fixture(scope="module")
def ep2(one_process):
    return run_ranks(_two_ranks, 2, one_process["sequential"]["full"], one_process["shared"]["full"], ep=2)


def _close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= REL * max(abs(want), 1e-6), f"{what}: {got} vs {want}"


def _same_step(ref: dict, got: dict, what: str) -> float:
    _close(got["loss"], ref["loss"], f"{what} loss")
    _close(got["grad_norm"], ref["grad_norm"], f"{what} grad_norm")
    err = float((got["logprobs"] - ref["logprobs"]).abs().max())
    assert err <= REL, (what, err)
    assert sorted(got["after"]) == sorted(ref["after"]), what
    moved = 0.0
    for name, w in ref["after"].items():
        diff = float((got["after"][name] - w).abs().max())
        assert diff <= REL * max(1.0, float(w.abs().max())), f"{what}: {name} differs by {diff:.2e}"
        moved = max(moved, float((w - ref["full"][name]).abs().max()))
    assert moved > 1e-3  # the step moved the adapters: the comparison means something
    return err


def test_stacked_expert_adapters_equal_the_sequential_path(one_process):
    seq, st = one_process["sequential"], one_process["stacked"]
    assert seq["kinds"] == [] and st["kinds"] == ["StackedExperts"]
    # the same adapter names and the same layout-invariant initial A
    assert sorted(st["init"]) == sorted(seq["init"])
    assert any(".experts.local_experts.3.linear_fc1.lora_A" in n for n in st["init"])
    for name, t in seq["init"].items():
        assert torch.equal(st["init"][name], t), name
    _same_step(seq, st, "stacked vs sequential")
    # adapters off: the base model bit for bit (the free reference policy), and the adapters matter
    for run in (seq, st, one_process["shared"]):
        assert torch.equal(run["off"], run["base"])
        assert float((run["logprobs"] - run["off"]).abs().max()) > 1e-2
        # DDP's buffers and the optimizer hold the adapters only
        h = run["holds"]
        assert h["buffers_are_adapters"] and h["optimizer_params_are_adapters"], h
        assert h["grad_numel"] == h["adapter_numel"] and h["moment_numel"] == 2 * h["adapter_numel"], h
        assert h["trainable"] == h["adapter_names"]


def test_stacked_expert_adapter_dropout_only_in_training(one_process):
    """Adapter dropout on stacked experts acts in training forwards only: with dropout 0.5 the
    log-probs (eval mode) and an eval forward of the experts equal dropout 0's bit for bit, while a
    training forward differs from the eval one (and does not without dropout)."""
    off, on = one_process["dropout"][0.0], one_process["dropout"][0.5]
    assert torch.equal(on["logprobs"], off["logprobs"])
    assert torch.equal(on["eval"], off["eval"])
    assert torch.equal(off["train"], off["eval"])
    assert float((on["train"] - on["eval"]).abs().max()) > 1e-3


def test_stacked_expert_adapters_under_expert_parallelism(one_process, ep2):
    for rank in range(2):
        _same_step(one_process["sequential"], ep2[rank]["stacked"], f"ep2 rank {rank}")


def test_shared_expert_adapter_is_one_adapter_for_all_experts(one_process):
    shared, as_seq = one_process["shared"], one_process["shared_as_sequential"]
    names = [n for n in shared["full"] if ".experts." in n]
    assert sorted(names) == sorted(
        f"decoder.layers.{i}.mlp.experts.linear_fc{j}.lora_{ab}" for i in (0, 1) for j in (1, 2) for ab in "AB"
    )
    # forward: the sequential path with every expert's adapter equal to the shared one
    assert float((shared["logprobs"] - as_seq["logprobs"]).abs().max()) <= REL
    _close(shared["loss"], as_seq["loss"], "loss")
    # gradient: the shared adapter's is the sum over experts of the per-expert ones
    for name in names:
        head, _, tail = name.partition(".mlp.experts.")
        local = f"{head}.mlp.experts.local_experts"
        per_expert = [as_seq["grads"][f"{local}.{e}.{tail}"] for e in range(4)]
        want = torch.stack(per_expert).sum(0)
        err = float((shared["grads"][name] - want).abs().max())
        assert err <= REL * max(1.0, float(want.abs().max())), (name, err)
        assert float(want.abs().max()) > 1e-4


def test_shared_expert_adapter_is_the_same_under_expert_parallelism(one_process, ep2):
    for rank in range(2):
        _same_step(one_process["shared"], ep2[rank]["shared"], f"shared ep2 rank {rank}")


def _refusals() -> dict:
    out = {}
    for label, (experts, layout) in {
        "shared on sequential": ("sequential", "shared"),
        "stacked etp2": ("stacked", "per_expert"),
    }.items():
        chunks = fnppo.build_gpt(_cfg(experts))
        try:
            fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(**LORA, expert_layout=layout))
            out[label] = "accepted"
        except InputError as err:
            out[label] = str(err)
    # Transformer Engine's grouped experts (no TE on the CPU: Megatron's SequentialMLP under TEGroupedMLP's name,
    # which is what apply_lora reads)
    chunks = fnppo.build_gpt(_cfg("sequential"))
    for m in unwrap_model(chunks[0]).modules():
        if type(m).__name__ == "SequentialMLP":
            m.__class__ = type("TEGroupedMLP", (type(m),), {})
    try:
        fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(**LORA))
        out["te_grouped"] = "accepted"
    except InputError as err:
        out["te_grouped"] = str(err)
    for label, name in {  # 2 layers, both MoE (no dense MLP)
        "override layer": "decoder.layers.5.self_attention.linear_qkv",
        "override linear": "decoder.layers.0.mlp.linear_fc1",
    }.items():
        chunks = fnppo.build_gpt(_cfg("sequential"))
        before = [(n, p.requires_grad) for n, p in chunks[0].named_parameters()]
        config = fnppo.lora.LoRAConfig(**LORA, experts=False, overrides={name: (2, 4.0)})
        try:
            fnppo.lora.apply_lora(chunks, config)
            out[label] = "accepted"
        except InputError as err:
            out[label] = str(err)
        out[f"{label} unchanged"] = before == [(n, p.requires_grad) for n, p in chunks[0].named_parameters()]
    return out


def test_unsupported_expert_adapters_are_refused_by_name():
    with pytest.raises(InputError, match="argument 'expert_layout' expected one of"):
        fnppo.lora.LoRAConfig(expert_layout="per_rank")
    got = run_ranks(_refusals, 2, tp=2, etp=2)[0]
    assert (
        "argument 'config.expert_layout' expected 'per_expert' on SequentialMLP experts" in got["shared on sequential"]
    )
    assert "expected expert_tensor_parallel_size (etp) 1 for adapters in stacked experts" in got["stacked etp2"]
    assert got["stacked etp2"].endswith("received etp=2")
    assert (
        "argument 'model_chunks' expected experts built with moe_experts='stacked' or 'sequential' for adapters in "
        "experts, received TEGroupedMLP at decoder.layers.0.mlp.experts" in got["te_grouped"]
    ), got["te_grouped"]
    for label, name in (("override layer", "5.self_attention.linear_qkv"), ("override linear", "0.mlp.linear_fc1")):
        assert (
            "apply_lora: argument 'config.overrides' expected names of linears the config adapts in this model, "
            f"received 'decoder.layers.{name}' (no such linear)"
        ) in got[label], got[label]
        assert got[f"{label} unchanged"]


def _replay() -> dict:
    import dataclasses

    chunks = fnppo.build_gpt(_cfg("stacked"))
    fnppo.models.layout_invariant_init(chunks, seed=3, std=0.2)
    fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(**LORA))
    full = fnppo.models.gather_full_weights(chunks, adapters=True)
    fnppo.models.load_full_weights(chunks, _random(full), adapters=True)
    ddp = fnppo.wrap_ddp(chunks)
    samples = synthetic_samples(8, seed=7)
    off = fnppo.lora.adapters_off(ddp)
    lp_off, _, routes_off = fnppo.compute_logprobs(ddp, samples, params=off, return_routing=True)
    lp_on, _, routes_on = fnppo.compute_logprobs(ddp, samples, return_routing=True)

    def replay(routes):
        return [dataclasses.replace(s, routed_experts=r) for s, r in zip(samples, routes, strict=True)]

    out = {
        "lp_off": lp_off,
        "lp_on": lp_on,
        "routes_off": routes_off,
        "routes_on": routes_on,
        "off_replayed": fnppo.compute_logprobs(ddp, replay(routes_off), params=off)[0],
        "on_replayed": fnppo.compute_logprobs(ddp, replay(routes_on))[0],
        "on_with_off_routes": fnppo.compute_logprobs(ddp, replay(routes_off))[0],
    }
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=0.05))
    batch = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(replay(routes_off), lp_on, strict=True)]
    loss = fnppo.losses.from_flat(loss_agg_mode="token-mean", kl_coef=0.05)
    before = fnppo.models.gather_full_weights(ddp, adapters=True)
    state, out["metrics"] = fnppo.train_step(state, batch, fnppo.StepConfig(loss=loss, num_microbatches=2))
    after = fnppo.models.gather_full_weights(state.model, adapters=True)
    out["moved"] = max(float((after[k] - before[k]).abs().max()) for k in before if ".experts." in k)
    out["after_replayed"] = fnppo.compute_logprobs(state.model, replay(routes_off))[0]
    return out


def test_expert_adapters_with_routing_replay():
    got = run_ranks(_replay, 1)[0]
    for key, ref in (("off_replayed", "lp_off"), ("on_replayed", "lp_on")):  # replay of recorded routes: exact
        assert all(torch.equal(a, b) for a, b in zip(got[key], got[ref], strict=True)), key
    # the adapters change the routing; replaying the reference policy's routes forces them on the adapted model
    changed = [not torch.equal(a, b) for a, b in zip(got["routes_on"], got["routes_off"], strict=True)]
    assert any(changed)
    differs = [not torch.equal(a, b) for a, b in zip(got["on_with_off_routes"], got["lp_on"], strict=True)]
    assert differs == changed
    # a train step under replay moves the expert adapters and keeps the replayed experts
    assert got["moved"] > 1e-4
    assert all(bool(torch.isfinite(t).all()) for t in got["after_replayed"])


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("alpha", float("inf"), "a finite number > 0"),
        ("alpha", float("nan"), "a finite number > 0"),
        ("alpha", "16", "a finite number > 0"),
        ("alpha", True, "a finite number > 0"),
        ("dropout", float("nan"), "a number in [0, 1)"),
        ("rank", 4.0, "an int >= 1"),
        ("seed", 1.5, "an int"),
        ("experts", "yes", "a bool"),
        ("rslora", "yes", "a bool"),
        ("expert_gate_up", "both", "one of ('split', 'fused')"),
        ("overrides", "decoder.layers.0.mlp.linear_fc1", "a dict name -> (rank, alpha) or (name, rank, alpha) triples"),
        ("overrides", {"decoder.layers.0.mlp.router": (4, 8.0)}, "names of linears 'decoder.layers.<i>.….<target>'"),
        ("overrides", {"mlp.linear_fc1": (4, 8.0)}, "names of linears 'decoder.layers.<i>.….<target>'"),
        (
            "overrides['decoder.layers.0.mlp.linear_fc1'][0] (rank)",
            {"decoder.layers.0.mlp.linear_fc1": (0, 8.0)},
            "an int >= 1",
        ),
        (
            "overrides['decoder.layers.0.mlp.linear_fc1'][0] (rank)",
            {"decoder.layers.0.mlp.linear_fc1": ("4", 8.0)},
            "an int >= 1",
        ),
        (
            "overrides['decoder.layers.0.mlp.linear_fc1'][1] (alpha)",
            {"decoder.layers.0.mlp.linear_fc1": (4, float("nan"))},
            "a finite number > 0",
        ),
        (
            "overrides['decoder.layers.0.mlp.linear_fc1'][1] (alpha)",
            {"decoder.layers.0.mlp.linear_fc1": (4, -1.0)},
            "a finite number > 0",
        ),
        ("overrides", [("decoder.layers.0.mlp.linear_fc1", 4, 8.0)] * 2, "each linear named once"),
    ],
)
def test_lora_config_refuses_non_finite_and_non_numeric_values(field, value, expected):
    name = field.partition("[")[0]
    with pytest.raises(
        InputError, match=rf"LoRAConfig: argument '{re.escape(field)}' expected {re.escape(expected)}.*, received"
    ):
        fnppo.lora.LoRAConfig(**{name: value})


def test_apply_lora_refuses_what_is_not_a_list_of_chunks():
    with pytest.raises(InputError, match=r"argument 'model_chunks' expected a list of model chunks .*received dict"):
        fnppo.lora.apply_lora({"model": torch.nn.Linear(2, 2)}, fnppo.lora.LoRAConfig())
    with pytest.raises(InputError, match=r"argument 'model_chunks' expected .*received a list of \['str'\]"):
        fnppo.lora.apply_lora(["chunk"], fnppo.lora.LoRAConfig())
    with pytest.raises(InputError, match="argument 'config' expected a fnppo.lora.LoRAConfig, received dict"):
        fnppo.lora.apply_lora([torch.nn.Linear(2, 2)], {"rank": 4})


def _stacked_state(layout: str, seed: int) -> fnppo.TrainState:
    chunks = fnppo.build_gpt(_cfg("stacked"))
    fnppo.models.layout_invariant_init(chunks, seed=3, std=0.2)
    fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(**dict(LORA, seed=seed), expert_layout=layout))
    ddp = fnppo.wrap_ddp(chunks)
    return fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-2))


def _resume(root: str) -> dict:
    """Per layout: step, save, step; load into a state of other adapters, step again."""
    from megatron.core import dist_checkpointing

    loss = fnppo.losses.from_flat(loss_agg_mode="token-mean")
    cfg = fnppo.StepConfig(loss=loss, num_microbatches=2)
    out = {}
    for layout in ("per_expert", "shared"):
        batch = [synthetic_samples(8, seed=20 + i) for i in range(2)]
        state, _ = fnppo.train_step(_stacked_state(layout, 5), batch[0], cfg)
        fnppo.checkpoint.save_checkpoint(f"{root}/{layout}", state)
        keys = sorted(dist_checkpointing.load_tensors_metadata(f"{root}/{layout}"))
        state, want = fnppo.train_step(state, batch[1], cfg)
        other, _ = fnppo.checkpoint.load_checkpoint(f"{root}/{layout}", _stacked_state(layout, 99))
        other, got = fnppo.train_step(other, batch[1], cfg)
        a = fnppo.models.gather_full_weights(state.model, adapters=True)
        b = fnppo.models.gather_full_weights(other.model, adapters=True)
        out[layout] = {
            "keys": keys,
            "same": got["loss"] == want["loss"] and all(torch.equal(a[k], b[k]) for k in a),
        }
    return out


def test_stacked_expert_adapters_resume_from_a_checkpoint_bit_for_bit(tmp_path):
    got = run_ranks(_resume, 1, str(tmp_path))[0]
    for layout in ("per_expert", "shared"):
        keys = got[layout]["keys"]
        assert any(k.endswith("experts.fc1_lora_A") for k in keys) and any(k.endswith("fc2_lora_B") for k in keys)
        assert not any(k.endswith(("experts.weight1", "experts.weight2")) for k in keys)  # base weights left out
        assert got[layout]["same"], layout
