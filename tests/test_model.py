"""Tests of the model layer (fnppo.megatron.config, build, forward, weights): config validation, forward_logits (functional parameters, packed vs padded,
half precision), full-weight load/gather under TP=2 and PP=2, and the layout-invariant init."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fnppo
from fnppo.core.errors import InputError
from fnppo.core.losses import LossConfig
from fnppo.megatron.megatron_config import fp8_fields, transformer_config
from fnppo.megatron.parallel import ParallelLayout, current_layout
from fnppo.megatron.unwrap import unwrap_model
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config
from tests.messages import check_message

VOCAB = 64
LAYERS = 2
STD = 0.02


def _cfg(**kw) -> fnppo.ModelConfig:
    base = dict(num_layers=LAYERS, vocab_size=VOCAB, tie_embeddings=True, init_method_std=STD)
    return tiny_model_config(**{**base, **kw})


def _samples():
    return synthetic_samples(5, vocab_size=VOCAB, seed=3)


def _random_full(shapes: dict[str, torch.Size], seed: int) -> dict[str, torch.Tensor]:
    """Random full weights: norms around 1, matrices with std 0.05 (distinct per tensor)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        r = torch.randn(shapes[name], generator=g)
        out[name] = 1.0 + 0.1 * r if "norm" in name else 0.05 * r
    return out


def _real_token_logits(logits: torch.Tensor, mb) -> list[torch.Tensor]:
    """Logits of the real (non-padding) positions of every sample, in sample order."""
    out, offset = [], 0
    for i, length in enumerate(mb.seq_lens):
        if mb.is_packed:
            out.append(logits[0, offset : offset + length])
            offset += mb.segment_lens[i]
        else:
            out.append(logits[i, :length])
    return out


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------------
# one rank: forward_logits and init statistics
# ---------------------------------------------------------------------------------------------
def _single() -> dict:
    out: dict = {}
    (model,) = fnppo.build_gpt(_cfg())
    fnppo.models.layout_invariant_init([model], seed=5)
    out["init"] = fnppo.models.gather_full_weights([model])
    # the gathered tensors are copies: a later in-place update of the model does not reach them
    probe = fnppo.models.gather_full_weights([model])
    with torch.no_grad():
        model.decoder.final_layernorm.weight.mul_(3.0)
    out["gather_is_copy"] = torch.equal(
        probe["decoder.final_layernorm.weight"], out["init"]["decoder.final_layernorm.weight"]
    )
    with torch.no_grad():
        model.decoder.final_layernorm.weight.div_(3.0)
    samples = _samples()
    padded = fnppo.collate_microbatch(samples, layout="padded")
    packed = fnppo.collate_microbatch(samples, layout="packed")
    packed4 = fnppo.collate_microbatch(samples, layout="packed", pad_to_multiple_of=4)
    model.eval()
    with torch.no_grad():
        base = fnppo.forward_logits(model, padded)
        out["shapes"] = (tuple(base.shape), tuple(fnppo.forward_logits(model, packed).shape))
        ref = _real_token_logits(base, padded)
        out["packed_vs_padded"] = _max_diff(_real_token_logits(fnppo.forward_logits(model, packed), packed), ref)
        out["packed4_vs_padded"] = _max_diff(_real_token_logits(fnppo.forward_logits(model, packed4), packed4), ref)
        out["scale"] = float(base.abs().max())

    # params=snapshot equals the module call
    snap = fnppo.models.snapshot_params([model])[0]
    out["snapshot_names"] = sorted(snap) == sorted(n for n, _ in model.named_parameters())
    with torch.no_grad():
        out["snapshot_equal"] = torch.equal(fnppo.forward_logits(model, padded, params=snap), base)

    # params with every weight scaled: equals a module whose weights really changed
    own_before = {n: (p.detach().clone(), p._version) for n, p in model.named_parameters()}
    scaled = {n: (v * 0.8).requires_grad_(True) for n, v in snap.items()}
    logits_scaled = fnppo.forward_logits(model, padded, params=scaled)
    logits_scaled.float().square().sum().backward()
    out["scaled_grads_nonzero"] = all(t.grad is not None and float(t.grad.abs().max()) > 0 for t in scaled.values())
    out["own_grads_none"] = all(p.grad is None for p in model.parameters())
    out["own_untouched"] = all(
        torch.equal(p, own_before[n][0]) and p._version == own_before[n][1] for n, p in model.named_parameters()
    )
    # an explicit layer spec is the one built (here Megatron's own core attention instead of fnppo's)
    (plain,) = fnppo.build_gpt(_cfg(), layer_spec=fnppo.models.local_layer_spec(_cfg(), packed_attention=False))
    out["explicit_spec_core_attention"] = type(plain.decoder.layers[0].self_attention.core_attention).__name__
    out["default_spec_core_attention"] = type(model.decoder.layers[0].self_attention.core_attention).__name__
    (other,) = fnppo.build_gpt(_cfg())
    with torch.no_grad():
        for n, p in other.named_parameters():
            p.copy_(scaled[n])
        other.eval()
        from_module = fnppo.forward_logits(other, padded)
    out["scaled_vs_module"] = float((logits_scaled.detach() - from_module).abs().max())
    out["scaled_vs_base"] = float((logits_scaled.detach() - base).abs().max())
    # a partial dict: only the final norm replaced, the rest falls back to the module's tensors
    partial = {"decoder.final_layernorm.weight": snap["decoder.final_layernorm.weight"] * 0.5}
    with torch.no_grad():
        out["partial_vs_base"] = float((fnppo.forward_logits(model, padded, params=partial) - base).abs().max())
        # logits are linear in the final norm weight when everything else is fixed
        out["partial_vs_half"] = float((fnppo.forward_logits(model, padded, params=partial) - 0.5 * base).abs().max())
    # through a DDP wrapper (names are still those of the unwrapped GPTModel)
    (ddp,) = fnppo.wrap_ddp([model], use_distributed_optimizer=False)
    ddp.eval()
    with torch.no_grad():
        out["ddp_scaled_vs_module"] = float(
            (fnppo.forward_logits(ddp, padded, params=scaled) - from_module).abs().max()
        )
        out["ddp_plain_vs_base"] = float((fnppo.forward_logits(ddp, padded) - base).abs().max())

    # bf16: Float16Module, bf16 logits without an fp32 copy, params= works through the wrapper
    (half,) = fnppo.build_gpt(_cfg(dtype="bf16"))
    out["bf16_wrapper"] = type(half).__name__
    fnppo.models.layout_invariant_init([half], seed=5)
    half.eval()
    with torch.no_grad():
        lh = fnppo.forward_logits(half, padded)
        lh_params = fnppo.forward_logits(half, padded, params=fnppo.models.snapshot_params([half])[0])
    out["bf16_dtype"] = (lh.dtype, lh_params.dtype)
    out["bf16_param_dtype"] = {p.dtype for p in half.parameters()}
    out["bf16_params_equal"] = torch.equal(lh, lh_params)
    out["bf16_vs_fp32"] = _max_diff(_real_token_logits(lh, padded), ref)

    # load -> gather round trip on one rank; logits of known full weights for the sharded runs
    shapes = {k: v.shape for k, v in out["init"].items()}
    full = _random_full(shapes, seed=9)
    fnppo.models.load_full_weights([model], full)
    back = fnppo.models.gather_full_weights([model])
    out["roundtrip_1"] = set(back) == set(full) and all(torch.equal(back[k], full[k]) for k in full)
    with torch.no_grad():
        out["full"] = full
        out["full_logits"] = fnppo.forward_logits(ddp, padded)
    return out


# ---------------------------------------------------------------------------------------------
# two ranks (TP=2 or PP=2): init invariance, load/gather, refusals
# ---------------------------------------------------------------------------------------------
def _params(chunks) -> list[torch.Tensor]:
    return [p.detach().clone() for c in chunks for p in unwrap_model(c).parameters()]


def _unchanged(chunks, before: list[torch.Tensor]) -> bool:
    now = [p for c in chunks for p in unwrap_model(c).parameters()]
    return len(now) == len(before) and all(torch.equal(a, b) for a, b in zip(now, before, strict=True))


def _try_load(chunks, full: dict, **kw) -> str:
    try:
        fnppo.models.load_full_weights(chunks, full, **kw)
    except InputError as err:
        return str(err)
    return "no error"


def _sharded(full: dict[str, torch.Tensor]) -> dict:
    lay = current_layout()
    out: dict = {"rank": lay.rank}
    chunks = fnppo.build_gpt(_cfg())
    fnppo.models.layout_invariant_init(chunks, seed=5)
    out["init"] = fnppo.models.gather_full_weights(chunks)
    out["local_names"] = sorted(n for c in chunks for n, _ in unwrap_model(c).named_parameters())

    fnppo.models.load_full_weights(chunks, full)
    back = fnppo.models.gather_full_weights(chunks)
    out["roundtrip_names"] = set(back) == set(full)
    out["roundtrip_equal"] = set(back) == set(full) and all(torch.equal(back[k], full[k]) for k in full)

    # the loaded shards are the right ones: logits of the whole model equal those of one process
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=False)
    mb = fnppo.collate_microbatch(_samples(), layout="padded")
    logits = fnppo.forward_only(ddp, [mb], lambda lg, _mb: lg.detach().clone())
    out["logits"] = None if logits is None else logits[0]

    # refusals: a tensor this rank holds is missing / has a wrong shape -> error naming it, nothing loaded
    target = f"decoder.layers.{lay.pp_rank}.mlp.linear_fc1.weight"
    doubled = {k: 2.0 * v for k, v in full.items()}
    before = _params(chunks)
    missing = {k: v for k, v in doubled.items() if k != target}
    out["missing_msg"] = _try_load(chunks, missing)
    out["missing_unchanged"] = _unchanged(chunks, before)
    wrong = dict(doubled)
    wrong[target] = torch.zeros(full[target].shape[0] + 2, full[target].shape[1])
    out["wrong_msg"] = _try_load(chunks, wrong)
    out["wrong_unchanged"] = _unchanged(chunks, before)
    out["target"] = target
    # strict=True: an unknown tensor is an error too (documented); strict=False ignores it
    extra = dict(doubled)
    extra["decoder.layers.7.mlp.linear_fc9.weight"] = torch.zeros(3, 3)
    out["extra_msg"] = _try_load(chunks, extra, strict=True)
    out["extra_unchanged"] = _unchanged(chunks, before)
    return out


@pytest.fixture(scope="module")
def single() -> dict:
    return run_ranks(_single, 1)[0]


@pytest.fixture(scope="module", params=[{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def sharded(request, single) -> tuple[str, list[dict]]:
    name = "tp2" if "tp" in request.param else "pp2"
    return name, run_ranks(_sharded, 2, single["full"], **request.param)


# ---------------------------------------------------------------------------------------------
# ModelConfig / transformer_config validation (no ranks needed)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,arg,expected",
    [
        ({"num_layers": 0}, "num_layers", "an int >= 1"),
        ({"hidden_size": -32}, "hidden_size", "an int >= 1"),
        ({"vocab_size": 64.0}, "vocab_size", "an int >= 1"),
        ({"max_seq_len": None}, "max_seq_len", "an int >= 1"),
        ({"hidden_size": 30}, "hidden_size", "a multiple of num_attention_heads=4"),  # not a multiple of 4 heads
        ({"num_query_groups": 3}, "num_query_groups", "a divisor of num_attention_heads=4"),  # does not divide 4 heads
        ({"dtype": "fp8"}, "dtype", "one of 'fp32', 'bf16', 'fp16'"),
        ({"normalization": "BatchNorm"}, "normalization", "'RMSNorm' or 'LayerNorm'"),
    ],
)
def test_model_config_rejects_bad_values(kw, arg, expected):
    with pytest.raises(InputError) as info:
        _cfg(**kw)
    assert str(info.value) == f"ModelConfig: argument '{arg}' expected {expected}, received {next(iter(kw.values()))!r}"


def _bool_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(fnppo.ModelConfig) if f.type in ("bool", "bool | None")]


@pytest.mark.parametrize("name", _bool_fields())
@pytest.mark.parametrize("value", ["yes", 1, 0, "False"])
def test_model_config_switches_take_real_bools_only(name, value):
    """Every switch (``bool`` or ``bool | None``) refuses truthy stand-ins instead of storing them."""
    kind = {f.name: f.type for f in dataclasses.fields(fnppo.ModelConfig)}[name]
    expected = "a bool or None" if kind == "bool | None" else "a bool"
    with pytest.raises(InputError) as info:
        _cfg(num_experts=4, moe_shared_expert_size=16, **{name: value})
    received = f"{value!r} ({type(value).__name__})"
    assert str(info.value) == f"ModelConfig: argument '{name}' expected {expected}, received {received}"


def test_model_config_refuses_expert_bias_without_sigmoid_scores():
    with pytest.raises(InputError) as info:
        _cfg(num_experts=4, moe_expert_bias=True)
    assert str(info.value) == (
        "ModelConfig: argument 'moe_expert_bias' expected False unless moe_score_function='sigmoid' "
        "(aux-loss-free balancing), received True with moe_score_function='softmax'"
    )
    assert _cfg(num_experts=4, moe_expert_bias=True, moe_score_function="sigmoid").moe_expert_bias


def test_model_config_switches_accept_bools_and_none_where_allowed():
    names = _bool_fields()
    assert {"swiglu", "tie_embeddings", "deterministic", "fusions"} <= set(names)
    for name in names:
        moe = dict(num_experts=4, moe_shared_expert_size=16, moe_score_function="sigmoid")
        assert getattr(_cfg(**moe, **{name: True}), name) is True
        assert getattr(_cfg(**{name: False}), name) is False
    assert _cfg(fusions=None).fusions is None


def test_model_config_is_frozen_and_derives_dtype_and_vocab():
    cfg = _cfg(vocab_size=50, make_vocab_size_divisible_by=16, dtype="bf16")
    assert cfg.padded_vocab_size == 64 and cfg.torch_dtype is torch.bfloat16
    assert _cfg(vocab_size=64, make_vocab_size_divisible_by=16).padded_vocab_size == 64
    assert _cfg(dtype="fp16").torch_dtype is torch.float16 and _cfg().torch_dtype is torch.float32
    assert _cfg(hidden_size=30, kv_channels=8).hidden_size == 30  # explicit head size: no divisibility rule
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3  # type: ignore[misc]


def test_tiny_model_config_is_the_documented_model_with_overrides():
    """fnppo.testing.tiny_model_config: the tests' small GPT; overrides win, ``moe=True`` adds 4 experts."""
    base = fnppo.ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, vocab_size=64,
        max_seq_len=32,
    )  # fmt: skip
    assert tiny_model_config() == base
    assert tiny_model_config(num_layers=4, tie_embeddings=False) == dataclasses.replace(
        base, num_layers=4, tie_embeddings=False
    )
    moe = tiny_model_config(moe=True, moe_topk=1)
    assert (moe.num_experts, moe.moe_topk, moe.moe_ffn_hidden_size, moe.moe_load_balancing) == (4, 1, 48, "none")
    assert dataclasses.replace(moe, num_experts=None, moe_topk=base.moe_topk, moe_ffn_hidden_size=None) == base


def _fake_layout(
    tp: int = 1, pp: int = 1, vpp: int | None = None, backend: str = "gloo", cp: int = 1
) -> ParallelLayout:
    return ParallelLayout(
        world_size=tp * pp * cp,
        rank=0,
        tp=tp,
        pp=pp,
        dp=1,
        vpp=vpp,
        tp_rank=0,
        pp_rank=0,
        dp_rank=0,
        tp_group=None,
        pp_group=None,
        dp_group=None,
        backend=backend,
        cp=cp,
    )


def test_deterministic_algorithms_switches_torch_for_the_block_and_restores_it():
    from fnppo.megatron.forward import deterministic_algorithms

    def state():
        return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()

    before = state()
    assert before == (False, False)
    with deterministic_algorithms(True):
        assert state() == (True, True)
    assert state() == before
    with pytest.raises(RuntimeError, match="planted"):
        with deterministic_algorithms(True):
            raise RuntimeError("planted")
    assert state() == before  # restored on an exception too
    torch.use_deterministic_algorithms(True)  # a caller's own strict setting survives both ways
    try:
        with deterministic_algorithms(True):
            assert state() == (True, True)
        assert state() == (True, False)
        with deterministic_algorithms(False):
            assert state() == (True, False)
    finally:
        torch.use_deterministic_algorithms(False)
    with deterministic_algorithms(False):
        assert state() == before
    assert transformer_config(_cfg(deterministic=True), _fake_layout()).deterministic_mode
    assert not transformer_config(_cfg(), _fake_layout()).deterministic_mode


def test_default_spec_is_the_local_one_under_context_parallelism(monkeypatch):
    """build_gpt's default spec: default_layer_spec (TE's where installed) except under CP, where the
    local spec's packed attention does the exact CP attention."""
    import fnppo.megatron.layer_specs
    from fnppo.megatron.core_attention import PackedDotProductAttention
    from fnppo.megatron.layer_specs import choose_layer_spec

    monkeypatch.setattr(fnppo.megatron.layer_specs, "default_layer_spec", lambda cfg, **kw: ("default_layer_spec", kw))
    assert choose_layer_spec(_cfg(), _fake_layout()) == ("default_layer_spec", {})
    assert choose_layer_spec(_cfg(), _fake_layout(tp=2)) == ("default_layer_spec", {})
    spec = choose_layer_spec(_cfg(), _fake_layout(cp=2))
    assert spec.submodules.self_attention.submodules.core_attention is PackedDotProductAttention


def test_fusions_follow_the_device_unless_forced(monkeypatch):
    """Megatron's fused kernels: on for a model built for CUDA (NCCL), off on CPU (gloo), or forced."""
    from fnppo.megatron.megatron_config import fusion_fields

    names = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion")
    assert fusion_fields(_cfg(), _fake_layout()) == dict.fromkeys(names, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fusion_fields(_cfg(), _fake_layout(backend="nccl")) == dict.fromkeys(names, True)
    assert fusion_fields(_cfg(), _fake_layout(backend="gloo")) == dict.fromkeys(names, False)  # CPU ranks
    assert fusion_fields(_cfg(fusions=False), _fake_layout(backend="nccl")) == dict.fromkeys(names, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    forced = fusion_fields(_cfg(fusions=True, swiglu=False), _fake_layout())
    assert forced == {
        "bias_activation_fusion": False,
        "bias_dropout_fusion": True,
        "apply_rope_fusion": True,
    }  # GeLU w/o bias: unfusable
    cfg = transformer_config(_cfg(fusions=True), _fake_layout())  # Megatron accepts it: a fused RoPE is installed
    assert cfg.apply_rope_fusion and cfg.bias_activation_fusion and cfg.bias_dropout_fusion


@pytest.mark.parametrize(
    "cfg_kw,layout_kw,arg,expected,received",
    [
        ({"num_attention_heads": 4, "num_query_groups": 4}, {"tp": 8}, "num_attention_heads", "tp=8", "4"),
        ({"num_attention_heads": 4, "num_query_groups": 1}, {"tp": 2}, "num_query_groups", "tp=2", "1"),
        ({"vocab_size": 63}, {"tp": 2}, "vocab_size", "tp=2 (set make_vocab_size_divisible_by)", "63"),
        ({"num_layers": 3}, {"pp": 2}, "num_layers", "pp*vpp=2*1", "3"),
        ({"num_layers": 4}, {"pp": 2, "vpp": 3}, "num_layers", "pp*vpp=2*3", "4"),
    ],
)
def test_transformer_config_rejects_layouts_that_do_not_divide(cfg_kw, layout_kw, arg, expected, received):
    with pytest.raises(InputError) as info:
        transformer_config(_cfg(**cfg_kw), _fake_layout(**layout_kw))
    assert (
        str(info.value)
        == f"transformer_config: argument '{arg}' expected a multiple of {expected}, received {received}"
    )


def test_transformer_config_rejects_padding_that_puts_every_real_token_on_one_rank():
    # vocab 40 padded to 128 over tp=2: rank 0 would hold all 40 real columns, rank 1 only padding
    # (indistinguishable from logits gathered over TP, which logprob_and_entropy refuses)
    with pytest.raises(InputError) as info:
        transformer_config(_cfg(vocab_size=40, make_vocab_size_divisible_by=128), _fake_layout(tp=2))
    assert str(info.value) == (
        "transformer_config: argument 'make_vocab_size_divisible_by' expected a padding that leaves real tokens on "
        "more than one of tp=2 ranks (padded vocabulary 128 / tp >= vocab_size 40; lower it), received 128"
    )
    transformer_config(_cfg(vocab_size=40, make_vocab_size_divisible_by=128), _fake_layout(tp=1))  # fine
    transformer_config(_cfg(vocab_size=70, make_vocab_size_divisible_by=128), _fake_layout(tp=2))  # 64 < 70: fine


# ---------------------------------------------------------------------------------------------
# forward_logits on one rank
# ---------------------------------------------------------------------------------------------
def test_forward_logits_shapes_and_packed_equals_padded(single):
    n = 5
    (b, s, v), (one, total, v2) = single["shapes"]
    lengths = [len(x) for x in _samples()]
    assert (b, s, v) == (n, max(lengths), VOCAB)
    assert (one, total, v2) == (1, sum(lengths), VOCAB)
    tol = 1e-5 * single["scale"]
    assert single["packed_vs_padded"] <= tol
    assert single["packed4_vs_padded"] <= tol  # padding inside packed segments does not leak


def test_build_gpt_builds_the_layer_spec_it_is_given(single):
    assert single["default_spec_core_attention"] == "PackedDotProductAttention"  # no TE here: the local spec
    assert single["explicit_spec_core_attention"] == "DotProductAttention"


def test_forward_logits_with_snapshot_params_equals_module_call(single):
    assert single["snapshot_names"]
    assert single["snapshot_equal"]


def test_forward_logits_functional_params_really_swap(single):
    scale = single["scale"]
    assert single["scaled_vs_module"] <= 1e-5 * scale
    assert single["scaled_vs_base"] > 1e-2 * scale  # the swap changed the result
    assert single["scaled_grads_nonzero"]  # autograd reaches the given tensors ...
    assert single["own_grads_none"]  # ... and not the module's own parameters
    assert single["own_untouched"]  # values and _version of the module's parameters unchanged
    assert single["partial_vs_base"] > 1e-2 * scale
    assert single["partial_vs_half"] <= 1e-5 * scale


def test_forward_logits_through_ddp(single):
    assert single["ddp_scaled_vs_module"] <= 1e-5 * single["scale"]
    assert single["ddp_plain_vs_base"] <= 1e-6 * single["scale"]


def test_bf16_model_returns_bf16_logits(single):
    assert single["bf16_wrapper"] == "Float16Module"
    assert single["bf16_param_dtype"] == {torch.bfloat16}
    assert single["bf16_dtype"] == (torch.bfloat16, torch.bfloat16)
    assert single["bf16_params_equal"]
    # same weights (rounded to bf16): close to the fp32 logits
    assert single["bf16_vs_fp32"] <= 0.05 * single["scale"]


# ---------------------------------------------------------------------------------------------
# layout_invariant_init: the documented distribution
# ---------------------------------------------------------------------------------------------
def test_gather_full_weights_returns_copies(single):
    assert single["gather_is_copy"]


def test_layout_invariant_init_statistics(single):
    init = single["init"]
    assert "output_layer.weight" not in init  # tied embeddings: one tensor
    out_proj = STD / math.sqrt(2.0 * LAYERS)
    seen = set()
    for name, w in init.items():
        last = name.split(".")[-2] if name.endswith(".weight") else ""
        if "norm" in last or name.endswith("layer_norm_weight"):
            assert torch.equal(w, torch.ones_like(w)), name
            seen.add("norm")
        else:
            expected = out_proj if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else STD
            assert abs(float(w.mean())) < 4 * expected / math.sqrt(w.numel()), name
            assert abs(float(w.std()) / expected - 1) < 0.15, f"{name}: std {float(w.std()):.4f} vs {expected:.4f}"
            seen.add("proj" if expected == out_proj else "matrix")
    assert seen == {"norm", "proj", "matrix"}
    # distinct tensors get distinct draws
    flat = [w.flatten()[:8] for n, w in sorted(init.items()) if "norm" not in n]
    assert len({tuple(f.tolist()) for f in flat}) == len(flat)


# ---------------------------------------------------------------------------------------------
# two ranks
# ---------------------------------------------------------------------------------------------
def test_layout_invariant_init_same_full_weights(single, sharded):
    name, results = sharded
    for r in results:
        assert set(r["init"]) == set(single["init"]), name
        for k, w in single["init"].items():
            assert torch.equal(r["init"][k], w), f"{name}: {k}"


def test_load_then_gather_round_trips(single, sharded):
    name, results = sharded
    assert single["roundtrip_1"]
    for r in results:
        assert r["roundtrip_names"] and r["roundtrip_equal"], f"{name} rank {r['rank']}"
    if name == "pp2":  # each stage holds its own layers
        assert any(n.startswith("decoder.layers.") for n in results[0]["local_names"])
        assert "embedding.word_embeddings.weight" in results[0]["local_names"]
        assert "output_layer.weight" in results[1]["local_names"]


def test_loaded_shards_give_single_process_logits(single, sharded):
    name, results = sharded
    ref = single["full_logits"]
    if name == "tp2":  # each TP rank holds a contiguous half of the vocabulary
        got = torch.cat([results[0]["logits"], results[1]["logits"]], dim=-1)
    else:  # the last stage has the logits
        assert results[0]["logits"] is None
        got = results[1]["logits"]
    assert got.shape == ref.shape
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), name


def test_load_refuses_missing_or_misshaped_tensor_and_loads_nothing(single, sharded):
    # the misshaped tensor has 2 extra rows: under TP=2 the uneven split still gives rank 1 a
    # shard of the right shape, so the full shape itself must be checked
    name, results = sharded
    # every rank raises the same error (the first failing rank's verdict), naming a tensor
    assert len({r["missing_msg"] for r in results}) == 1 and len({r["wrong_msg"] for r in results}) == 1, name
    targets = {r["target"]: r for r in results}
    for r in results:
        what = f"{name} rank {r['rank']}"
        assert r["missing_msg"].startswith("load_full_weights: argument 'full' expected "), what
        assert any(repr(t) in r["missing_msg"] for t in targets) and "no such tensor" in r["missing_msg"], what
        assert r["missing_unchanged"], what
        t = next(t for t in targets if f"full[{t!r}]" in r["wrong_msg"])
        assert r["wrong_msg"].startswith(f"load_full_weights: argument 'full[{t!r}]' expected shape"), what
        assert f"shape {tuple(single['full'][t].shape)}" in r["wrong_msg"], what
        assert f"received {(single['full'][t].shape[0] + 2, single['full'][t].shape[1])}" in r["wrong_msg"], what
        assert r["wrong_unchanged"], what


def test_load_strict_refuses_unknown_tensor(sharded):
    name, results = sharded
    for r in results:
        assert "decoder.layers.7.mlp.linear_fc9.weight" in r["extra_msg"], f"{name}: {r['extra_msg']}"
        assert r["extra_unchanged"]


def test_grad_clipping_norm_without_syncs_matches_float64():
    """The replacement of Megatron's per-tensor-sync grad-norm fallback: the same global L2 norm."""
    from fnppo.megatron.patches import l2_norm_without_syncs as _l2_norm_without_syncs

    g = torch.Generator().manual_seed(0)
    groups = [[torch.randn(5, 3, generator=g), torch.randn(7, generator=g)], [torch.randn(2, 2, 2, generator=g)]]
    norm, none = _l2_norm_without_syncs(2048 * 32, torch.zeros(1, dtype=torch.int), groups, False)
    ref = math.sqrt(sum(float(t.double().square().sum()) for grp in groups for t in grp))
    assert none is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert abs(float(norm) - ref) < 1e-6 * ref


def test_transformer_config_refuses_recompute_modules_that_need_transformer_engine(monkeypatch):
    # Megatron 0.16's output-discarding checkpoint ("layernorm", "moe_act") imports Transformer Engine
    # at the first forward whatever the precision: refused when the config is built, not mid-step.
    import fnppo.megatron.megatron_config

    monkeypatch.setattr(fnppo.megatron.megatron_config, "te_available", lambda: False)
    with pytest.raises(InputError) as info:
        transformer_config(
            _cfg(), _fake_layout(), recompute_granularity="selective", recompute_modules=["mlp", "layernorm"]
        )
    check_message(
        info.value,
        InputError,
        "transformer_config",
        "recompute_modules",
        "modules that run without Transformer Engine",
        "['mlp', 'layernorm']",
    )
    ok = transformer_config(
        _cfg(), _fake_layout(), recompute_granularity="selective", recompute_modules=["mlp", "core_attn"]
    )
    assert ok.recompute_modules == ["mlp", "core_attn"]
    monkeypatch.setattr(fnppo.megatron.megatron_config, "te_available", lambda: True)  # with TE Megatron runs them
    assert transformer_config(
        _cfg(), _fake_layout(), recompute_granularity="selective", recompute_modules=["layernorm"]
    ).recompute_modules == ["layernorm"]


# ---------------------------------------------------------------------------------------------
# Every ModelConfig field reaches the Megatron model it builds (no setting silently dropped)
# ---------------------------------------------------------------------------------------------
MOE = dict(num_experts=4, moe_topk=2, moe_ffn_hidden_size=48, moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.05)


def _layer0(core):
    return core.decoder.layers[0]


def _router(core, layer: int = 0):
    return core.decoder.layers[layer].mlp.router


def _norm_class(core) -> str:
    norm = core.decoder.final_layernorm
    return type(getattr(norm, "norm", norm)).__name__


def _inv_freq(core):
    return core.rotary_pos_emb.inv_freq.double()


def _rope_reference(base: float, dim: int, scaling_factor: float | None = None) -> torch.Tensor:
    """RoPE frequencies ``base^(-2i/dim)``; with ``scaling_factor``, Llama 3.1's rule (original context
    8192, low/high frequency factors 1/4): wavelengths below 2048 kept, above 8192 divided by the
    factor, linear in ``8192 / wavelength`` between."""
    f = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if scaling_factor is None:
        return f
    out = []
    for x in f.tolist():
        wavelen = 2 * math.pi / x
        if wavelen < 2048:
            out.append(x)
        elif wavelen > 8192:
            out.append(x / scaling_factor)
        else:
            s = (8192 / wavelen - 1) / 3
            out.append((1 - s) * x / scaling_factor + s * x)
    return torch.tensor(out, dtype=torch.float64)


# field: (ModelConfig keywords (the field set away from its default, plus what it needs),
#         read-back from (tcfg: the built TransformerConfig, core: the unwrapped GPTModel, chunk: as built),
#         expected read-back). Every field of ModelConfig has a row (test_every_model_config_field_has_a_row).
SETTINGS = {
    "num_layers": (dict(num_layers=3), lambda t, c, k: (t.num_layers, len(c.decoder.layers)), (3, 3)),
    "hidden_size": (
        dict(hidden_size=48),
        lambda t, c, k: (t.hidden_size, c.embedding.word_embeddings.weight.shape[1]),
        (48, 48),
    ),
    "num_attention_heads": (
        dict(num_attention_heads=8),
        lambda t, c, k: (t.num_attention_heads, t.kv_channels),
        (8, 4),
    ),
    "ffn_hidden_size": (
        dict(ffn_hidden_size=80),
        lambda t, c, k: (t.ffn_hidden_size, _layer0(c).mlp.linear_fc2.weight.shape[1]),
        (80, 80),
    ),
    "vocab_size": (
        dict(vocab_size=50),
        lambda t, c, k: (c.vocab_size, c.embedding.word_embeddings.weight.shape[0]),
        (50, 50),
    ),
    "max_seq_len": (dict(max_seq_len=48), lambda t, c, k: c.max_sequence_length, 48),
    # q: 4 heads x 8, k and v: 4 groups x 8 each
    "num_query_groups": (
        dict(num_query_groups=4),
        lambda t, c, k: (t.num_query_groups, _layer0(c).self_attention.linear_qkv.weight.shape[0]),
        (4, 96),
    ),
    "kv_channels": (
        dict(kv_channels=16),
        lambda t, c, k: (t.kv_channels, _layer0(c).self_attention.linear_proj.weight.shape[1]),
        (16, 64),
    ),
    # expected: ("LayerNorm", the final norm's class), checked in the test
    "normalization": (dict(normalization="LayerNorm"), lambda t, c, k: (t.normalization, _norm_class(c)), None),
    "layernorm_epsilon": (dict(layernorm_epsilon=1e-3), lambda t, c, k: t.layernorm_epsilon, 1e-3),
    "swiglu": (
        dict(swiglu=False),
        lambda t, c, k: (
            t.gated_linear_unit,
            t.activation_func is torch.nn.functional.gelu,
            _layer0(c).mlp.linear_fc1.weight.shape[0],
        ),
        (False, True, 64),
    ),
    "add_bias_linear": (
        dict(add_bias_linear=True),
        lambda t, c, k: (t.add_bias_linear, _layer0(c).mlp.linear_fc2.bias is not None),
        (True, True),
    ),
    "add_qkv_bias": (
        dict(add_qkv_bias=True),
        lambda t, c, k: (t.add_qkv_bias, _layer0(c).self_attention.linear_qkv.bias is not None),
        (True, True),
    ),
    "qk_layernorm": (
        dict(qk_layernorm=True),
        lambda t, c, k: (t.qk_layernorm, _layer0(c).self_attention.q_layernorm is not None),
        (True, True),
    ),
    "position_embedding_type": (
        dict(position_embedding_type="learned_absolute"),
        lambda t, c, k: (c.position_embedding_type, hasattr(c.embedding, "position_embeddings")),
        ("learned_absolute", True),
    ),
    "rotary_base": (dict(rotary_base=500000.0), lambda t, c, k: _inv_freq(c), _rope_reference(500000.0, 8)),
    "rotary_percent": (dict(rotary_percent=0.5), lambda t, c, k: _inv_freq(c), _rope_reference(10000.0, 4)),
    "rope_scaling": (
        dict(rope_scaling=True, rotary_base=1e6),
        lambda t, c, k: _inv_freq(c),
        _rope_reference(1e6, 8, 8.0),
    ),
    "rope_scaling_factor": (
        dict(rope_scaling=True, rope_scaling_factor=2.0, rotary_base=1e6),
        lambda t, c, k: _inv_freq(c),
        _rope_reference(1e6, 8, 2.0),
    ),
    "tie_embeddings": (
        dict(tie_embeddings=False),
        lambda t, c, k: (c.share_embeddings_and_output_weights, c.output_layer.weight is not None),
        (False, True),
    ),
    "init_method_std": (dict(init_method_std=0.5), lambda t, c, k: t.init_method_std, 0.5),
    "dtype": (
        dict(dtype="bf16"),
        lambda t, c, k: (t.params_dtype, t.bf16, type(k).__name__, c.embedding.word_embeddings.weight.dtype),
        (torch.bfloat16, True, "Float16Module", torch.bfloat16),
    ),
    "attention_dropout": (
        dict(attention_dropout=0.25),
        lambda t, c, k: (t.attention_dropout, _layer0(c).self_attention.core_attention.attention_dropout.p),
        (0.25, 0.25),
    ),
    "hidden_dropout": (
        dict(hidden_dropout=0.25),
        lambda t, c, k: (t.hidden_dropout, _layer0(c).hidden_dropout),
        (0.25, 0.25),
    ),
    "make_vocab_size_divisible_by": (
        dict(make_vocab_size_divisible_by=48),
        lambda t, c, k: (c.vocab_size, c.embedding.word_embeddings.weight.shape[0]),
        (96, 96),
    ),
    # no token dropping: Megatron's capacity factor stays None
    "num_experts": (
        dict(MOE),
        lambda t, c, k: (t.num_moe_experts, len(_layer0(c).mlp.experts.local_experts), t.moe_expert_capacity_factor),
        (4, 4, None),
    ),
    "moe_topk": (dict(MOE, moe_topk=3), lambda t, c, k: (t.moe_router_topk, _router(c).topk), (3, 3)),
    "moe_ffn_hidden_size": (
        dict(MOE, moe_ffn_hidden_size=24),
        lambda t, c, k: (t.moe_ffn_hidden_size, _layer0(c).mlp.experts.local_experts[0].linear_fc2.weight.shape[1]),
        (24, 24),
    ),
    "moe_shared_expert_size": (
        dict(MOE, moe_shared_expert_size=16),
        lambda t, c, k: (
            t.moe_shared_expert_intermediate_size,
            _layer0(c).mlp.shared_experts.linear_fc2.weight.shape[1],
        ),
        (16, 16),
    ),
    "moe_shared_expert_gate": (
        dict(MOE, moe_shared_expert_size=16, moe_shared_expert_gate=True),
        lambda t, c, k: (t.moe_shared_expert_gate, _layer0(c).mlp.shared_experts.gate_weight is not None),
        (True, True),
    ),
    "moe_layer_freq": (
        dict(MOE, moe_layer_freq=(0, 1)),
        lambda t, c, k: (t.moe_layer_freq, [hasattr(layer.mlp, "router") for layer in c.decoder.layers]),
        ([0, 1], [False, True]),
    ),
    "moe_pre_softmax": (dict(MOE, moe_pre_softmax=True), lambda t, c, k: t.moe_router_pre_softmax, True),
    "moe_load_balancing": (
        dict(MOE, moe_load_balancing="seq_aux_loss"),
        lambda t, c, k: t.moe_router_load_balancing_type,
        "seq_aux_loss",
    ),
    "moe_aux_loss_coeff": (dict(MOE, moe_aux_loss_coeff=0.25), lambda t, c, k: t.moe_aux_loss_coeff, 0.25),
    "moe_z_loss_coeff": (dict(MOE, moe_z_loss_coeff=0.125), lambda t, c, k: t.moe_z_loss_coeff, 0.125),
    "moe_score_function": (
        dict(MOE, moe_score_function="sigmoid"),
        lambda t, c, k: (t.moe_router_score_function, _router(c).score_function),
        ("sigmoid", "sigmoid"),
    ),
    "moe_router_dtype": (dict(MOE, moe_router_dtype="fp64"), lambda t, c, k: t.moe_router_dtype, "fp64"),
    "moe_expert_bias": (
        dict(MOE, moe_expert_bias=True, moe_score_function="sigmoid"),
        lambda t, c, k: (t.moe_router_enable_expert_bias, _router(c).expert_bias is not None),
        (True, True),
    ),
    "moe_bias_update_rate": (
        dict(MOE, moe_expert_bias=True, moe_score_function="sigmoid", moe_bias_update_rate=0.25),
        lambda t, c, k: t.moe_router_bias_update_rate,
        0.25,
    ),
    "moe_freeze_router": (
        dict(MOE, moe_freeze_router=True),
        lambda t, c, k: [_router(c, i).weight.requires_grad for i in range(2)],
        [False, False],
    ),
    "moe_dispatcher": (
        dict(MOE, moe_dispatcher="allgather"),
        lambda t, c, k: (t.moe_token_dispatcher_type, type(_layer0(c).mlp.token_dispatcher).__name__),
        ("allgather", "MoEAllGatherTokenDispatcher"),
    ),
    "moe_experts": (
        dict(MOE, moe_experts="stacked"),
        lambda t, c, k: type(_layer0(c).mlp.experts).__name__,
        "StackedExperts",
    ),
    # translation only (FP8 needs a CUDA GPU and Transformer Engine to build: refused on CPU, tested apart)
    "fp8": (
        dict(fp8="hybrid", dtype="bf16"),
        lambda t, c, k: fp8_fields(c),
        dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_wgrad=True),
    ),
    "fp8_recipe": (
        dict(fp8="e4m3", fp8_recipe="delayed", dtype="bf16"),
        lambda t, c, k: fp8_fields(c)["fp8_recipe"],
        "delayed",
    ),
    "fusions": (
        dict(fusions=True),
        lambda t, c, k: (t.bias_activation_fusion, t.bias_dropout_fusion, t.apply_rope_fusion),
        (True, True, True),
    ),
    "deterministic": (dict(deterministic=True), lambda t, c, k: t.deterministic_mode, True),
    "batch_invariant": (dict(batch_invariant=True), lambda t, c, k: t.batch_invariant_mode, True),
    "extra": (
        dict(extra=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
        lambda t, c, k: (t.recompute_granularity, t.recompute_method, t.recompute_num_layers),
        ("full", "uniform", 1),
    ),
}
CONFIG_ONLY: dict[str, dict] = {}  # field -> the keywords to compare with (a TransformerConfig read-back)
TRANSLATION_ONLY = {
    "fp8": dict(dtype="bf16"),
    "fp8_recipe": dict(fp8="e4m3", dtype="bf16"),
}  # read back from fp8_fields(ModelConfig)


def _read_settings() -> dict:
    """Every row of SETTINGS: the read-back from a model built with that row's config, and from one
    built with the row's config minus the field (the default), to show each row can tell them apart."""
    out = {}
    for name, (kw, read, _) in SETTINGS.items():
        got = []
        without = CONFIG_ONLY.get(name, TRANSLATION_ONLY.get(name, {k: v for k, v in kw.items() if k != name}))
        for keywords in (kw, without if name != "num_experts" else {}):  # num_experts: against a dense model
            try:
                if name in TRANSLATION_ONLY:
                    got.append(read(None, _cfg(**keywords), None))
                    continue
                if name in CONFIG_ONLY:
                    got.append(read(transformer_config(_cfg(**keywords), current_layout()), None, None))
                    continue
                (chunk,) = fnppo.build_gpt(_cfg(**keywords))
                core = unwrap_model(chunk)
                got.append(read(core.config, core, chunk))
            except Exception as err:  # a read-back of a missing module: differs from the expected value
                got.append(f"{type(err).__name__}: {err}")
        out[name] = got
    return out


def test_every_model_config_field_has_a_row():
    assert set(SETTINGS) == {f.name for f in dataclasses.fields(fnppo.ModelConfig)}


@pytest.fixture(scope="module")
def settings_read_back() -> dict:
    return run_ranks(_read_settings, 1)[0]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=0)
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_model_config_field_reaches_megatron(settings_read_back, name):
    """The field's value is in the built Megatron config (and module structure where it is structural),
    and the same read-back of a model built without it differs: a dropped field fails its row."""
    kw, _, expected = SETTINGS[name]
    got, without = settings_read_back[name]
    if name == "normalization":
        expected = ("LayerNorm", got[1])
        assert "LayerNorm" in got[1] and without[0] == "RMSNorm" and "RMSNorm" in without[1], (got, without)
    assert _same(got, expected), f"{name}={kw[name]!r}: read back {got!r}, expected {expected!r}"
    assert not _same(without, expected), f"{name}: a model built without it reads back the same {without!r}"


# ---------------------------------------------------------------------------------------------
# A user's policy loss (any callable, LossConfig(policy=...)) is the loss the step optimizes (not only "it ran")
# ---------------------------------------------------------------------------------------------
def _scaled_sign_loss(k: float):
    """The policy loss ``k * (-logprob * sign(advantage))`` per token: a plain callable, no registration."""

    def loss(x):
        return -k * x.logprobs * torch.sign(x.advantages), {}

    return loss


def _scaled_loss_steps() -> dict:
    """One step per policy loss ``k * (-logprob * sign(advantage))``, k = 0, 1, 2, from the same weights."""
    out = {}
    for k in (0.0, 1.0, 2.0):
        chunks = fnppo.build_gpt(_cfg())
        fnppo.models.layout_invariant_init(chunks, seed=3)
        ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=False)
        opt = fnppo.build_optimizer(ddp, optimizer="sgd", lr=1.0, clip_grad=0.0)
        state = fnppo.TrainState(model=ddp, optimizer=opt)
        cfg = fnppo.StepConfig(loss=LossConfig(policy=_scaled_sign_loss(k)), num_microbatches=2)
        _, out[k] = fnppo.train_step(state, _samples(), cfg)
    return out


def test_callable_policy_loss_is_the_loss_the_step_optimizes():
    m = run_ranks(_scaled_loss_steps, 1)[0]
    assert m[1.0]["grad_norm"] > 1e-6 and m[1.0]["loss"] != 0.0
    assert m[0.0]["grad_norm"] == 0.0 and m[0.0]["loss"] == 0.0  # a zero loss moves nothing: it was used
    assert m[2.0]["grad_norm"] == pytest.approx(2 * m[1.0]["grad_norm"], rel=1e-5)
    assert m[2.0]["loss"] == pytest.approx(2 * m[1.0]["loss"], rel=1e-5)
