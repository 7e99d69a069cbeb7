"""Tests for fnppo.hf: Hugging Face Llama / Qwen2 / Qwen3 checkpoints <-> Megatron GPT models.

Tiny random models are built with ``transformers`` (fp32), saved as safetensors, loaded into
Megatron on CPU under TP=1 (two data-parallel replicas), TP=2 and PP=2, and their logits compared
with ``transformers``' own forward pass on the same tokens. Every layout also exports the model and
the exported tensors must equal the original checkpoint's bit for bit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fnppo.hf import build_gpt_from_hf, export_hf_weights, load_hf_weights, model_config_from_hf
from fnppo.testing import run_ranks
from fnppo.typing import InputError

SEQ = 12
TOL = 1e-4

_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, attention_dropout=0.0,
)
FAMILIES = {
    # untied embeddings, Llama 3.2 style rope scaling (factor 32, not Megatron's default 8)
    "llama": ("LlamaConfig", dict(
        _COMMON, tie_word_embeddings=False, max_position_embeddings=16384,
        rope_theta=500000.0,  # the transformers 4 keys; transformers 5 turns them into rope_parameters
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    )),
    # q/k/v bias, tied embeddings
    "qwen2": ("Qwen2Config", dict(_COMMON, tie_word_embeddings=True, rope_theta=1e6)),
    # q/k RMSNorm, head_dim != hidden / heads, tied embeddings, sharded checkpoint with an index
    "qwen3": ("Qwen3Config", dict(_COMMON, head_dim=32, tie_word_embeddings=True)),
}


def _transformers():
    """Imported here, not at module level: the rank processes import this module and never need it."""
    return pytest.importorskip("transformers")


def _hf_model(family: str, seed: int):
    transformers = _transformers()
    cls_name, kwargs = FAMILIES[family]
    config = getattr(transformers, cls_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger than the default init, so every weight matters in the logits
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model.eval()


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (checkpoint dir, token ids [1, SEQ], reference logits [1, SEQ, vocab])."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, family in enumerate(FAMILIES):
        model = _hf_model(family, seed=10 + i)
        path = root / family
        model.save_pretrained(str(path), max_shard_size="40KB" if family == "qwen3" else "1GB")
        ids = torch.randint(0, _COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(i))
        out[family] = (str(path), ids, _hf_logits(model, ids))
    assert (root / "qwen3" / "model.safetensors.index.json").is_file()
    assert (root / "llama" / "model.safetensors").is_file()
    return out


# ---------------------------------------------------------------------------------------------
# Rank functions (run on gloo ranks with real Megatron on CPU)
# ---------------------------------------------------------------------------------------------
def _megatron_logits(chunks, ids: torch.Tensor):
    """Full-vocabulary logits [1, s, V] on the last pipeline stage (None elsewhere)."""
    import torch.distributed as dist

    from fnppo.model import unwrap_model
    from fnppo.parallel import current_layout

    layout = current_layout()
    core = unwrap_model(chunks[0]).eval()
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        if not layout.is_first_stage:
            hidden = torch.empty(ids.shape[1], 1, core.config.hidden_size)
            dist.recv(hidden, src=dist.get_global_rank(layout.pp_group, layout.pp_rank - 1))
            core.set_input_tensor(hidden)
        out = core(ids, pos, None)
        if not layout.is_last_stage:
            dist.send(out.contiguous(), dst=dist.get_global_rank(layout.pp_group, layout.pp_rank + 1))
            return None
        if layout.tp > 1:
            parts = [torch.empty_like(out) for _ in range(layout.tp)]
            dist.all_gather(parts, out.contiguous(), group=layout.tp_group)
            out = torch.cat(parts, dim=-1)
    return out


def _layout_worker(
    ckpts: dict, export_root: str, *, logprobs: bool = False, pad_vocab: bool = False, bad: dict | None = None
) -> dict:
    """Load every family, return full logits, export; optionally also the other checks below."""
    from fnppo.model import unwrap_model
    from fnppo.parallel import current_layout

    layout = current_layout()
    res: dict = {}
    for family, (path, ids, _) in ckpts.items():
        chunks = build_gpt_from_hf(path, tp=layout.tp, pp=layout.pp, dtype="fp32")
        load_hf_weights(chunks, path)
        if family == "qwen3" and bad is not None:  # bf16 model (Float16Module): the same values, cast
            half = build_gpt_from_hf(path, dtype="bf16")
            load_hf_weights(half, path)
            full = dict(unwrap_model(chunks[0]).named_parameters())
            res["bf16"] = all(
                p.dtype == torch.bfloat16 and torch.equal(p, full[k].to(torch.bfloat16))
                for k, p in unwrap_model(half[0]).named_parameters()
            ) and type(half[0]).__name__ == "Float16Module"
        res[family] = _megatron_logits(chunks, ids)
        export_hf_weights(chunks, f"{export_root}/{family}", hf_config=path)
        if logprobs:
            from fnppo.batch import Sample
            from fnppo.step import compute_logprobs

            (lp,), _ = compute_logprobs(chunks, [Sample(prompt_ids=ids[0, :4], response_ids=ids[0, 4:])])
            res[family + "/logprobs"] = lp
    if pad_vocab:  # vocabulary padded 128 -> 192: zero rows on load, dropped on export
        path, ids, _ = ckpts["qwen2"]
        chunks = build_gpt_from_hf(path, dtype="fp32", make_vocab_size_divisible_by=96)
        load_hf_weights(chunks, path)
        res["qwen2-padded"] = _megatron_logits(chunks, ids)
        export_hf_weights(chunks, f"{export_root}/qwen2-padded", hf_config=path, max_shard_bytes=20_000)
    if bad is not None:
        res["errors"] = _error_checks(ckpts, bad)
    return res


def _error_checks(ckpts: dict, bad: dict) -> dict:
    """Each bad checkpoint is refused with a message naming the tensor, and loads nothing."""
    from fnppo.model import unwrap_model

    path = ckpts["llama"][0]
    chunks = build_gpt_from_hf(path, dtype="fp32")
    before = {k: v.detach().clone() for k, v in unwrap_model(chunks[0]).named_parameters()}
    res: dict = {}
    for case, bad_path in bad.items():
        try:
            load_hf_weights(chunks, bad_path)
            res[case] = ("no error", True)
        except InputError as err:
            params = dict(unwrap_model(chunks[0]).named_parameters())
            res[case] = (str(err), all(torch.equal(before[k], params[k]) for k in before))
    for case, call in (
        ("tp mismatch", lambda: build_gpt_from_hf(path, tp=2)),
        ("export config mismatch", lambda: export_hf_weights(chunks, bad["missing"] + "-export", hf_config=ckpts["qwen2"][0])),
    ):
        try:
            call()
            res[case] = ("no error", True)
        except InputError as err:
            res[case] = (str(err), True)
    return res


# Checkpoints that must be refused: case -> (tensors changed, tensor name the error must give).
_BAD_CASES = {
    "missing": ("drop", "model.layers.1.mlp.up_proj.weight", None),
    "unexpected": ("add", "model.layers.0.self_attn.extra.weight", torch.zeros(2)),
    "shape": ("add", "model.layers.1.self_attn.k_proj.weight", torch.zeros(16, 64)),
    "dtype": ("add", "model.norm.weight", torch.ones(64, dtype=torch.int32)),
}


@pytest.fixture(scope="module")
def tp1_run(checkpoints, tmp_path_factory):
    """One run_ranks call (TP=1, two data-parallel replicas): logits, export and the refusals."""
    root = tmp_path_factory.mktemp("tp1")
    src = Path(checkpoints["llama"][0])
    tensors = load_file(str(src / "model.safetensors"))
    bad = {}
    for case, (op, name, value) in _BAD_CASES.items():
        state = {k: v for k, v in tensors.items() if k != name} if op == "drop" else dict(tensors, **{name: value})
        d = root / "bad" / case
        d.mkdir(parents=True)
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text((src / "config.json").read_text())
        bad[case] = str(d)
    results = run_ranks(_layout_worker, 2, checkpoints, str(root / "export"), bad=bad, tp=1, pp=1)
    return results, root / "export"


# ---------------------------------------------------------------------------------------------
# Logits and export under each layout
# ---------------------------------------------------------------------------------------------
def _assert_close_logits(results: list, world: int, tp: int, pp: int, checkpoints) -> None:
    last = [r for r in results if r["llama"] is not None]
    assert len(last) == world // pp
    for family, (_, ids, ref) in checkpoints.items():
        for res in last:
            got = res[family]
            assert got.shape == ref.shape, (family, got.shape)
            diff = (got - ref).abs().max().item()
            assert diff <= TOL, (family, tp, pp, diff)


def _assert_export_equal(export_root: Path, checkpoints, families=None) -> None:
    for family in families or checkpoints:
        path = checkpoints[family.split("-")[0]][0]
        original = _hf_tensors(Path(path))
        exported = _hf_tensors(export_root / family)
        if FAMILIES[family.split("-")[0]][1]["tie_word_embeddings"]:
            original.pop("lm_head.weight", None)
        assert sorted(exported) == sorted(original), family
        for name, t in original.items():
            assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), (family, name)
        assert json.loads((export_root / family / "config.json").read_text())["model_type"] == family.split("-")[0]


def test_logits_and_export_tp1_dp2(checkpoints, tp1_run):
    results, export_root = tp1_run
    _assert_close_logits(results, 2, 1, 1, checkpoints)
    _assert_export_equal(export_root, checkpoints)


def test_logits_and_export_tp2_padded_vocab(checkpoints, tmp_path):
    results = run_ranks(_layout_worker, 2, checkpoints, str(tmp_path), pad_vocab=True, tp=2, pp=1)
    _assert_close_logits(results, 2, 2, 1, checkpoints)
    _assert_export_equal(tmp_path, checkpoints, [*checkpoints, "qwen2-padded"])
    _, ids, ref = checkpoints["qwen2"]
    for res in results:
        padded = res["qwen2-padded"]
        assert padded.shape == (1, SEQ, 192)
        assert (padded[..., :128] - ref).abs().max().item() <= TOL
        assert torch.equal(padded[..., 128:], torch.zeros(1, SEQ, 64))
    assert (tmp_path / "qwen2-padded" / "model.safetensors.index.json").is_file()
    # The export is a valid transformers checkpoint: same logits as the original model.
    for family in ("qwen3", "qwen2-padded"):
        _, ids, ref = checkpoints[family.split("-")[0]]
        reloaded = _transformers().AutoModelForCausalLM.from_pretrained(str(tmp_path / family)).float()
        assert (_hf_logits(reloaded.eval(), ids) - ref).abs().max().item() <= 1e-5, family


def test_logits_export_and_compute_logprobs_pp2(checkpoints, tmp_path):
    results = run_ranks(_layout_worker, 2, checkpoints, str(tmp_path), logprobs=True, tp=1, pp=2)
    _assert_close_logits(results, 2, 1, 2, checkpoints)
    _assert_export_equal(tmp_path, checkpoints)
    for family, (_, ids, ref) in checkpoints.items():  # log p(ids[t] | ids[<t]) for response tokens t >= 4
        ref_lp = torch.log_softmax(ref[0, 3:-1].double(), -1).gather(-1, ids[0, 4:, None])[:, 0]
        for res in results:
            assert (res[family + "/logprobs"].double() - ref_lp).abs().max().item() <= TOL, family


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------
def test_bad_checkpoints_are_refused_and_load_nothing(tp1_run):
    results, _ = tp1_run
    for res in results:
        errors = res["errors"]
        for case, (_, name, _) in _BAD_CASES.items():
            msg, untouched = errors[case]
            assert "fnppo.hf.load_hf_weights" in msg and name in msg, (case, msg)
            assert untouched, case
        assert "shape (32, 64)" in errors["shape"][0] and "(16, 64)" in errors["shape"][0]
        assert "int32" in errors["dtype"][0].lower() or "I32" in errors["dtype"][0]
        assert "'tp'" in errors["tp mismatch"][0] and "build_gpt_from_hf" in errors["tp mismatch"][0]
        assert "hf_config.tie_word_embeddings" in errors["export config mismatch"][0]
        assert res["bf16"] is True


def _hf_dict(family: str, **changes) -> dict:
    cls_name, kwargs = FAMILIES[family]
    d = getattr(_transformers(), cls_name)(**kwargs).to_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize(
    "changes, needle",
    [
        (dict(model_type="mistral", architectures=["MistralForCausalLM"]), "MistralForCausalLM"),
        (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
        (dict(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), "yarn"),
        (dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=2.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8192)), "low_freq_factor"),
    ],
)
def test_unsupported_configs_are_refused(changes, needle):
    with pytest.raises(InputError, match="model_config_from_hf") as err:
        model_config_from_hf(_hf_dict("llama", **changes))
    assert needle in str(err.value)


def test_sliding_window_is_refused():
    with pytest.raises(InputError, match="use_sliding_window"):
        model_config_from_hf(_hf_dict("qwen2", use_sliding_window=True, sliding_window=16))


def test_model_config_mapping(tmp_path):
    llama = model_config_from_hf(_hf_dict("llama"))
    assert (llama.num_layers, llama.hidden_size, llama.ffn_hidden_size, llama.vocab_size) == (2, 64, 96, 128)
    assert (llama.num_attention_heads, llama.num_query_groups, llama.kv_channels) == (4, 2, 16)
    assert llama.rope_scaling and llama.rope_scaling_factor == 32.0 and llama.rotary_base == 500000.0
    assert not llama.tie_embeddings and not llama.add_qkv_bias and not llama.qk_layernorm
    assert llama.normalization == "RMSNorm" and llama.swiglu and llama.layernorm_epsilon == 1e-5
    qwen2 = model_config_from_hf(_hf_dict("qwen2"))
    assert qwen2.add_qkv_bias and qwen2.tie_embeddings and not qwen2.rope_scaling and qwen2.rotary_base == 1e6
    qwen3 = model_config_from_hf(_hf_dict("qwen3"), dtype="bf16")
    assert qwen3.qk_layernorm and qwen3.kv_channels == 32 and not qwen3.add_qkv_bias and qwen3.dtype == "bf16"
    # transformers 4.x style keys (rope_theta / rope_scaling, torch_dtype), from a config.json path
    old = {k: v for k, v in _hf_dict("llama").items() if k not in ("rope_parameters", "dtype")}
    old.update(rope_theta=5e5, torch_dtype="bfloat16",
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192))
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg = model_config_from_hf(tmp_path)
    assert cfg.rope_scaling and cfg.rope_scaling_factor == 8.0 and cfg.rotary_base == 5e5 and cfg.dtype == "bf16"
    with pytest.raises(InputError, match="overrides"):
        model_config_from_hf(_hf_dict("llama"), no_such_field=1)
    with pytest.raises(InputError, match="config.json"):
        model_config_from_hf(tmp_path / "missing")
    assert math.isclose(model_config_from_hf(_hf_dict("qwen2"), layernorm_epsilon=1e-3).layernorm_epsilon, 1e-3)
