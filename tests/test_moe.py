"""Mixture-of-Experts policies over real Megatron on CPU: layouts, exact router losses, router settings.

Invariance: the same full weights loaded into every layout (1 process, EP=2, EP=2 x DP=2, TP=2 x
EP=2 with sequence parallelism, PP=2) give the same loss, grad norm, updated parameters and router losses as one process
that forms the same micro-batches (fnppo.megatron.moe defines the balance loss per micro-batch, so a
layout with ``dp`` ranks of ``k`` micro-batches is compared with one process of ``dp * k``
contiguous micro-batches). One ``run_ranks`` call per layout covers all its cases.
"""

from __future__ import annotations

import math

import pytest
import torch

import fnppo
import fnppo.megatron.unwrap
from fnppo.core.losses import Aggregation, LossConfig, ppo_clip, ppo_loss
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config

REL = 1e-5
N_SAMPLES = 8


def _cfg(**kw) -> fnppo.ModelConfig:
    base = dict(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01)
    return tiny_model_config(moe=True, **{**base, **kw})


def _full_weights(cfg: fnppo.ModelConfig) -> dict:
    """One set of full weights for every layout: built and drawn in one process-free way."""
    chunks = fnppo.build_gpt(cfg)
    fnppo.models.layout_invariant_init(chunks, seed=11, std=0.2)  # large router logits: clear top-k choices
    return fnppo.models.gather_full_weights(chunks)


def _state(cfg: fnppo.ModelConfig, full: dict, *, distributed: bool = True, optimizer: str = "adam"):
    chunks = fnppo.build_gpt(cfg)
    fnppo.models.load_full_weights(chunks, full)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=distributed)
    opt = (
        fnppo.build_optimizer(ddp, lr=10.0, adam_eps=10.0, clip_grad=0.0)
        if optimizer == "adam"
        else fnppo.build_optimizer(ddp, optimizer="sgd", lr=1.0, clip_grad=0.0, sgd_momentum=0.0)
    )
    return fnppo.TrainState(model=ddp, optimizer=opt)


def _step_cfg(num_microbatches: int) -> fnppo.StepConfig:
    loss = LossConfig(policy=ppo_clip(), agg=Aggregation("token-mean"), entropy_coef=0.01)
    return fnppo.StepConfig(loss=loss, num_microbatches=num_microbatches, pad_to_multiple_of=2)


def _cases(cases: dict, full: dict) -> dict:
    """Run each case (model overrides, micro-batches per rank) from the same full weights."""
    layout = fnppo.parallel.current_layout()
    out = {}
    for name, (overrides, nmb, *sample_kw) in cases.items():
        cfg = _cfg(**overrides)
        state = _state(cfg, full)
        samples = fnppo.shard_for_data_parallel(
            synthetic_samples(N_SAMPLES, seed=5, **(sample_kw[0] if sample_kw else {})), layout
        )
        state, metrics = fnppo.train_step(state, samples, _step_cfg(nmb))
        weights = fnppo.models.gather_full_weights(state.model)
        out[name] = {"metrics": metrics, "weights": weights}
    return out if layout.rank == 0 else {}


def _reference_cases() -> dict:
    full = _full_weights(_cfg())
    cases = {f"nmb{k}": ({}, k) for k in (1, 2, 4)}
    cases["z_only_nmb1"] = (dict(moe_load_balancing="none", moe_aux_loss_coeff=0.0), 1)
    cases["z_only_nmb4"] = (dict(moe_load_balancing="none", moe_aux_loss_coeff=0.0), 4)
    cases["equal_nmb2"] = ({}, 2, EQUAL)
    out = _cases(cases, full)
    out["full"] = full
    return out


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_reference_cases, 1)[0]


KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_aux_loss_l1", "moe_tokens_l0_e1")


def _compare(ref: dict, got: dict, what: str, keys: tuple = KEYS) -> float:
    worst = 0.0
    for key in keys:
        r, g = ref["metrics"][key], got["metrics"][key]
        err = abs(g - r) / max(abs(r), 1e-12)
        assert err <= REL, f"{what}: metric {key} {g} vs reference {r} (rel {err:.2e})"
        worst = max(worst, err)
    assert set(ref["weights"]) == set(got["weights"]), f"{what}: different parameter names"
    for name, w in ref["weights"].items():
        err = float((got["weights"][name] - w).abs().max() / w.abs().max().clamp_min(1e-12))
        assert err <= REL, f"{what}: parameter {name} rel err {err:.2e}"
        worst = max(worst, err)
    return worst


def test_reference_step_is_real_and_z_loss_is_split_invariant(reference):
    base = reference["nmb1"]
    m = base["metrics"]
    assert m["skipped"] == 0.0 and m["grad_norm"] > 1e-4
    moved = max(float((base["weights"][k] - v).abs().max()) for k, v in reference["full"].items())
    assert moved > 1e-3
    # loads: fractions of tokens per expert sum to top-k in every layer; tokens per expert add up
    for layer in (0, 1):
        assert abs(sum(m[f"moe_load_l{layer}_e{e}"] for e in range(4)) - 2.0) < 1e-6
        assert m[f"moe_imbalance_l{layer}"] >= 1.0
    # the z-loss is a token mean over the step: splitting the batch changes nothing
    z_keys = ("loss", "grad_norm", "moe_z_loss", "moe_z_loss_l1", "moe_tokens_l0_e1")
    _compare(reference["z_only_nmb1"], reference["z_only_nmb4"], "z-loss 1 vs 4 micro-batches", z_keys)
    # the balance loss is per micro-batch: it does change with the split (the documented definition)
    assert abs(reference["nmb1"]["metrics"]["moe_aux_loss"] - reference["nmb4"]["metrics"]["moe_aux_loss"]) > 1e-6


EQUAL = {"prompt_len": (4, 4), "response_len": (4, 4)}  # equal token counts per rank (allgather)

SP = dict(extra=dict(sequence_parallel=True))  # Megatron's MoE layer trains under TP only with sequence parallelism

LAYOUTS = {
    # name: (world, tp, pp, ep, etp, cases {name: (model overrides, micro-batches per rank)}, reference case)
    "ep2": (2, 1, 1, 2, None, {"a2a": ({}, 1)}, "nmb2"),
    # TP=2 x EP=2 with expert TP 2 (the default): expert-TP ranks exchange token blocks of unequal
    # sizes (megatron_on_cpu pads them for gloo); DP=2 of one micro-batch each
    "tp2xep2": (4, 2, 1, 2, None, {"a2a": (SP, 1)}, "nmb2"),
    "ep2-equal": (
        2,
        1,
        1,
        2,
        None,
        {"a2a": ({}, 1, EQUAL), "allgather": (dict(moe_dispatcher="allgather"), 1, EQUAL)},
        "equal_nmb2",
    ),
    "ep2xdp2": (4, 1, 1, 2, None, {"a2a": ({}, 1)}, "nmb4"),
    "pp2": (2, 1, 2, 1, None, {"a2a": ({}, 4)}, "nmb4"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_match_single_process(reference, name):
    world, tp, pp, ep, etp, cases, ref_case = LAYOUTS[name]
    got = run_ranks(_cases, world, cases, reference["full"], tp=tp, pp=pp, ep=ep, etp=etp)[0]
    worst = 0.0
    for case, result in got.items():
        worst = max(worst, _compare(reference[ref_case], result, f"{name}/{case}"))
    print(f"{name}: max relative difference {worst:.2e}")


# --------------------------------------------------------------------------------------------
# the router-loss gradient against a float64 plain-torch reference
# --------------------------------------------------------------------------------------------
def _router_grad_case(nmb: int) -> dict:
    """Zero policy loss: the last layer's router weight gradient is that of its router losses only."""
    cfg = _cfg()
    full = _full_weights(cfg)
    state = _state(cfg, full, distributed=False, optimizer="sgd")
    rs = fnppo.megatron.moe.routers(state.model)
    captured: dict[int, list[torch.Tensor]] = {layer: [] for layer in range(len(rs))}

    def capture(layer):
        return lambda mod, args, out: captured[layer].append(args[0].detach().reshape(-1, cfg.hidden_size).clone())

    handles = [r.register_forward_hook(capture(layer)) for layer, r in enumerate(rs)]

    def zero_policy_loss(*args, **kwargs):
        loss, metrics = ppo_loss(*args, **kwargs)
        return loss * 0.0, metrics

    step = fnppo.StepConfig(num_microbatches=nmb, pad_to_multiple_of=2, fns=fnppo.StepFns(loss=zero_policy_loss))
    _, metrics = fnppo.train_step(state, synthetic_samples(N_SAMPLES, seed=5), step)
    for h in handles:
        h.remove()
    return {
        "grad": rs[-1].weight.main_grad.detach().clone(),
        "weight": full["decoder.layers.1.mlp.router.weight"],
        "hidden": captured[len(rs) - 1],
        "hidden_by_layer": captured,
        "metrics": metrics,
        "weights": {layer: full[f"decoder.layers.{layer}.mlp.router.weight"] for layer in captured},
    }


def _reference_router_loss(
    weight: torch.Tensor, hidden: list[torch.Tensor], *, k: int, aux: float, z: float
) -> torch.Tensor:
    """sum_m T_m / T * (aux * E * sum_e f_e P_e + z * mean_t logsumexp^2), float64, written from the papers."""
    total = sum(h.shape[0] for h in hidden)
    out = weight.new_zeros(())
    for h in hidden:
        logits = h.double() @ weight.T
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.zeros_like(probs).scatter(1, probs.topk(k, dim=-1).indices, 1.0)
        n, e = probs.shape
        balance = e * ((chosen.sum(0) / (n * k)) * probs.mean(0)).sum()
        zloss = torch.logsumexp(logits, dim=-1).square().mean()
        out = out + n / total * (aux * balance + z * zloss)
    return out


@pytest.fixture(scope="module")
def router_grads():
    return run_ranks(_router_grad_cases, 1)[0]


def _router_grad_cases() -> dict:
    return {nmb: _router_grad_case(nmb) for nmb in (1, 3)}


@pytest.mark.parametrize("nmb", [1, 3])
def test_router_loss_gradient_matches_float64_reference(router_grads, nmb):
    r = router_grads[nmb]
    assert len(r["hidden"]) == nmb
    w = r["weight"].double().requires_grad_(True)
    _reference_router_loss(w, r["hidden"], k=2, aux=0.05, z=0.01).backward()
    err = float((r["grad"].double() - w.grad).abs().max() / w.grad.abs().max())
    assert err <= REL, f"router weight gradient rel err {err:.2e} with {nmb} micro-batches"


@pytest.mark.parametrize("nmb", [1, 3])
def test_reported_router_loss_metrics_match_float64_reference(router_grads, nmb):
    """train_step's ``moe_aux_loss`` / ``moe_z_loss`` (per layer and their mean over layers) are the
    float64 switch balance loss ``E * sum_e f_e P_e`` and z-loss, token-weighted over the micro-batches,
    without coefficients, from the routers' own inputs and the weights the forward used."""
    r = router_grads[nmb]
    m = r["metrics"]
    aux, z = {}, {}
    for layer, hidden in r["hidden_by_layer"].items():
        assert len(hidden) == nmb
        w = r["weights"][layer].double()
        aux[layer] = float(_reference_router_loss(w, hidden, k=2, aux=1.0, z=0.0))
        z[layer] = float(_reference_router_loss(w, hidden, k=2, aux=0.0, z=1.0))
        # a balanced router scores 1: the reference is of the order of 1, not E or 1/E
        assert 0.9 < aux[layer] < 4.0, aux[layer]
        assert m[f"moe_aux_loss_l{layer}"] == pytest.approx(aux[layer], rel=REL), (layer, nmb)
        assert m[f"moe_z_loss_l{layer}"] == pytest.approx(z[layer], rel=REL), (layer, nmb)
    assert m["moe_aux_loss"] == pytest.approx(sum(aux.values()) / len(aux), rel=REL)
    assert m["moe_z_loss"] == pytest.approx(sum(z.values()) / len(z), rel=REL)


# --------------------------------------------------------------------------------------------
# router settings RL users rely on
# --------------------------------------------------------------------------------------------
def _settings() -> dict:
    out = {}
    samples = synthetic_samples(N_SAMPLES, seed=5)
    variants = {
        "frozen": dict(moe_freeze_router=True),
        "bias0": dict(
            moe_load_balancing="none",
            moe_aux_loss_coeff=0.0,
            moe_expert_bias=True,
            moe_bias_update_rate=0.0,
            moe_score_function="sigmoid",
        ),
        "bias": dict(
            moe_load_balancing="none",
            moe_aux_loss_coeff=0.0,
            moe_expert_bias=True,
            moe_bias_update_rate=0.1,
            moe_score_function="sigmoid",
        ),
        "fp64": dict(moe_router_dtype="fp64"),
        "seq_aux": dict(moe_load_balancing="seq_aux_loss"),
        "shared": dict(moe_shared_expert_size=16),
        # after the 2-layer models in the same process: Megatron's process-wide router-loss tracker
        # must not keep the first model's layer count
        "deeper": dict(num_layers=3),
    }
    out["deterministic"] = _deterministic_runs(samples)
    for name, overrides in variants.items():
        cfg = _cfg(**overrides)
        full = _full_weights(cfg)
        state = _state(cfg, full)
        dtypes: set = set()  # the dtype of every router's output probabilities in the step
        rs = fnppo.megatron.moe.routers(state.model)
        hooks = [r.register_forward_hook(lambda mod, args, o: dtypes.add(o[0].dtype)) for r in rs]
        state, metrics = fnppo.train_step(state, samples, _step_cfg(2))
        for h in hooks:
            h.remove()
        weights = fnppo.models.gather_full_weights(state.model)
        biases = [
            r.expert_bias.clone() if r.expert_bias is not None else None
            for r in fnppo.megatron.moe.routers(state.model)
        ]
        tcfg = fnppo.megatron.unwrap.unwrap_model(state.model[0]).config
        fields = (
            "moe_router_dtype",
            "moe_router_load_balancing_type",
            "moe_aux_loss_coeff",
            "moe_z_loss_coeff",
            "moe_shared_expert_intermediate_size",
            "num_layers",
        )
        megatron = {k: getattr(tcfg, k) for k in fields}
        out[name] = {
            "metrics": metrics,
            "full": full,
            "weights": weights,
            "biases": biases,
            "router_dtypes": dtypes,
            "megatron": megatron,
            "routers": len(fnppo.megatron.moe.routers(state.model)),
        }
    return out


def _deterministic_runs(samples) -> dict:
    """compute_logprobs and one train_step with and without ModelConfig(deterministic=True) from the
    same weights, and what Megatron's MoE un-permutation saw of torch's deterministic switch."""
    from megatron.core.transformer.moe import token_dispatcher

    seen: list[bool] = []
    original = token_dispatcher.unpermute

    def spy(*args, **kwargs):
        seen.append((torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory))
        return original(*args, **kwargs)

    token_dispatcher.unpermute = spy
    out = {}
    try:
        full = _full_weights(_cfg())
        for det in (False, True, "mode"):
            seen.clear()
            kwargs = dict(deterministic=False, batch_invariant=True) if det == "mode" else dict(deterministic=det)
            state = _state(_cfg(**kwargs), full)
            lp, _ = fnppo.compute_logprobs(state.model, samples, config=_step_cfg(2))
            state, metrics = fnppo.train_step(state, samples, _step_cfg(2))
            out[det] = {
                "seen": list(seen),
                "after": (
                    torch.are_deterministic_algorithms_enabled(),
                    torch.utils.deterministic.fill_uninitialized_memory,
                ),
                "logprobs": lp,
                "metrics": metrics,
                "weights": fnppo.models.gather_full_weights(state.model),
                "mode": fnppo.megatron.unwrap.unwrap_model(state.model[0]).config.deterministic_mode,
            }
    finally:
        token_dispatcher.unpermute = original
    return out


@pytest.fixture(scope="module")
def settings():
    return run_ranks(_settings, 1)[0]


def test_frozen_router_is_not_updated(settings):
    r = settings["frozen"]
    assert math.isfinite(r["metrics"]["loss"]) and r["metrics"]["updates"] == 1.0
    for name, w in r["full"].items():
        same = torch.equal(r["weights"][name], w)
        assert same == name.endswith("router.weight"), name


def test_expert_bias_update_rate(settings):
    assert all(torch.equal(b, torch.zeros_like(b)) for b in settings["bias0"]["biases"])
    m = settings["bias"]["metrics"]
    for layer, bias in enumerate(settings["bias"]["biases"]):
        loads = torch.tensor([m[f"moe_load_l{layer}_e{e}"] for e in range(4)], dtype=torch.float64)
        # aux-loss-free balancing: bias += rate * sign(mean load - load)
        expected = 0.1 * torch.sign(loads.mean() - loads)
        assert torch.allclose(bias.double(), expected, atol=1e-6), (bias, expected)


def test_router_dtype_seq_aux_and_shared_expert_run(settings):
    for name in ("fp64", "seq_aux", "shared"):
        m = settings[name]["metrics"]
        assert math.isfinite(m["loss"]) and m["updates"] == 1.0 and m["grad_norm"] > 0, name
        # the settings every variant shares reached Megatron too
        mg = settings[name]["megatron"]
        assert mg["moe_aux_loss_coeff"] == 0.05 and mg["moe_z_loss_coeff"] == 0.01, (name, mg)
    # each setting arrived in the built Megatron config ...
    assert settings["fp64"]["megatron"]["moe_router_dtype"] == "fp64"
    assert settings["shared"]["megatron"]["moe_router_dtype"] == "fp32"  # ModelConfig's default
    assert settings["seq_aux"]["megatron"]["moe_router_load_balancing_type"] == "seq_aux_loss"
    assert settings["fp64"]["megatron"]["moe_router_load_balancing_type"] == "aux_loss"
    assert settings["shared"]["megatron"]["moe_shared_expert_intermediate_size"] == 16
    assert settings["fp64"]["megatron"]["moe_shared_expert_intermediate_size"] is None
    # ... and has its effect: the routers compute in float64 (float32, the default, elsewhere)
    assert settings["fp64"]["router_dtypes"] == {torch.float64}, settings["fp64"]["router_dtypes"]
    assert settings["seq_aux"]["router_dtypes"] == {torch.float32}
    # a shared expert of hidden size 16 in every layer, trained by the step
    shared = settings["shared"]
    fc2 = [k for k in shared["weights"] if "shared_experts" in k and k.endswith("linear_fc2.weight")]
    assert len(fc2) == 2 and all(shared["weights"][k].shape == (32, 16) for k in fc2), fc2
    assert all(not torch.equal(shared["weights"][k], shared["full"][k]) for k in fc2)


def test_a_deeper_moe_model_after_another_in_the_same_process(settings):
    r = settings["deeper"]
    m = r["metrics"]
    assert math.isfinite(m["loss"]) and m["updates"] == 1.0 and m["grad_norm"] > 0
    assert r["megatron"]["num_layers"] == 3 and r["routers"] == 3  # the depth reached Megatron
    assert all(math.isfinite(m[f"moe_z_loss_l{layer}"]) and m[f"moe_z_loss_l{layer}"] > 0 for layer in range(3))
    assert all(math.isfinite(m[f"moe_aux_loss_l{layer}"]) and m[f"moe_aux_loss_l{layer}"] > 0 for layer in range(3))
    assert "moe_z_loss_l3" not in m and "moe_aux_loss_l3" not in m
    # the layer mean covers all three layers
    assert m["moe_z_loss"] == pytest.approx(sum(m[f"moe_z_loss_l{layer}"] for layer in range(3)) / 3, rel=1e-5)
    # every layer's loads sum to top-k (its router ran on every token), and its weights were updated
    for layer in range(3):
        assert abs(sum(m[f"moe_load_l{layer}_e{e}"] for e in range(4)) - 2.0) < 1e-5, layer
        name = f"decoder.layers.{layer}.mlp.router.weight"
        assert not torch.equal(r["weights"][name], r["full"][name]), name


def test_deterministic_model_runs_megatron_moe_under_deterministic_algorithms(settings):
    off, on = settings["deterministic"][False], settings["deterministic"][True]
    assert on["mode"] and not off["mode"]  # Megatron's deterministic_mode
    # every un-permutation (compute_logprobs, the step's forward and router metrics) ran with torch's switch on
    # (with torch's NaN fill of new tensors, its default under the switch)
    assert on["seen"] and all(s == (True, True) for s in on["seen"]), on["seen"]
    assert off["seen"] and not any(s[0] for s in off["seen"]), off["seen"]
    assert on["after"] == off["after"] == (False, True)  # restored after each call
    # the batch-invariant mode turns the switch on for MoE models itself, without deterministic_mode
    # and without the fill (one more kernel per allocation)
    mode = settings["deterministic"]["mode"]
    assert mode["seen"] and all(s == (True, False) for s in mode["seen"]), mode["seen"]
    assert mode["after"] == (False, True) and not mode["mode"]
    # on CPU every kernel is deterministic already: the same numbers
    for a, b in zip(on["logprobs"], off["logprobs"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert on["metrics"]["loss"] == pytest.approx(off["metrics"]["loss"], rel=1e-6)
    for name, w in off["weights"].items():
        torch.testing.assert_close(on["weights"][name], w, rtol=1e-6, atol=1e-7)


def test_model_config_refuses_bad_moe_settings():
    with pytest.raises(fnppo.InputError, match="moe_topk"):
        _cfg(moe_topk=5)
    with pytest.raises(fnppo.InputError, match="moe_load_balancing"):
        _cfg(moe_load_balancing="sinkhorn_x")
    with pytest.raises(fnppo.InputError, match="moe_aux_loss_coeff"):
        _cfg(moe_load_balancing="none", moe_aux_loss_coeff=0.1)
    with pytest.raises(fnppo.InputError, match="moe_dispatcher"):
        _cfg(moe_dispatcher="flex")
    from tests.messages import raises_message

    for freq, shown in ((0, "0"), ((1, 2), "(1, 2)"), ((0, 0), "(0, 0)"), ((1,), "(1,)")):
        with raises_message(
            "ModelConfig", "moe_layer_freq", "an int >= 1 or 2 entries of 0/1 (one per layer, at least one 1)", shown
        ):
            _cfg(moe_layer_freq=freq)
    with raises_message(
        "ModelConfig", "moe_shared_expert_gate", "False without a shared expert (moe_shared_expert_size=None)", "True"
    ):
        _cfg(moe_shared_expert_gate=True)
    assert _cfg(moe_layer_freq=[0, 1]).moe_layers == (1,) and _cfg(num_layers=4, moe_layer_freq=2).moe_layers == (0, 2)


def _allgather_check_on_rank(tokens_per_rank: list[int]):
    """One rank: ``_check_allgather`` on a micro-batch of this rank's token count (EP=2)."""
    import types

    from fnppo.core.errors import InputError
    from fnppo.megatron.moe import _check_allgather

    layout = fnppo.parallel.current_layout()
    mb = types.SimpleNamespace(input_ids=torch.zeros(1, tokens_per_rank[layout.ep_rank], dtype=torch.long))
    cfg = types.SimpleNamespace(moe_token_dispatcher_type="allgather")
    try:
        _check_allgather(cfg, [mb], layout, torch.device("cpu"))
    except InputError as err:
        return str(err)
    return None


def test_allgather_dispatcher_refuses_unequal_token_counts():
    from fnppo.core.errors import InputError
    from tests.messages import check_message

    equal = run_ranks(_allgather_check_on_rank, 2, [8, 8], ep=2)
    assert equal == [None, None]
    unequal = run_ranks(_allgather_check_on_rank, 2, [8, 6], ep=2)
    for msg in unequal:  # every rank refuses, with the same expectation
        assert msg is not None
        check_message(
            InputError(msg),
            InputError,
            "train_step",
            "batch",
            "micro-batches of equal token counts on every expert-parallel rank with moe_dispatcher='allgather'",
            "max [8] over the EP group",
        )


# --------------------------------------------------------------------------------------------
# checkpoints under expert parallelism
# --------------------------------------------------------------------------------------------
def _ep_checkpoint(full: dict, root: str) -> dict:
    """EP=2: two steps straight, against one step, save, load into a state built from other
    weights, one step; then the same processes as EP=1 (DP=2) load the checkpoint (resharded experts)."""
    import json
    from pathlib import Path

    layout = fnppo.parallel.current_layout()
    samples = [fnppo.shard_for_data_parallel(synthetic_samples(N_SAMPLES, seed=s), layout) for s in (5, 6)]
    cfg = _cfg()
    straight = _state(cfg, full)
    metrics = []
    for batch in samples:
        straight, m = fnppo.train_step(straight, batch, _step_cfg(1))
        metrics.append(m)
    first = _state(cfg, full)
    first, m0 = fnppo.train_step(first, samples[0], _step_cfg(1))
    ckpt = Path(root) / "ckpt"
    fnppo.checkpoint.save_checkpoint(ckpt, first)
    resumed = _state(cfg, _full_weights(_cfg()) | {k: v + 1.0 for k, v in full.items()})  # other weights
    resumed, _ = fnppo.checkpoint.load_checkpoint(ckpt, resumed)
    resumed, m1 = fnppo.train_step(resumed, samples[1], _step_cfg(1))
    out = {
        "metrics": [m0, m1],
        "straight_metrics": metrics,
        "step": resumed.step,
        "weights": fnppo.models.gather_full_weights(resumed.model),
        "straight": fnppo.models.gather_full_weights(straight.model),
        "saved": fnppo.models.gather_full_weights(first.model),
        "manifest": json.loads((ckpt / "manifest.json").read_text()) if layout.rank == 0 else None,
    }
    fnppo.init_parallel(tp=1, pp=1, ep=1, device="cpu")  # the same two processes, experts not split
    other, _ = fnppo.checkpoint.load_checkpoint(ckpt, _state(cfg, full | {k: v + 1.0 for k, v in full.items()}))
    out["other_layout"] = {"step": other.step, "weights": fnppo.models.gather_full_weights(other.model)}
    return out


def test_ep_checkpoint_resumes_bit_for_bit_and_loads_under_ep1(reference, tmp_path):
    results = run_ranks(_ep_checkpoint, 2, reference["full"], str(tmp_path), ep=2)
    for rank, r in enumerate(results):
        assert r["step"] == 2
        for got, want in zip(r["metrics"], r["straight_metrics"], strict=True):
            for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
                assert got[key] == want[key], (rank, key)
        assert set(r["weights"]) == set(r["straight"])
        for name, w in r["straight"].items():
            assert torch.equal(r["weights"][name], w), (rank, name)
        # the same processes as EP=1: every expert of the saved model, on both ranks
        assert r["other_layout"]["step"] == 1
        assert set(r["other_layout"]["weights"]) == set(r["saved"])
        for name, w in r["saved"].items():
            assert torch.equal(r["other_layout"]["weights"][name], w), (rank, name)
    manifest = results[0]["manifest"]
    assert manifest["layout"]["ep"] == 2 and manifest["step"] == 1


# ---------------------------------------------------------------------------------------------
# The router logits of the batch-invariant mode (fixed row tiles)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_invariant_router_logits_match_float64_and_keep_a_tokens_bits_in_any_batch(dtype):
    from fnppo.core.kernels.invariant import invariant_router_logits

    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 256, generator=g).to(torch.bfloat16)
    w = (torch.randn(16, 256, generator=g) / 16).to(torch.bfloat16)
    b = torch.randn(16, generator=g).to(torch.bfloat16)
    want = x.double() @ w.double().t() + b.double()
    full = invariant_router_logits(x, w, b, dtype, tile=64)
    assert full.dtype == dtype
    torch.testing.assert_close(full.double(), want, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)
    # a token alone, with few or many others around (the CPU's GEMM takes another path for 1-3 rows)
    for at, before, after in ((41, 0, 0), (42, 1, 1), (43, 0, 2), (44, 100, 27), (45, 5, 250)):
        batch = torch.cat([x[:before], x[at : at + 1], x[300 - after :]])
        got = invariant_router_logits(batch, w, b, dtype, tile=64)[before]
        assert torch.equal(got, full[at]), f"token {at}'s logits changed with {before} + {after} tokens around it"
    # leading dims and the gradient (the ordinary products, checked against float64 autograd)
    xs = x[:40].reshape(8, 5, 256).float().requires_grad_()
    ws = w.float().requires_grad_()
    bs = b.float().requires_grad_()
    up = torch.randn(8, 5, 16, generator=g, dtype=torch.float64)
    (invariant_router_logits(xs, ws, bs, torch.float64, tile=16) * up).sum().backward()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (xs, ws, bs))
    ((x64 @ w64.t() + b64) * up).sum().backward()
    for got, ref in ((xs.grad, x64.grad), (ws.grad, w64.grad), (bs.grad, b64.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5)
    with pytest.raises(fnppo.InputError, match="'tile' expected an int >= 1, received 0"):
        invariant_router_logits(x, w, b, dtype, tile=0)
