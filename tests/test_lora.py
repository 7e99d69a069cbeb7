"""LoRA on Megatron (fnppo.lora): one train_step of the adapters in every layout against one process,
frozen base weights, adapters-only optimizer and DDP buffers, the adapter-free reference.

Every layout builds the same full model (``layout_invariant_init``), puts adapters on it and loads
one set of full random adapters (``B`` non-zero, so that ``A`` gets a gradient), then runs one
``train_step``. The loss, the grad norm and the updated full adapters must equal the one-process
run's to 1e-5 under DP=2, TP=2 (with and without sequence parallelism), PP=2, PP=2 with VPP=2
(4 layers), CP=2 (dense) and EP=2 (MoE: the experts' linears carry adapters too), all in one
2-rank launch. In the one-process run: the base
weights stay bit-identical, DDP's buffers and the optimizer hold exactly the adapters, the adapter-free
parameter set (``adapters_off``) gives the log-probs of a model built without adapters bit for bit, and
a checkpoint holds the adapters (and their optimizer state) only and resumes bit for bit. The adapted
forward itself is checked against ``peft`` on ``transformers`` in ``tests/test_lora_peft.py``.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import fnppo
from fnppo.megatron.unwrap import unwrap_model
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config

REL = 1e-5
LORA = dict(rank=4, alpha=12.0, seed=5)


def _cfg(moe: bool, layers: int = 2) -> fnppo.ModelConfig:
    return tiny_model_config(moe=moe, num_layers=layers)


def _random_adapters(full: dict) -> dict:
    """Full adapters of the given names and shapes, drawn from a generator seeded by each name."""
    out = {}
    for name, t in full.items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out[name] = torch.randn(t.shape, generator=g) * 0.3
    return out


def _build(moe: bool, lora: bool = True, layers: int = 2, **overrides) -> list:
    chunks = fnppo.build_gpt(_cfg(moe, layers), **overrides)
    fnppo.models.layout_invariant_init(chunks, seed=3, std=0.2 if moe else None)
    if lora:
        fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(**LORA))
        full = fnppo.models.gather_full_weights(chunks, adapters=True)
        fnppo.models.load_full_weights(chunks, _random_adapters(full), adapters=True)
    return chunks


def _step_cfg() -> fnppo.StepConfig:
    loss = fnppo.losses.from_flat(loss_agg_mode="token-mean", kl_coef=0.05, entropy_coeff=0.01)
    return fnppo.StepConfig(loss=loss, num_microbatches=2)


def _one_step(moe: bool, layers: int = 2, **overrides) -> dict:
    chunks = _build(moe, layers=layers, **overrides)
    base = fnppo.models.gather_full_weights(chunks)
    ddp = fnppo.wrap_ddp(chunks)
    # Adam with eps = 1: the first update is lr * g / (|g| + 1), close to the gradient itself (with a small
    # eps, g / (|g| + eps) magnifies reduction-order noise in the near-zero gradients of rarely routed experts)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=0.5, adam_eps=1.0))
    batch = fnppo.shard_for_data_parallel(synthetic_samples(8, seed=7))
    state, metrics = fnppo.train_step(state, batch, _step_cfg())
    after = fnppo.models.gather_full_weights(state.model)
    return {
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "adapters": fnppo.models.gather_full_weights(state.model, adapters=True),
        "base_unchanged": sorted(base) == sorted(after) and all(torch.equal(base[k], after[k]) for k in base),
    }


LAYOUTS = {  # name: (init_parallel arguments, MoE, build_gpt overrides)
    "dp2": (dict(tp=1, pp=1), False, {}),
    "tp2": (dict(tp=2, pp=1), False, {}),
    "tp2-sp": (dict(tp=2, pp=1), False, dict(sequence_parallel=True)),
    "pp2": (dict(tp=1, pp=2), False, {}),
    "cp2": (dict(tp=1, pp=1, cp=2), False, {}),
    "ep2": (dict(tp=1, pp=1, ep=2, etp=1), True, {}),
    "pp2-vpp2": (dict(tp=1, pp=2, vpp=2), False, {}),  # 4 layers: one per virtual stage
}


def _reference_key(layout: str) -> str:
    par, moe, _ = LAYOUTS[layout]
    return "moe" if moe else ("dense4" if par.get("vpp") else "dense")


def _dropout_masks(sp: bool) -> dict:
    """Which inputs the adapters' dropout kept on this TP rank, for a column-parallel (fused QKV)
    and a row-parallel (attention output) linear in training mode (``F.dropout`` recorded)."""
    import types

    import fnppo.megatron.lora_linear as ll

    chunks = fnppo.build_gpt(_cfg(False), **({"sequence_parallel": True} if sp else {}))
    fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(**dict(LORA, dropout=0.5)))
    attn = unwrap_model(chunks[0]).decoder.layers[0].self_attention
    attn.train()
    kept = []

    def dropout(x, p, training):
        y = torch.nn.functional.dropout(x, p=p, training=training)
        kept.append((y != 0).flatten().tolist())
        return y

    saved = ll.F
    ll.F = types.SimpleNamespace(linear=saved.linear, layer_norm=saved.layer_norm, dropout=dropout)
    try:
        tokens = 8 // (2 if sp else 1)  # this rank's tokens under sequence parallelism
        attn.linear_qkv(torch.ones(tokens, 1, 32))
        attn.linear_proj(torch.ones(8, 1, 16))  # the whole sequence, this rank's input columns
    finally:
        ll.F = saved
    return {"column": kept[0], "row": kept[1]}


def _two_ranks(root: str) -> dict:
    out = {}
    for name, (par, moe, overrides) in LAYOUTS.items():
        fnppo.init_parallel(**par, seed=1234, device="cpu", timeout_s=120.0)
        out[name] = _one_step(moe, layers=4 if par.get("vpp") else 2, **overrides)
    fnppo.init_parallel(tp=2, pp=1, seed=1234, device="cpu", timeout_s=120.0)
    out["dropout"] = _dropout_masks(sp=False)
    out["dropout_sp"] = _dropout_masks(sp=True)
    out["resume_tp2"] = _other_layout_resume(root)
    fnppo.init_parallel(tp=1, pp=2, seed=1234, device="cpu", timeout_s=120.0)
    out["resume_pp2"] = _other_layout_resume(root)
    return out


def _holds_adapters_only(state: fnppo.TrainState) -> dict:
    """What DDP's buffers and the optimizer hold (one process), against the adapters."""
    core = unwrap_model(state.model[0])
    adapters = {id(p) for n, p in core.named_parameters() if fnppo.lora.is_adapter(p)}
    in_buffers = {id(p) for c in state.model for b in [*c.buffers, *c.expert_parallel_buffers] for p in b.params}
    grad_numel = sum(b.numel_unpadded for c in state.model for b in [*c.buffers, *c.expert_parallel_buffers])
    subs = state.optimizer.chained_optimizers
    in_optimizer = {id(p) for s in subs for p in s.model_param_group_index_map}
    moments = [t for s in subs for st in s.optimizer.state.values() for k, t in st.items() if k.startswith("exp_avg")]
    adapter_numel = sum(p.numel() for n, p in core.named_parameters() if fnppo.lora.is_adapter(p))
    return {
        "buffers_are_adapters": in_buffers == adapters,
        "optimizer_params_are_adapters": in_optimizer == adapters,
        "grad_numel": grad_numel,
        "moment_numel": sum(t.numel() for t in moments),
        "adapter_numel": adapter_numel,
        "trainable": sorted(n for n, p in core.named_parameters() if p.requires_grad),
        "adapter_names": sorted(n for n, p in core.named_parameters() if fnppo.lora.is_adapter(p)),
    }


def _reference_is_the_base(moe: bool) -> bool:
    """compute_logprobs with ``adapters_off`` on the adapted model == a model built without adapters."""
    cfg = fnppo.StepConfig(num_microbatches=2)
    batch = synthetic_samples(6, seed=11)
    plain = fnppo.wrap_ddp(_build(moe, lora=False))
    want, _ = fnppo.compute_logprobs(plain, batch, config=cfg)
    adapted = fnppo.wrap_ddp(_build(moe))
    got, _ = fnppo.compute_logprobs(adapted, batch, params=fnppo.lora.adapters_off(adapted), config=cfg)
    on, _ = fnppo.compute_logprobs(adapted, batch, config=cfg)
    differs = max(float((a - b).abs().max()) for a, b in zip(on, want, strict=True))
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and differs > 1e-3


def _adam_state(seed: int = 5, base_seed: int = 3) -> fnppo.TrainState:
    chunks = fnppo.build_gpt(_cfg(False))
    fnppo.models.layout_invariant_init(chunks, seed=base_seed)
    fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(**dict(LORA, seed=seed)))
    ddp = fnppo.wrap_ddp(chunks)
    return fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-2))


def _resume(root: str) -> dict:
    """Step, save, step (the uninterrupted run); load into a state of other adapters, step again."""
    from megatron.core import dist_checkpointing

    batch = [synthetic_samples(8, seed=20 + i) for i in range(2)]
    state, _ = fnppo.train_step(_adam_state(), batch[0], _step_cfg())
    fnppo.checkpoint.save_checkpoint(f"{root}/lora", state)
    keys = sorted(dist_checkpointing.load_tensors_metadata(f"{root}/lora"))
    saved = fnppo.models.gather_full_weights(state.model, adapters=True)
    state, want = fnppo.train_step(state, batch[1], _step_cfg())
    other, _ = fnppo.checkpoint.load_checkpoint(f"{root}/lora", _adam_state(seed=99))
    other, got = fnppo.train_step(other, batch[1], _step_cfg())
    a = fnppo.models.gather_full_weights(state.model, adapters=True)
    b = fnppo.models.gather_full_weights(other.model, adapters=True)
    return {
        "keys": keys,
        "metrics_equal": all(got[k] == want[k] for k in ("loss", "grad_norm")),
        "adapters_equal": sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a),
        "saved": saved,
        "other_base": _refusal(root),
    }


def _refusal(root: str) -> str:
    """The message of loading the LoRA checkpoint onto a base of the same architecture, other weights."""
    try:
        fnppo.checkpoint.load_checkpoint(f"{root}/lora", _adam_state(seed=99, base_seed=4))
    except fnppo.checkpoint.CheckpointError as err:
        return str(err)
    return "no error"


def _other_layout_resume(root: str) -> dict:
    """The 1-rank LoRA checkpoint loaded under this layout: onto its base, then onto another."""
    other, _ = fnppo.checkpoint.load_checkpoint(f"{root}/lora", _adam_state(seed=99))
    return {"adapters": fnppo.models.gather_full_weights(other.model, adapters=True), "other_base": _refusal(root)}


def _token_batched_products(state: fnppo.TrainState) -> list:
    """Input shapes of every batched product of one step that multiplies one row per token (``[n, 1, k]``
    by ``[n, k, m]``): the frozen output layer's backward on logits in transposed strides."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fnppo.train_step(state, synthetic_samples(8, seed=8), _step_cfg())
    shapes = [e.input_shapes for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::bmm"]
    return [s for s in shapes if len(s[0]) == 3 and s[0][0] > 1 and s[0][1] == 1]


def _one_rank(root: str) -> dict:
    out = {name: _one_step(moe) for name, moe in (("dense", False), ("moe", True))}
    out["dense4"] = _one_step(False, layers=4)
    out["resume"] = _resume(root)
    chunks = _build(False)
    ddp = fnppo.wrap_ddp(chunks)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-2))
    state, _ = fnppo.train_step(state, synthetic_samples(8, seed=7), _step_cfg())
    out["holds"] = _holds_adapters_only(state)
    out["token_batched_products"] = _token_batched_products(state)
    out["reference_dense"] = _reference_is_the_base(False)
    out["reference_moe"] = _reference_is_the_base(True)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("lora"))
    return {
        "one": run_ranks(_one_rank, 1, root, timeout_s=900)[0],
        "two": run_ranks(_two_ranks, 2, root, timeout_s=900),
    }


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= REL * max(1.0, abs(want))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_lora_step_is_layout_invariant(runs, layout):
    want = runs["one"][_reference_key(layout)]
    for rank, got in enumerate(runs["two"]):
        got = got[layout]
        for key in ("loss", "grad_norm"):
            assert _close(got[key], want[key]), (layout, rank, key, got[key], want[key])
        assert sorted(got["adapters"]) == sorted(want["adapters"]), layout
        for name, t in want["adapters"].items():
            err = float((got["adapters"][name] - t).abs().max())
            assert err <= REL * max(1.0, float(t.abs().max())), (layout, rank, name, err)
        assert got["base_unchanged"], (layout, rank)


def test_dropout_masks_are_shared_where_the_input_is_and_independent_where_it_is_split(runs):
    """Under TP=2: the replicated input of a column-parallel linear gets the same mask on both ranks
    (each rank's rank-r activations must be the same); a row-parallel linear's input columns, and
    under sequence parallelism each rank's tokens, get masks of their own (Megatron's TP RNG stream)."""
    tp, sp = [r["dropout"] for r in runs["two"]], [r["dropout_sp"] for r in runs["two"]]
    assert tp[0]["column"] == tp[1]["column"]
    assert tp[0]["row"] != tp[1]["row"]
    assert sp[0]["column"] != sp[1]["column"]
    assert 0.3 < sum(tp[0]["row"]) / len(tp[0]["row"]) < 0.7  # p = 0.5


def test_adapters_moved_and_base_stayed(runs):
    for key in ("dense", "moe"):
        one = runs["one"][key]
        assert one["base_unchanged"], key
        start = _random_adapters(one["adapters"])
        moved = [n for n in one["adapters"] if not torch.equal(one["adapters"][n], start[n])]
        assert sorted(moved) == sorted(one["adapters"]), (key, sorted(set(one["adapters"]) - set(moved)))
    experts = [n for n in runs["one"]["moe"]["adapters"] if ".experts.local_experts." in n]
    assert len(experts) == 2 * 2 * 4 * 2  # 2 layers x 4 experts x (fc1, fc2) x (A, B)


def test_only_adapters_are_trained_and_held(runs):
    h = runs["one"]["holds"]
    assert h["trainable"] == h["adapter_names"] and h["adapter_names"], h["trainable"]
    assert h["buffers_are_adapters"] and h["optimizer_params_are_adapters"]
    assert h["grad_numel"] == h["adapter_numel"]
    assert h["moment_numel"] == 2 * h["adapter_numel"]  # exp_avg and exp_avg_sq of the adapters only


def test_frozen_output_layer_backward_is_one_matrix_product(runs):
    """Without the row-major gradient of the output layer (``fnppo.megatron.build``), the frozen
    output layer's backward multiplies each token's logit gradient by the vocabulary weight in a
    batched product (0.7 s per 8,192 tokens at a 152k vocabulary on an H200)."""
    assert runs["one"]["token_batched_products"] == [], runs["one"]["token_batched_products"]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_adapters_off_is_the_base_model_bit_for_bit(runs, moe):
    assert runs["one"]["reference_moe" if moe else "reference_dense"]


def test_checkpoint_holds_adapters_only_and_resumes_bit_for_bit(runs):
    r = runs["one"]["resume"]
    model_keys = [k for k in r["keys"] if k.startswith("decoder.") or k.startswith("embedding.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys
    assert not [k for k in r["keys"] if "word_embeddings" in k or k.endswith("linear_qkv.weight")], r["keys"]
    assert r["metrics_equal"] and r["adapters_equal"]


class _FrozenLinear(torch.autograd.Function):
    """A frozen output layer as Megatron's ``linear_with_frozen_weight`` computes it: the input
    gradient is ``grad_output.matmul(weight)`` on the gradient as it arrives."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return x.matmul(weight.t())

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad.matmul(weight), None


class _FrozenOutput(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return _FrozenLinear.apply(x, self.weight)


@pytest.mark.parametrize("b", [1, 3])
def test_frozen_output_layer_gradient_is_row_major_for_any_micro_batch_size(b):
    """The output layer's hook (``fnppo.megatron.build``) hands the frozen layer a row-major logit
    gradient for one sample per micro-batch (a view) and for several (the padded layout: a copy):
    ``GPTModel``'s ``logits.transpose(0, 1)`` makes the arriving gradient ``[s, b, V]`` with the
    strides of ``[b, s, V]``, which ``matmul`` would turn into a batched product per token. The
    input gradient equals the float64 product."""
    from torch.profiler import ProfilerActivity, profile

    from fnppo.megatron.build import _row_major_grad_hook

    s, v, h = 64, 96, 16
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(v, h, generator=g)
    layer = _FrozenOutput(weight)
    layer.register_forward_hook(_row_major_grad_hook)
    x = torch.randn(s, b, h, generator=g, requires_grad=True)
    upstream = torch.randn(b, s, v, generator=g)
    loss = (layer(x).transpose(0, 1) * upstream).sum()  # what GPTModel hands on: [b, s, V]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss.backward()
    batched = [e.input_shapes for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::bmm"]
    assert batched == [], batched
    want = (upstream.double().transpose(0, 1) @ weight.double()).float()
    torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-5)


def _eval_logprobs(dropout: float) -> dict:
    """compute_logprobs (twice) and forward_only of a LoRA model with adapter dropout ``dropout``."""
    chunks = fnppo.build_gpt(_cfg(False))
    fnppo.models.layout_invariant_init(chunks, seed=3)
    fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(**dict(LORA, dropout=dropout)))
    full = fnppo.models.gather_full_weights(chunks, adapters=True)
    fnppo.models.load_full_weights(chunks, _random_adapters(full), adapters=True)
    batch = synthetic_samples(4, seed=11)
    first, second = (fnppo.compute_logprobs(chunks, batch)[0] for _ in range(2))
    mbs = [fnppo.collate_microbatch(batch[:2]), fnppo.collate_microbatch(batch[2:], layout="padded")]
    rows = fnppo.forward_only(chunks, mbs, lambda logits, mb: logits.detach().clone())
    return {"first": first, "second": second, "forward_only": rows}


def _dropout_in_eval() -> dict:
    return {p: _eval_logprobs(p) for p in (0.0, 0.5)}


def test_adapter_dropout_is_off_in_compute_logprobs_and_forward_only():
    """A LoRA model with adapter dropout 0.5 gives, in ``compute_logprobs`` (called twice) and
    ``forward_only``, exactly the log-probs / logits of the same model with dropout 0: dropout
    belongs to training forwards only."""
    r = run_ranks(_dropout_in_eval, 1)[0]
    off, on = r[0.0], r[0.5]
    for key in ("first", "second"):
        assert len(on[key]) == len(off[key]) == 4
        for i, (a, b) in enumerate(zip(on[key], off[key], strict=True)):
            assert torch.equal(a, b), f"{key} log-probs of sample {i} differ with dropout 0.5"
    assert len(on["forward_only"]) == len(off["forward_only"]) > 0
    for a, b in zip(on["forward_only"], off["forward_only"], strict=True):
        assert torch.equal(a, b), "forward_only logits differ with dropout 0.5"


def test_a_lora_checkpoint_refuses_another_base_under_any_layout(runs):
    """Saved on base A under one rank: loads onto A under TP=2 and PP=2 (the adapters as saved), and
    onto B (the same architecture, other weights) is refused by name, under every layout."""
    saved = runs["one"]["resume"]["saved"]
    messages = [runs["one"]["resume"]["other_base"]]
    for r in runs["two"]:
        for layout in ("resume_tp2", "resume_pp2"):
            got = r[layout]["adapters"]
            assert sorted(got) == sorted(saved) and all(torch.equal(got[k], saved[k]) for k in saved), layout
            messages.append(r[layout]["other_base"])
    assert len(set(messages)) == 1, messages  # the same record under every layout: the same count, the same names
    for message in messages:
        assert message.startswith(
            "load_checkpoint: argument 'state' expected the base model the checkpoint's adapters were trained on, "
            "received another base model: "
        ), message
        assert "base weights differ bit for bit (decoder.layers.0." in message, message


def test_base_records_compare_bit_for_bit_within_a_dtype_and_rounded_across_dtypes():
    """A checkpoint's base record against this model's (pure: the records as ``base_record`` builds them)."""
    from fnppo.io.checkpoint.base import _digest, base_problem

    w = torch.randn(8, generator=torch.Generator().manual_seed(0))
    nudged = w + 1e-6 * w.abs().max()  # another fp32 base that rounds to the same bfloat16 values here
    assert torch.equal(w.to(torch.bfloat16), nudged.to(torch.bfloat16)) and not torch.equal(w, nudged)

    def record(t: torch.Tensor, dtype: str, arch: dict | None = None) -> dict:
        full = t.to(torch.float32)
        return {
            "arch": arch,
            "dtype": dtype,
            "tensors": {"n.weight": [_digest(full), _digest(full.to(torch.bfloat16))]},
        }

    f32, bf16 = record(w, "float32"), record(w.to(torch.bfloat16), "bfloat16")
    assert base_problem(f32, record(w, "float32")) is None and base_problem(None, f32) is None
    assert base_problem(f32, bf16) is None  # the same base held in bf16
    assert base_problem(f32, record(nudged, "float32")) == (
        "another base model: 1 of 1 base weights differ bit for bit (n.weight)"
    )
    assert "differ rounded to bfloat16 (float32 saved, bfloat16 now)" in base_problem(f32, record(-w, "bfloat16"))
    arch = {"family": "llama", "hidden": 32, "heads": 4}
    assert base_problem(record(w, "float32", arch), record(w, "float32", dict(arch, hidden=48))) == (
        "a base model of another architecture (the checkpoint's base has hidden=32 (this model's 48))"
    )
    assert base_problem(f32, None).startswith("a model without LoRA adapters")
