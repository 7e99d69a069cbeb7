"""Checkpoints that move between layouts (Megatron distributed checkpoints, real Megatron on CPU).

A dense model saved under DP=2 x TP=2 (4 ranks) and an MoE model saved under EP=2 (2 ranks), each after
one training step, are loaded under one process, TP=2 and PP=2 (dense) and one process with EP=1 (MoE):

* the loaded weights equal the saved ones (gathered at the save by plain all-gathers,
  ``gather_full_weights``), bit for bit;
* the loaded Adam moments (one process: the whole of each parameter's moments) equal those of an
  independent one-process run of the same first step (to 1e-5 of each tensor's largest entry: another
  reduction order);
* the next two steps' loss and grad norm equal the uninterrupted run's to 1e-5 (the second of them
  depends on the loaded moments too).

Also in the one-process launch: a parameter tagged ``fnppo_lora_base`` is left out of the checkpoint and
untouched by a load, a save before the first step resumes exactly like a fresh optimizer, and the
non-distributed optimizer resumes bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fnppo
from fnppo.megatron.unwrap import unwrap_model
from fnppo.megatron.weights import global_name
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config

REL = 1e-5
KEYS = ("loss", "grad_norm")


def _cfg(moe: bool) -> fnppo.ModelConfig:
    return tiny_model_config(moe=moe)


def _build(
    moe: bool = False, init_seed: int = 3, frozen: str | None = None, distributed: bool = True
) -> fnppo.TrainState:
    chunks = fnppo.build_gpt(_cfg(moe))
    fnppo.models.layout_invariant_init(chunks, seed=init_seed, std=0.2 if moe else None)
    for c in chunks:
        for name, p in unwrap_model(c).named_parameters():
            if frozen and name.endswith(frozen):  # a frozen base weight of a LoRA adapter
                p.fnppo_lora_base = True
                p.requires_grad_(False)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=distributed)
    return fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-2, clip_grad=1.0))


def _cfg_step() -> fnppo.StepConfig:
    return fnppo.StepConfig(loss=fnppo.losses.from_flat(entropy_coeff=0.01, kl_coef=0.05), num_microbatches=2)


def _step(state: fnppo.TrainState, step: int) -> tuple[fnppo.TrainState, dict]:
    batch = fnppo.shard_for_data_parallel(synthetic_samples(8, seed=100 + step))
    state, metrics = fnppo.train_step(state, batch, _cfg_step())
    return state, {k: metrics[k] for k in KEYS}


def _saved_run(root: str, moe: bool) -> dict:
    """Step 1, save, steps 2 and 3 (the uninterrupted run); the full weights at the save."""
    state = _build(moe)
    state, _ = _step(state, 1)
    fnppo.checkpoint.save_checkpoint(Path(root) / ("moe" if moe else "dense"), state)
    full = fnppo.models.gather_full_weights(state.model)
    state, m2 = _step(state, 2)
    state, m3 = _step(state, 3)
    return {"full": full, "metrics": [m2, m3]}


def _resumed(root: str, moe: bool) -> dict:
    """Load (into a state of other weights) and run steps 2 and 3."""
    state, _ = fnppo.checkpoint.load_checkpoint(Path(root) / ("moe" if moe else "dense"), _build(moe, init_seed=99))
    out = {"step": state.step, "full": fnppo.models.gather_full_weights(state.model)}
    if fnppo.parallel.current_layout().world_size == 1:
        out["moments"] = _moments(state)
    state, m2 = _step(state, 2)
    state, m3 = _step(state, 3)
    out["metrics"] = [m2, m3]
    return out


def _moments(state: fnppo.TrainState) -> dict[str, dict[str, torch.Tensor]]:
    """One process: each parameter's whole Adam moments (the distributed optimizer's only shard)."""
    names = {id(p): global_name(unwrap_model(c), n) for c in state.model for n, p in unwrap_model(c).named_parameters()}
    out = {}
    for sub in state.optimizer.chained_optimizers:
        for p in sub.model_param_group_index_map:
            st = sub._get_main_param_and_optimizer_states(p)
            out[names[id(p)]] = {k: st[k].detach().clone().reshape(p.shape) for k in ("exp_avg", "exp_avg_sq")}
    return out


def _four_ranks(root: str) -> dict:
    return _saved_run(root, moe=False)


def _two_ranks(root: str) -> dict:
    out = {"moe": _saved_run(root, moe=True)}
    fnppo.init_parallel(2, 1, seed=1234, device="cpu", timeout_s=120.0)
    out["tp2"] = _resumed(root, moe=False)
    fnppo.init_parallel(1, 2, seed=1234, device="cpu", timeout_s=120.0)
    out["pp2"] = _resumed(root, moe=False)
    return out


def _one_rank(root: str) -> dict:
    out = {"dense": _resumed(root, moe=False), "moe": _resumed(root, moe=True)}
    for moe in (False, True):  # the moments of an independent one-process first step
        state, _ = _step(_build(moe), 1)
        out[f"reference_moments_{'moe' if moe else 'dense'}"] = _moments(state)
    out.update(_lora_and_first_step(root))
    return out


def _lora_and_first_step(root: str) -> dict:
    """A tagged LoRA base weight: not saved, not loaded. A save before the first step: resumes as fresh."""
    frozen = "linear_fc1.weight"
    state, _ = _step(_build(frozen=frozen), 1)
    fnppo.checkpoint.save_checkpoint(Path(root) / "lora", state)
    from megatron.core import dist_checkpointing

    keys = sorted(dist_checkpointing.load_tensors_metadata(str(Path(root) / "lora")))
    other = _build(init_seed=99, frozen=frozen)
    refused = "no error"
    try:  # another base under the adapters: refused (the manifest records the base)
        fnppo.checkpoint.load_checkpoint(Path(root) / "lora", other)
    except fnppo.checkpoint.CheckpointError as err:
        refused = str(err)
    with torch.no_grad():  # the same base, every other weight another
        base = dict(unwrap_model(state.model[0]).named_parameters())
        for n, p in unwrap_model(other.model[0]).named_parameters():
            if n.endswith(frozen):
                p.copy_(base[n])
    before = {n: p.detach().clone() for n, p in unwrap_model(other.model[0]).named_parameters()}
    other, _ = fnppo.checkpoint.load_checkpoint(Path(root) / "lora", other)
    after = dict(unwrap_model(other.model[0]).named_parameters())
    saved = dict(unwrap_model(state.model[0]).named_parameters())
    untouched = [n for n in before if n.endswith(frozen) and torch.equal(after[n], before[n])]
    loaded = [n for n in before if not n.endswith(frozen) and torch.equal(after[n], saved[n])]

    fnppo.checkpoint.save_checkpoint(Path(root) / "step0", _build())  # never stepped
    fresh, m1 = _step(_build(), 1)
    fresh_run = [m1, _step(fresh, 2)[1]]  # step 2 depends on the first update (Adam's step count, moments)
    resumed, _ = fnppo.checkpoint.load_checkpoint(Path(root) / "step0", _build(init_seed=99))
    step0 = resumed.step
    resumed, r1 = _step(resumed, 1)
    # the non-distributed optimizer (Megatron's own sharded form): resumes bit for bit
    plain, _ = _step(_build(distributed=False), 1)
    fnppo.checkpoint.save_checkpoint(Path(root) / "plain", plain)
    plain, m2 = _step(plain, 2)  # (train_step updates the model and optimizer objects it is given)
    straight = [m2, _step(plain, 3)[1]]
    again, _ = fnppo.checkpoint.load_checkpoint(Path(root) / "plain", _build(init_seed=99, distributed=False))
    again, m2 = _step(again, 2)
    return {
        "plain": (straight, [m2, _step(again, 3)[1]]),
        "lora_keys": keys,
        "lora_untouched": untouched,
        "lora_other_base": refused,
        "lora_loaded": loaded,
        "n_params": len(before),
        "first_step": (fresh_run, [r1, _step(resumed, 2)[1]]),
        "step0_step": step0,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("layouts"))
    # 4 ranks on a small shared CPU can be slow: a generous bound per launch
    four = run_ranks(_four_ranks, 4, root, tp=2, timeout_s=900)[0]
    two = run_ranks(_two_ranks, 2, root, ep=2, timeout_s=900)
    one = run_ranks(_one_rank, 1, root, timeout_s=900)[0]
    return {"dense": four, "moe": two[0]["moe"], "tp2": two[0]["tp2"], "pp2": two[0]["pp2"], "one": one}


def _close(a: dict, b: dict) -> bool:
    return all(abs(a[k] - b[k]) <= REL * abs(b[k]) for k in KEYS)


@pytest.mark.parametrize("where", ["one", "tp2", "pp2", "moe_one"])
def test_checkpoint_resumes_under_another_layout(runs, where):
    saved = runs["moe" if where == "moe_one" else "dense"]
    resumed = {"one": runs["one"]["dense"], "moe_one": runs["one"]["moe"]}.get(where) or runs[where]
    assert resumed["step"] == 1
    assert sorted(resumed["full"]) == sorted(saved["full"])
    differ = [k for k in saved["full"] if not torch.equal(resumed["full"][k], saved["full"][k])]
    assert differ == [], differ[:5]
    for got, want in zip(resumed["metrics"], saved["metrics"], strict=True):
        assert _close(got, want), (where, got, want)


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_loaded_moments_equal_a_one_process_first_step(runs, model):
    loaded = runs["one"][model]["moments"]
    reference = runs["one"][f"reference_moments_{model}"]
    assert sorted(loaded) == sorted(reference)
    for name, ref in reference.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert ref[k].abs().max() > 0, (name, k)  # the moments moved
            # another reduction order: equal to float rounding of the tensor's scale
            scale = float(ref[k].abs().max())
            torch.testing.assert_close(loaded[name][k], ref[k], rtol=1e-4, atol=1e-5 * scale)


def test_lora_base_weights_are_left_out_and_not_loaded(runs):
    one = runs["one"]
    assert not [k for k in one["lora_keys"] if "linear_fc1.weight" in k], one["lora_keys"]
    assert any("linear_fc2.weight" in k for k in one["lora_keys"])
    assert one["lora_untouched"] == ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc1.weight"]
    assert len(one["lora_loaded"]) == one["n_params"] - 2
    assert one["lora_other_base"] == (  # the base weights are not in the checkpoint: another base is refused
        "load_checkpoint: argument 'state' expected the base model the checkpoint's adapters were trained on, "
        "received another base model: 2 of 2 base weights differ bit for bit "
        "(decoder.layers.0.mlp.linear_fc1.weight, decoder.layers.1.mlp.linear_fc1.weight)"
    )


def test_non_distributed_optimizer_resumes_bit_for_bit(runs):
    straight, resumed = runs["one"]["plain"]
    assert straight == resumed  # step 3 depends on the loaded Adam moments too


def test_save_before_the_first_step_resumes_like_a_fresh_optimizer(runs):
    fresh, resumed = runs["one"]["first_step"]
    assert runs["one"]["step0_step"] == 0
    assert fresh == resumed  # bit for bit
