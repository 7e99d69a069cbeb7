"""Tests for fnppo.io.hf: Hugging Face Llama / Qwen2 / Qwen3 / Mistral (and Qwen2-MoE / Qwen3-MoE / Mixtral)
checkpoints <-> Megatron GPT models.

Tiny random models are built with ``transformers`` (fp32), saved as safetensors, loaded into
Megatron on CPU under TP=1 (two data-parallel replicas), TP=2 and PP=2 (MoE: also EP=2), and their
logits compared with ``transformers``' own forward pass on the same tokens. Every layout also
exports the model and the exported tensors must equal the original checkpoint's bit for bit.
Value models (the critic) do the same in the same launches with a ``Qwen2ForTokenClassification``
and a ``LlamaForSequenceClassification`` (``num_labels=1``): their values against transformers'
per-token scores, their export against the checkpoint, and a moved critic exported and reloaded;
a ``Qwen2MoeForTokenClassification`` critic the same way in the MoE launches, under EP=2, PP=2,
TP=2 (expert TP 2) and one model per rank. Critics saved by TRL, OpenRLHF and verl (each built as that stack writes it) load in the TP=1 and
PP=2 launches, their values against the stack's own computation.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fnppo.core.errors import CheckpointError, InputError
from fnppo.io.hf import build_gpt_from_hf, export_hf_weights, load_hf_weights, model_config_from_hf
from fnppo.testing import run_ranks
from tests.messages import check_message, raises_message

SEQ = 12
TOL = 1e-4

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    attention_dropout=0.0,
)
FAMILIES = {
    # untied embeddings, Llama 3.2 style rope scaling (factor 32, not Megatron's default 8)
    "llama": (
        "LlamaConfig",
        dict(
            _COMMON,
            tie_word_embeddings=False,
            max_position_embeddings=16384,
            rope_theta=500000.0,  # the transformers 4 keys; transformers 5 turns them into rope_parameters
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
    ),
    # q/k/v bias, tied embeddings
    "qwen2": ("Qwen2Config", dict(_COMMON, tie_word_embeddings=True, rope_theta=1e6)),
    # q/k RMSNorm, head_dim != hidden / heads, tied embeddings, sharded checkpoint with an index
    "qwen3": ("Qwen3Config", dict(_COMMON, head_dim=32, tie_word_embeddings=True)),
    # Llama's layout under its own names and config keys: head_dim != hidden / heads, sliding_window off
    # (MistralConfig's default is 4096), untied
    "mistral": ("MistralConfig", dict(_COMMON, head_dim=24, sliding_window=None, tie_word_embeddings=False)),
}


def _transformers():
    """Imported here, not at module level: the rank processes import this module and never need it."""
    return pytest.importorskip("transformers")


def _hf_model(family: str, seed: int, model_class="AutoModelForCausalLM", **config_changes):
    transformers = _transformers()
    cls_name, kwargs = FAMILIES[family]
    config = getattr(transformers, cls_name)(**kwargs, **config_changes)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    cls = getattr(transformers, model_class) if isinstance(model_class, str) else model_class
    model = (cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)).float()
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

    from fnppo.megatron.parallel import current_layout
    from fnppo.megatron.unwrap import unwrap_model

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
    ckpts: dict,
    export_root: str,
    *,
    logprobs: bool = False,
    pad_vocab: bool = False,
    bad: dict | None = None,
    values: dict | None = None,
    value_bad: dict | None = None,
    foreign: dict | None = None,
) -> dict:
    """Load every family, return full logits, export; optionally also the other checks below."""
    from fnppo.megatron.parallel import current_layout
    from fnppo.megatron.unwrap import unwrap_model

    layout = current_layout()
    res: dict = {}
    for family, (path, ids, _) in ckpts.items():
        chunks = build_gpt_from_hf(path, tp=layout.tp, pp=layout.pp, dtype="fp32")
        load_hf_weights(chunks, path)
        if family == "qwen3" and bad is not None:  # bf16 model (Float16Module): the same values, cast
            half = build_gpt_from_hf(path, dtype="bf16")
            load_hf_weights(half, path)
            full = dict(unwrap_model(chunks[0]).named_parameters())
            res["bf16"] = (
                all(
                    p.dtype == torch.bfloat16 and torch.equal(p, full[k].to(torch.bfloat16))
                    for k, p in unwrap_model(half[0]).named_parameters()
                )
                and type(half[0]).__name__ == "Float16Module"
            )
        res[family] = _megatron_logits(chunks, ids)
        export_hf_weights(chunks, f"{export_root}/{family}", hf_config=path)
        if logprobs:
            from fnppo.core.batching.sample import Sample
            from fnppo.steps.infer import compute_logprobs

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
    if values is not None:
        res["values"] = _value_worker(values, export_root)
    if value_bad is not None:
        res["value_errors"] = _value_error_checks(values, ckpts, value_bad)
    if foreign is not None:
        res["foreign"] = _foreign_worker(*foreign)
    return res


def _refused_load(chunks, path) -> tuple[str, bool]:
    """``(message, the model untouched)`` of ``load_hf_weights(chunks, path)`` (``"no error"`` if it loads)."""
    from fnppo.megatron.unwrap import unwrap_model

    before = {k: v.detach().clone() for k, v in unwrap_model(chunks[0]).named_parameters()}
    try:
        load_hf_weights(chunks, path)
        return "no error", True
    except InputError as err:
        now = dict(unwrap_model(chunks[0]).named_parameters())
        return str(err), all(torch.equal(before[k], now[k]) for k in before)


def _refused_call(call) -> tuple[str, bool]:
    """``(message, True)`` of a call that must raise ``InputError`` (``"no error"`` if it does not)."""
    try:
        call()
        return "no error", True
    except InputError as err:
        return str(err), True


def _error_checks(ckpts: dict, bad: dict) -> dict:
    """Each bad checkpoint is refused with a message naming the tensor, and loads nothing."""
    path = ckpts["llama"][0]
    chunks = build_gpt_from_hf(path, dtype="fp32")
    res = {case: _refused_load(chunks, bad_path) for case, bad_path in bad.items()}
    res["tp mismatch"] = _refused_call(lambda: build_gpt_from_hf(path, tp=2))
    res["export config mismatch"] = _refused_call(
        lambda: export_hf_weights(chunks, bad["missing"] + "-export", hf_config=ckpts["qwen2"][0])
    )
    nope = dict(json.loads((Path(path) / "config.json").read_text()), no_rope_layers=[1, 0])  # SmolLM3's NoPE
    res["export config refused key"] = _refused_call(
        lambda: export_hf_weights(chunks, bad["missing"] + "-export-nope", hf_config=nope)
    )
    res["export config refused key wrote"] = Path(bad["missing"] + "-export-nope").exists()
    return res


# Checkpoints that must be refused: case -> (tensors changed, tensor name the error must give).
_BAD_CASES = {
    "missing": ("drop", "model.layers.1.mlp.up_proj.weight", None),
    "unexpected": ("add", "model.layers.0.self_attn.extra.weight", torch.zeros(2)),
    "shape": ("add", "model.layers.1.self_attn.k_proj.weight", torch.zeros(16, 64)),
    "dtype": ("add", "model.norm.weight", torch.ones(64, dtype=torch.int32)),
}


@pytest.fixture(scope="module")
def tp1_run(checkpoints, value_checkpoints, foreign_critics, tmp_path_factory):
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
    value_bad = _bad_value_checkpoints(value_checkpoints, root / "bad-value")
    results = run_ranks(
        _layout_worker,
        2,
        checkpoints,
        str(root / "export"),
        bad=bad,
        values=value_checkpoints,
        value_bad=value_bad,
        foreign=foreign_critics,
        tp=1,
        pp=1,
    )
    return results, root / "export"


# ---------------------------------------------------------------------------------------------
# Logits and export under each layout
# ---------------------------------------------------------------------------------------------
def _assert_close_logits(results: list, world: int, tp: int, pp: int, checkpoints) -> None:
    last = [r for r in results if r["llama"] is not None]
    assert len(last) == world // pp
    for family, (_, ids, ref) in checkpoints.items():  # noqa: B007 - the ids are not needed here
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


@pytest.fixture(scope="module")
def tp2_run(checkpoints, value_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2")
    return run_ranks(
        _layout_worker, 2, checkpoints, str(root), pad_vocab=True, values=value_checkpoints, tp=2, pp=1
    ), root


@pytest.fixture(scope="module")
def pp2_run(checkpoints, value_checkpoints, foreign_critics, tmp_path_factory):
    root = tmp_path_factory.mktemp("pp2")
    foreign = (foreign_critics[0], {})  # the heads on the last stage; the refusals run under TP=1
    return run_ranks(
        _layout_worker, 2, checkpoints, str(root), logprobs=True, values=value_checkpoints, foreign=foreign, tp=1, pp=2
    ), root


def test_logits_and_export_tp2_padded_vocab(checkpoints, tp2_run):
    results, tmp_path = tp2_run
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


def test_logits_export_and_compute_logprobs_pp2(checkpoints, pp2_run):
    results, tmp_path = pp2_run
    _assert_close_logits(results, 2, 1, 2, checkpoints)
    _assert_export_equal(tmp_path, checkpoints)
    for family, (_, ids, ref) in checkpoints.items():  # log p(ids[t] | ids[<t]) for response tokens t >= 4
        ref_lp = torch.log_softmax(ref[0, 3:-1].double(), -1).gather(-1, ids[0, 4:, None])[:, 0]
        for res in results:
            assert (res[family + "/logprobs"].double() - ref_lp).abs().max().item() <= TOL, family


# ---------------------------------------------------------------------------------------------
# Value models: a token classifier and a sequence classifier (num_labels=1) in, a token classifier out
# ---------------------------------------------------------------------------------------------
VALUE_CHECKPOINTS = {  # name: (family, transformers class, the class export writes)
    "qwen2-token": (
        "qwen2",
        "Qwen2ForTokenClassification",
        "Qwen2ForTokenClassification",
    ),  # tied, q/k/v bias, score.bias
    "llama-sequence": (
        "llama",
        "LlamaForSequenceClassification",
        "LlamaForTokenClassification",
    ),  # llama3 rope, no score.bias
}


@pytest.fixture(scope="module")
def value_checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, token ids [1, SEQ], transformers' per-token score [SEQ] in float64)."""
    root = tmp_path_factory.mktemp("hf-value")
    out = {}
    for i, (name, (family, cls_name, _)) in enumerate(VALUE_CHECKPOINTS.items()):
        model = _hf_model(family, seed=40 + i, model_class=cls_name, num_labels=1)
        with torch.no_grad():
            if model.score.bias is not None:
                model.score.bias.fill_(0.5)  # far from the zero a dropped bias would leave
            ids = torch.randint(0, _COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(50 + i))
            if cls_name.endswith("TokenClassification"):
                ref = model(input_ids=ids).logits[0, :, 0]
            else:  # the score of every position; transformers' reward is the last one's
                ref = model.score(model.model(input_ids=ids).last_hidden_state)[0, :, 0]
                assert torch.allclose(model(input_ids=ids).logits[0, 0], ref[-1], rtol=0, atol=1e-6)
        model.save_pretrained(str(root / name))
        out[name] = (str(root / name), ids, ref.double())
    assert "score.bias" in _hf_tensors(root / "qwen2-token") and "score.bias" not in _hf_tensors(
        root / "llama-sequence"
    )
    return out


def _move(chunks) -> None:
    """A trained critic: every parameter moved by noise seeded by its local name (so the TP ranks that
    replicate a parameter move it alike)."""
    import zlib

    from fnppo.megatron.unwrap import unwrap_model

    for chunk in chunks:
        with torch.no_grad():
            for name, p in unwrap_model(chunk).named_parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))))


def _value_worker(ckpts: dict, export_root: str) -> dict:
    """Per value checkpoint: what the loader skipped, compute_values of one sample (prompt: the first
    token), an export; then every parameter moved, exported, reloaded into a new value model."""
    from fnppo.core.batching.sample import Sample
    from fnppo.megatron.unwrap import unwrap_model
    from fnppo.steps.infer import compute_values

    out = {}
    for name, (path, ids, _) in ckpts.items():
        sample = [Sample(prompt_ids=ids[0, :1], response_ids=ids[0, 1:])]  # values of positions 0 .. SEQ-2
        chunks = build_gpt_from_hf(path, head="value", dtype="fp32")
        skipped = load_hf_weights(chunks, path)
        (values,) = compute_values(chunks, sample)
        export_hf_weights(chunks, f"{export_root}/{name}", hf_config=path)
        _move(chunks)
        (moved,) = compute_values(chunks, sample)
        export_hf_weights(chunks, f"{export_root}/{name}-moved", hf_config=path)
        again = build_gpt_from_hf(f"{export_root}/{name}-moved", head="value", dtype="fp32")
        skipped_again = load_hf_weights(again, f"{export_root}/{name}-moved")
        (reloaded,) = compute_values(again, sample)
        mine, theirs = (dict(unwrap_model(c[0]).named_parameters()) for c in (chunks, again))
        out[name] = {
            "skipped": skipped,
            "skipped_again": skipped_again,
            "values": values,
            "moved": moved,
            "reloaded": reloaded,
            "params": sorted(mine),
            "differ": sorted(k for k in mine if not torch.equal(mine[k], theirs[k])),
        }
    return out


def _assert_values_and_value_export(
    results: list, value_checkpoints, export_root: Path, classes: dict | None = None
) -> None:
    """Every rank's values equal transformers' scores; the exports equal the checkpoints; a moved
    critic reloads bit for bit. ``classes``: name -> the class export writes (default: VALUE_CHECKPOINTS')."""
    classes = classes or {name: v[2] for name, v in VALUE_CHECKPOINTS.items()}
    for res in results:
        for name, (_, _, ref) in value_checkpoints.items():
            r = res["values"][name]
            assert r["skipped"] == [] and r["skipped_again"] == [], (name, r["skipped"], r["skipped_again"])
            assert r["values"].shape == (SEQ - 1,), name
            diff = (r["values"].double() - ref[:-1]).abs().max().item()
            assert diff <= TOL, (name, diff)
            assert (r["moved"] - r["values"]).abs().max().item() > 100 * TOL, name  # the critic really moved
            assert r["differ"] == [] and torch.equal(r["reloaded"], r["moved"]), (name, r["differ"])
    for name, (path, _, _) in value_checkpoints.items():
        original, exported = _hf_tensors(Path(path)), _hf_tensors(export_root / name)
        if "score.bias" not in original:  # a sequence classifier has none: the head's bias, zero, is written
            assert torch.equal(exported.pop("score.bias"), torch.zeros(1)), name
        assert sorted(exported) == sorted(original), name
        for key, t in original.items():
            assert exported[key].dtype == t.dtype and torch.equal(exported[key], t), (name, key)
        for d in (name, name + "-moved"):
            cfg = json.loads((export_root / d / "config.json").read_text())
            assert cfg["architectures"] == [classes[name]] and cfg["num_labels"] == 1, (d, cfg)
            assert cfg["id2label"] == {"0": "LABEL_0"} and cfg["token_classification_bias"] is True, (d, cfg)


def test_value_models_load_and_export_tp1_dp2(value_checkpoints, tp1_run):
    results, export_root = tp1_run
    _assert_values_and_value_export(results, value_checkpoints, export_root)


def test_value_models_load_and_export_tp2_and_transformers_reads_the_export(value_checkpoints, tp2_run):
    results, root = tp2_run
    _assert_values_and_value_export(results, value_checkpoints, root)
    # the moved critic's export is a transformers token classifier whose logits[..., 0] are fnppo's values
    transformers = _transformers()
    for name, (_, ids, _) in value_checkpoints.items():
        hf = transformers.AutoModelForTokenClassification.from_pretrained(
            str(root / f"{name}-moved"), dtype=torch.float32
        ).eval()
        assert type(hf).__name__ == VALUE_CHECKPOINTS[name][2] and hf.config.num_labels == 1
        with torch.no_grad():
            scores = hf(input_ids=ids).logits[0, :-1, 0].double()
        for res in results:
            assert (res["values"][name]["moved"].double() - scores).abs().max().item() <= TOL, name


def test_value_models_load_and_export_pp2(value_checkpoints, pp2_run):
    results, root = pp2_run
    _assert_values_and_value_export(results, value_checkpoints, root)
    assert ["value_head.weight" in r["values"]["qwen2-token"]["params"] for r in results] == [False, True]


# ---------------------------------------------------------------------------------------------
# Critics saved by other RL stacks (each built here as that stack writes it; sources in the comments)
# ---------------------------------------------------------------------------------------------
def _openrlhf_class(family: str, cls_name: str, prefix: str):
    """OpenRLHF's critic / reward model class for a family: ``get_llm_for_sequence_regression`` in
    openrlhf/models/model.py (OpenRLHF/OpenRLHF) subclasses the family's ``PreTrainedModel``, puts
    the trunk at ``base_model_prefix`` (``model``) and ``nn.Linear(hidden, 1, bias=False)`` at
    ``value_head_prefix``; ``save_pretrained`` names the class in ``architectures``."""
    transformers = _transformers()
    base = getattr(transformers, {"llama": "LlamaModel", "qwen2": "Qwen2Model"}[family])
    parent = base.__base__

    def __init__(self, config):
        parent.__init__(self, config)
        setattr(self, self.base_model_prefix, base(config))
        setattr(self, prefix, torch.nn.Linear(config.hidden_size, 1, bias=False))
        self.post_init()

    return type(cls_name, (parent,), {"__init__": __init__})


# name -> (family, what fnppo must skip); values: the source's own computation on the last hidden state
FOREIGN_CRITICS = {
    # TRL's AutoModelForCausalLMWithValueHead (trl/experimental/ppo/modeling_value_head.py, also verl's
    # FSDP critic when built from it): save_pretrained of the causal LM with a state dict holding its
    # own tensors plus v_head.summary.{weight,bias}; values = v_head.summary(hidden_states[-1])
    "trl-v-head": ("llama", ["lm_head.weight"]),
    # OpenRLHF's CriticModel, value_head_prefix 'score' (the default) saved in config.json with
    # normalize_reward and the reward model's mean/std (openrlhf/cli/train_rm.py, trainer/rm_trainer.py):
    # values = (score(h) - mean) / std
    "openrlhf-critic": ("llama", []),
    # OpenRLHF's RewardModel of the older default prefix 'value_head', not named in config.json;
    # normalize_reward false: mean/std stored but not applied
    "openrlhf-reward": ("qwen2", []),
    # verl's Megatron critic (verl/models/mcore/saver.py, utils/checkpoint/megatron_checkpoint_manager.py):
    # the [1, hidden] output layer saved as lm_head.weight into the policy's LlamaForCausalLM config
    "verl-megatron": ("llama", []),
}
_MEAN, _STD = 0.3, 2.5


@pytest.fixture(scope="module")
def foreign_critics(tmp_path_factory):
    """(name -> (checkpoint dir, token ids, the source's values [SEQ] in float64), refused variants)."""
    root = tmp_path_factory.mktemp("hf-foreign")
    g = torch.Generator().manual_seed(70)
    out = {}
    for i, (name, (family, _)) in enumerate(FOREIGN_CRITICS.items()):
        ids = torch.randint(0, _COMMON["vocab_size"], (1, SEQ), generator=g)
        w, b = 0.15 * torch.randn(1, 64, generator=g), torch.full((1,), 0.5)
        with torch.no_grad():
            if name.startswith("openrlhf"):
                prefix = "score" if name == "openrlhf-critic" else "value_head"
                cls = _openrlhf_class(family, "CriticModel" if name == "openrlhf-critic" else "RewardModel", prefix)
                model = _hf_model(family, seed=60 + i, model_class=cls)
                model.config.update(dict(normalize_reward=name == "openrlhf-critic", mean=_MEAN, std=_STD))
                if name == "openrlhf-critic":
                    model.config.value_head_prefix = prefix
                v = getattr(model, prefix)(model.model(input_ids=ids).last_hidden_state)[0, :, 0].double()
                ref = (v - _MEAN) / _STD if name == "openrlhf-critic" else v
                model.save_pretrained(str(root / name))
            else:
                model = _hf_model(family, seed=60 + i, model_class="LlamaForCausalLM")
                state = model.state_dict()
                h = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].double()
                if name == "trl-v-head":
                    state.update({"v_head.summary.weight": w, "v_head.summary.bias": b})
                    ref = (h @ w.double().T + b.double())[:, 0]
                else:
                    state["lm_head.weight"] = w
                    ref = (h @ w.double().T)[:, 0]
                model.save_pretrained(str(root / name), state_dict=state)
        out[name] = (str(root / name), ids, ref)
    cfg = json.loads((root / "openrlhf-critic" / "config.json").read_text())
    assert (
        cfg["architectures"] == ["CriticModel"]
        and cfg["value_head_prefix"] == "score"
        and cfg["normalize_reward"] is True
    )
    assert sorted(k for k in _hf_tensors(root / "openrlhf-reward") if not k.startswith("model.")) == [
        "value_head.weight"
    ]
    assert {"v_head.summary.weight", "v_head.summary.bias", "lm_head.weight"} <= set(_hf_tensors(root / "trl-v-head"))
    assert _hf_tensors(root / "verl-megatron")["lm_head.weight"].shape == (1, 64)
    trl, critic, reward = (out[n][0] for n in ("trl-v-head", "openrlhf-critic", "openrlhf-reward"))
    bad = {
        "both-prefixes": _variant(
            critic,
            root / "bad" / "both-prefixes",
            {"value_head_prefix": _DROP},
            tensors={"value_head.weight": torch.zeros(1, 64)},
        ),
        "std-zero": _variant(critic, root / "bad" / "std-zero", {"std": 0.0}),
        "mean-text": _variant(critic, root / "bad" / "mean-text", {"mean": "0.3"}),
        "prefix-not-a-name": _variant(
            critic, root / "bad" / "prefix-not-a-name", {"value_head_prefix": "score weight"}
        ),
        "prefix-elsewhere": _variant(reward, root / "bad" / "prefix-elsewhere", {"value_head_prefix": "score"}),
        "v-head-and-verl": _variant(
            trl, root / "bad" / "v-head-and-verl", tensors={"lm_head.weight": torch.zeros(1, 64)}
        ),
        "v-head-two-rows": _variant(
            trl, root / "bad" / "v-head-two-rows", tensors={"v_head.summary.weight": torch.zeros(2, 64)}
        ),
        "v-head-no-bias": _variant(trl, root / "bad" / "v-head-no-bias", drop=("v_head.summary.bias",)),
    }
    return out, bad


def _foreign_worker(critics: dict, bad: dict) -> dict:
    """Per foreign critic: what the loader skipped and compute_values of one sample; each bad variant's refusal."""
    from fnppo.core.batching.sample import Sample
    from fnppo.megatron.parallel import current_layout
    from fnppo.steps.infer import compute_values

    out = {}
    for name, (path, ids, _) in critics.items():
        chunks = build_gpt_from_hf(path, head="value", dtype="fp32")
        skipped = load_hf_weights(chunks, path)
        (values,) = compute_values(chunks, [Sample(prompt_ids=ids[0, :1], response_ids=ids[0, 1:])])
        out[name] = (skipped, values)
        if name == "openrlhf-critic":  # out as a token classifier, the normalisation in its head
            layout = current_layout()
            export_hf_weights(chunks, f"{path}-export-pp{layout.pp}", hf_config=path)
    for case, path in bad.items():
        src = critics[
            "trl-v-head"
            if case.startswith("v-head")
            else "openrlhf-reward"
            if case == "prefix-elsewhere"
            else "openrlhf-critic"
        ][0]
        out[case] = _refused_load(build_gpt_from_hf(src, head="value", dtype="fp32"), path)
    return out


def _assert_foreign_values(results: list, critics: dict) -> None:
    for res in results:
        for name, (_, _, ref) in critics.items():
            skipped, values = res["foreign"][name]
            assert skipped == FOREIGN_CRITICS[name][1], (name, skipped)
            diff = (values.double() - ref[:-1]).abs().max().item()
            assert values.shape == (SEQ - 1,) and diff <= TOL, (name, diff)


_FOREIGN_ERRORS = {  # case -> (argument, expected, received)
    "both-prefixes": (
        "config.json['value_head_prefix']",
        "the name of OpenRLHF's value head (its --value_head_prefix: 'score' or 'value_head')",
        "no such key, and both of them stored",
    ),
    "std-zero": ("config.json['std']", "a finite number > 0 (OpenRLHF's reward std: normalize_reward is true)", "0.0"),
    "mean-text": ("config.json['mean']", "a finite number (OpenRLHF's reward mean: normalize_reward is true)", "'0.3'"),
    "prefix-not-a-name": (
        "config.json['value_head_prefix']",
        "a module name such as 'score' or 'value_head'",
        "'score weight'",
    ),
    "prefix-elsewhere": ("path", "a tensor named 'score.weight'", "a checkpoint without it"),
    "v-head-and-verl": (
        "path",
        "one value head (one of: 'score.weight', 'value_head.weight', 'v_head.summary.weight', 'lm_head.weight')",
        "a checkpoint with 'v_head.summary.weight' and 'lm_head.weight'",
    ),
    "v-head-two-rows": (
        "checkpoint['v_head.summary.weight']",
        "shape (1, 64) (num_labels=1: one value per token)",
        "shape (2, 64)",
    ),
    "v-head-no-bias": ("path", "a tensor named 'v_head.summary.bias'", "a checkpoint without it"),
}


def test_critics_of_other_rl_stacks_load_dp2_and_pp2(foreign_critics, tp1_run, pp2_run):
    """TRL's v_head, OpenRLHF's critic (its reward normalisation folded into the head) and reward
    model, verl's Megatron critic: values equal each stack's own computation, under DP=2 and PP=2;
    the ambiguous or inconsistent ones are refused by name and load nothing."""
    critics, _ = foreign_critics
    _assert_foreign_values(tp1_run[0], critics)
    _assert_foreign_values(pp2_run[0], critics)
    path, ids, ref = critics["openrlhf-critic"]
    transformers = _transformers()
    for pp in (1, 2):  # transformers reads the export: OpenRLHF's normalised values, no OpenRLHF keys left
        export = f"{path}-export-pp{pp}"
        cfg = json.loads(Path(export, "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForTokenClassification"] and not {
            "normalize_reward",
            "mean",
            "std",
            "value_head_prefix",
        } & set(cfg)
        hf = transformers.AutoModelForTokenClassification.from_pretrained(export, dtype=torch.float32).eval()
        with torch.no_grad():
            assert (hf(input_ids=ids).logits[0, :, 0].double() - ref).abs().max().item() <= TOL, pp
    for res in tp1_run[0]:
        for case, (arg, expected, received) in _FOREIGN_ERRORS.items():
            msg, untouched = res["foreign"][case]
            check_message(InputError(msg), InputError, "load_hf_weights", arg, expected, received)
            assert untouched, case


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------
def test_bad_checkpoints_are_refused_and_load_nothing(tp1_run):
    results, _ = tp1_run
    expected = {  # case -> (argument, expected, received)
        "missing": ("path", "a tensor named 'model.layers.1.mlp.up_proj.weight'", "a checkpoint without it"),
        "unexpected": (
            "path",
            "only the tensors of the model's architecture",
            "an unexpected tensor 'model.layers.0.self_attn.extra.weight' of shape (2,)",
        ),
        "shape": ("checkpoint['model.layers.1.self_attn.k_proj.weight']", "shape (32, 64)", "shape (16, 64)"),
        "dtype": ("checkpoint['model.norm.weight']", "a floating dtype (BF16, F16, F32, F64)", "I32"),
    }
    for res in results:
        errors = res["errors"]
        for case in _BAD_CASES:
            msg, untouched = errors[case]
            check_message(InputError(msg), InputError, "load_hf_weights", *expected[case])
            assert untouched, case
        check_message(
            InputError(errors["tp mismatch"][0]),
            InputError,
            "build_gpt_from_hf",
            "tp",
            "1 (the current Megatron layout; set it with fnppo.init_parallel)",
            "2",
        )
        assert errors["export config mismatch"][0].startswith(
            "fnppo.io.hf.export_hf_weights: argument 'hf_config['model_type']' expected 'llama' (what the model was built "
            "for), received 'qwen2' (in hf_config; also differs: architectures: ['Qwen2ForCausalLM'] (model: "
            "['LlamaForCausalLM'])"
        ), errors["export config mismatch"][0]
        assert "tie_word_embeddings: True (model: False)" in errors["export config mismatch"][0]
        check_message(  # read through the family's allow-list, before anything is written
            InputError(errors["export config refused key"][0]),
            InputError,
            "export_hf_weights",
            "hf_config['no_rope_layers']",
            "None or [1] * 2 (layers without positional encoding (SmolLM3's NoPE)",
            "[1, 0]",
        )
        assert errors["export config refused key wrote"] is False
        assert res["bf16"] is True


def _bad_value_checkpoints(value_checkpoints, root: Path) -> dict:
    """Variants of the Qwen2 token classifier that a value model must refuse (and one a policy must)."""
    path = value_checkpoints["qwen2-token"][0]
    two = {"score.weight": torch.zeros(2, 64), "score.bias": torch.zeros(2)}
    cases = {
        "two-labels": _variant(
            path, root / "two-labels", {"id2label": {"0": "A", "1": "B"}, "label2id": {"A": 0, "B": 1}}, tensors=two
        ),
        "two-labels-no-config": _variant(path, root / "two-labels-no-config", tensors=two),
        "no-bias": _variant(path, root / "no-bias", drop=("score.bias",)),
        "question-answering": _variant(
            path, root / "question-answering", {"architectures": ["Qwen2ForQuestionAnswering"]}
        ),
        "into-a-policy": _variant(path, root / "into-a-policy"),
    }
    for case in ("two-labels-no-config", "into-a-policy"):
        (Path(cases[case]) / "config.json").unlink()
    return cases


def _value_error_checks(values: dict, ckpts: dict, bad: dict) -> dict:
    """case -> (message, the model untouched) for each bad value checkpoint; a classifier's config
    built with the default head."""
    token = values["qwen2-token"][0]
    models = {
        "value": build_gpt_from_hf(token, head="value", dtype="fp32"),
        "policy": build_gpt_from_hf(ckpts["qwen2"][0], dtype="fp32"),
    }
    res = {
        case: _refused_load(models["policy" if case == "into-a-policy" else "value"], path)
        for case, path in bad.items()
    }
    res["default-head"] = _refused_call(lambda: build_gpt_from_hf(token, dtype="fp32"))
    res["export-two-labels"] = _refused_call(
        lambda: export_hf_weights(models["value"], bad["two-labels"] + "-export", hf_config=bad["two-labels"])
    )
    return res


_VALUE_ERRORS = {  # case -> (function, argument, expected, received)
    "two-labels": (
        "load_hf_weights",
        "config.json['id2label']",
        "one entry (num_labels=1: one value per token, the value head; Qwen2ForTokenClassification)",
        "{'0': 'A', '1': 'B'}",
    ),
    "two-labels-no-config": (
        "load_hf_weights",
        "checkpoint['score.weight']",
        "shape (1, 64) (num_labels=1: one value per token)",
        "shape (2, 64)",
    ),
    "no-bias": ("load_hf_weights", "path", "a tensor named 'score.bias'", "a checkpoint without it"),
    "question-answering": (
        "load_hf_weights",
        "config.json['architectures']",
        "['Qwen2ForCausalLM'] (a policy) or ['Qwen2ForTokenClassification'] / ['Qwen2ForSequenceClassification'] "
        "(a value or reward model, num_labels=1) for model_type 'qwen2'",
        "['Qwen2ForQuestionAnswering']",
    ),
    "into-a-policy": (
        "load_hf_weights",
        "path",
        "only the tensors of the model's architecture",
        "an unexpected tensor 'score.bias' of shape (1,) (a value or reward model's head: load it into build_gpt_from_hf(path, head='value'))",
    ),
    "export-two-labels": (
        "export_hf_weights",
        "hf_config['id2label']",
        "one entry (num_labels=1",
        "{'0': 'A', '1': 'B'}",
    ),
    "default-head": (
        "build_gpt_from_hf",
        "head",
        "'value' for a Qwen2ForTokenClassification checkpoint (its score head is a value head; it has no lm_head)",
        "'lm'",
    ),
}


def test_bad_value_checkpoints_are_refused_and_load_nothing(tp1_run):
    results, _ = tp1_run
    for res in results:
        assert set(res["value_errors"]) == set(_VALUE_ERRORS)
        for case, (fn, arg, expected, received) in _VALUE_ERRORS.items():
            msg, untouched = res["value_errors"][case]
            check_message(InputError(msg), InputError, fn, arg, expected, received)
            assert untouched, case


def _hf_dict(family: str, **changes) -> dict:
    cls_name, kwargs = FAMILIES[family]
    d = getattr(_transformers(), cls_name)(**kwargs).to_dict()
    d.update(changes)
    return d


_SUPPORTED = "one of: LlamaForCausalLM (model_type 'llama'), Qwen2ForCausalLM (model_type 'qwen2'), Qwen3ForCausalLM"


@pytest.mark.parametrize(
    "changes, arg, expected, received",
    [
        (
            dict(model_type="gemma", architectures=["GemmaForCausalLM"]),
            "config.model_type",
            _SUPPORTED,
            "model_type='gemma', architectures=['GemmaForCausalLM']",
        ),
        (
            dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
            "config.model_type",
            _SUPPORTED,
            "model_type='gpt2', architectures=['GPT2LMHeadModel']",
        ),
        (
            dict(architectures=["LlamaForQuestionAnswering"]),
            "config.architectures",
            "['LlamaForCausalLM'] (a policy) or ['LlamaForTokenClassification'] / ['LlamaForSequenceClassification'] "
            "(a value or reward model, num_labels=1) for model_type 'llama'",
            "['LlamaForQuestionAnswering']",
        ),
        (
            dict(architectures=["LlamaForTokenClassification"]),
            "config.id2label",
            "one entry (num_labels=1",
            "{0: 'LABEL_0', 1: 'LABEL_1'}",
        ),  # transformers' default: two labels
        (
            dict(architectures=["LlamaForSequenceClassification"], id2label=None, num_labels=3),
            "config.num_labels",
            "1 (num_labels=1",
            "3",
        ),
        (
            dict(architectures=["LlamaForTokenClassification"], id2label=None),
            "config.num_labels",
            "1 (num_labels=1",
            "neither id2label nor num_labels (transformers' default: 2 labels)",
        ),
        (dict(hidden_act="gelu"), "config.hidden_act", "'silu' (SwiGLU)", "'gelu'"),
        (dict(attention_bias=True), "config.attention_bias", "False (o_proj bias without MLP bias", "True"),
        (dict(mlp_bias=True), "config.mlp_bias", "False", "True"),
        (
            dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)),
            "config.rope_parameters",
            "rope_type 'default' or 'llama3' (the RoPE variants Megatron implements)",
            "'yarn'",
        ),
        (
            dict(
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=1e4,
                    factor=8.0,
                    low_freq_factor=2.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=8192,
                )
            ),
            "config.rope_parameters['low_freq_factor']",
            "1 (the llama3 scaling Megatron implements)",
            "2.0",
        ),
    ],
)
def test_unsupported_configs_are_refused(changes, arg, expected, received):
    with raises_message("model_config_from_hf", arg, expected, received):
        model_config_from_hf(_hf_dict("llama", **changes))


def test_sliding_window_is_refused():
    with raises_message(
        "model_config_from_hf", "config.use_sliding_window", "False (sliding-window attention is not supported)", "True"
    ):
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
    old.update(
        rope_theta=5e5,
        torch_dtype="bfloat16",
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg = model_config_from_hf(tmp_path)
    assert cfg.rope_scaling and cfg.rope_scaling_factor == 8.0 and cfg.rotary_base == 5e5 and cfg.dtype == "bf16"
    with raises_message(
        "model_config_from_hf", "overrides", "ModelConfig fields (add_bias_linear, ", "['no_such_field']"
    ):
        model_config_from_hf(_hf_dict("llama"), no_such_field=1)
    with raises_message(
        "model_config_from_hf",
        "config_or_path",
        "a config.json file or a local directory holding one",
        repr(str(tmp_path / "missing")),
    ):
        model_config_from_hf(tmp_path / "missing")
    assert math.isclose(model_config_from_hf(_hf_dict("qwen2"), layernorm_epsilon=1e-3).layernorm_epsilon, 1e-3)
    mistral = model_config_from_hf(_hf_dict("mistral"))
    assert mistral.kv_channels == 24 and not mistral.add_qkv_bias and not mistral.qk_layernorm
    assert not mistral.tie_embeddings and not mistral.rope_scaling


def test_families_are_immutable_records_and_mistral_refuses_its_default_sliding_window():
    import dataclasses

    from fnppo.io.hf.families import FAMILIES as RECORDS

    with pytest.raises(TypeError):
        RECORDS["gemma"] = RECORDS["llama"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        RECORDS["qwen2"].qkv_bias = False  # type: ignore[misc]
    with raises_message("model_config_from_hf", "config.sliding_window", "None", "4096"):
        model_config_from_hf(_hf_dict("mistral", sliding_window=4096))  # MistralConfig's default


# ---------------------------------------------------------------------------------------------
# Padded vocabulary: log-probs and entropies over the real vocabulary (151), as transformers has it
# ---------------------------------------------------------------------------------------------
V151 = 151


@pytest.fixture(scope="module")
def qwen2_v151(tmp_path_factory):
    """A tied Qwen2 checkpoint with vocabulary 151; tokens; fp64 log-probs / entropies of tokens 4..SEQ-1."""
    transformers = _transformers()
    config = transformers.Qwen2Config(**dict(FAMILIES["qwen2"][1], vocab_size=V151))
    config._attn_implementation = "eager"
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
    path = tmp_path_factory.mktemp("v151") / "qwen2"
    model.eval().save_pretrained(str(path))
    ids = torch.randint(0, V151, (1, SEQ), generator=torch.Generator().manual_seed(6))
    ids[0, -1] = V151 - 1  # the last real token
    logp = torch.log_softmax(_hf_logits(model, ids)[0, 3:-1].double(), -1)
    return str(path), ids, logp.gather(-1, ids[0, 4:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _padded_vocab_worker(path: str, ids: torch.Tensor) -> dict:
    from fnppo.core.batching.sample import Sample
    from fnppo.steps.infer import compute_logprobs

    out = {}
    for divisible in (1, 2, 128):
        try:
            chunks = build_gpt_from_hf(path, dtype="fp32", make_vocab_size_divisible_by=divisible)
        except InputError as err:
            out[divisible] = str(err)
            continue
        load_hf_weights(chunks, path)
        (lp,), (ent,) = compute_logprobs(
            chunks, [Sample(prompt_ids=ids[0, :4], response_ids=ids[0, 4:])], with_entropy=True
        )
        out[divisible] = (lp, ent)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_padded_vocab_logprobs_and_entropy_match_transformers(qwen2_v151, tp):
    path, ids, ref_lp, ref_ent = qwen2_v151
    for res in run_ranks(_padded_vocab_worker, tp, path, ids, tp=tp):
        for divisible in (1, 2, 128):
            if tp == 2 and divisible == 1:  # 151 rows cannot be split over 2 ranks without padding
                assert res[1].startswith("transformer_config: argument 'vocab_size' expected a multiple of tp=2"), res[
                    1
                ]
                continue
            lp, ent = res[divisible]
            assert (lp.double() - ref_lp).abs().max().item() <= 1e-5, (tp, divisible, "logprobs")
            assert (ent.double() - ref_ent).abs().max().item() <= 1e-5, (tp, divisible, "entropy")


# ---------------------------------------------------------------------------------------------
# A tied checkpoint that also stores a different lm_head.weight; the checkpoint's own config.json
# ---------------------------------------------------------------------------------------------
def _variant(src: str, dst: Path, config_changes: dict | None = None, tensors: dict | None = None, drop=()) -> str:
    """A copy of checkpoint ``src`` with changed config.json entries and/or tensors."""
    dst.mkdir(parents=True)
    cfg = json.loads((Path(src) / "config.json").read_text())
    for key, value in (config_changes or {}).items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    state = {k: v for k, v in _hf_tensors(Path(src)).items() if k not in drop}
    state.update(tensors or {})
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


_DROP = object()


def _load_cases(model_path: str, cases: dict, ids: torch.Tensor, build_from: dict | None = None) -> dict:
    """case -> error message (and whether the model stayed untouched), or the loaded model's logits."""
    from fnppo.megatron.unwrap import unwrap_model

    out = {}
    for case, path in cases.items():
        chunks = build_gpt_from_hf((build_from or {}).get(case, model_path), dtype="fp32")
        before = {k: v.detach().clone() for k, v in unwrap_model(chunks[0]).named_parameters()}
        try:
            load_hf_weights(chunks, path)
        except (InputError, CheckpointError) as err:
            now = dict(unwrap_model(chunks[0]).named_parameters())
            kind = "CheckpointError: " if isinstance(err, CheckpointError) else ""
            out[case] = (kind + str(err), all(torch.equal(before[k], now[k]) for k in before))
            continue
        out[case] = _megatron_logits(chunks, ids)
    return out


def test_tied_checkpoint_with_a_different_lm_head(checkpoints, tmp_path):
    path, ids, ref = checkpoints["qwen2"]  # tied; the checkpoint stores no lm_head.weight
    emb = _hf_tensors(Path(path))["model.embed_tokens.weight"]
    other = emb + 0.5 * torch.randn(emb.shape, generator=torch.Generator().manual_seed(0))
    different = _variant(path, tmp_path / "different", tensors={"lm_head.weight": other})
    same = _variant(path, tmp_path / "same", tensors={"lm_head.weight": emb.clone()})
    untied = _variant(path, tmp_path / "untied", {"tie_word_embeddings": False}, tensors={"lm_head.weight": other})
    res = run_ranks(
        _load_cases,
        1,
        path,
        {"different": different, "same": same, "untied": untied},
        ids,
        build_from={"untied": untied},
    )[0]
    msg, untouched = res["different"]
    assert msg.startswith("fnppo.io.hf.load_hf_weights: argument 'checkpoint['lm_head.weight']' expected "), msg
    for part in (
        "equal to 'model.embed_tokens.weight'",
        "tie_word_embeddings",
        "set tie_word_embeddings to false",
        "delete 'lm_head.weight'",
        "received a different tensor (max |difference|",
    ):
        assert part in msg, (part, msg)
    assert untouched
    # the same values stored twice: loads, tied, transformers' logits
    assert (res["same"] - ref).abs().max().item() <= TOL
    # the first remedy: an untied model gets what transformers computes from the original checkpoint
    transformers = _transformers()
    hf = transformers.AutoModelForCausalLM.from_pretrained(different).float().eval()
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()  # transformers unties
    hf_logits = _hf_logits(hf, ids)
    assert (hf_logits - ref).abs().max().item() > 1.0  # the two heads really differ
    assert (res["untied"] - hf_logits).abs().max().item() <= TOL


def _rope5(family: str) -> dict:
    """The transformers-5 ``rope_parameters`` of a family's checkpoint config."""
    return dict(json.loads((Path(_CKPT_CACHE[family]) / "config.json").read_text())["rope_parameters"])


_CKPT_CACHE: dict = {}

# case -> (config.json changes, the key the error must name, the model's value, the file's value)
_CONFIG_CASES = {
    "mistral-sliding-window": (
        dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4),
        "['model_type']",
        "'llama'",
        "'mistral'",
    ),
    "qwen2-family": (
        dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
        "['model_type']",
        "'llama'",
        "'qwen2'",
    ),
    "architectures": (
        dict(architectures=["LlamaForSequenceClassification"]),
        "['architectures']",
        "['LlamaForCausalLM']",
        "['LlamaForSequenceClassification']",
    ),
    "rope-theta-v5": ("rope_theta=1e4", "['rope_parameters']['rope_theta']", "500000.0", "10000.0"),
    "rope-factor-v5": ("factor=16.0", "['rope_parameters']['factor']", "32.0", "16.0"),
    "rope-type-v5": ("rope_type=default", "['rope_parameters']['rope_type']", "'llama3'", "'default'"),
    "rope-theta-v4": (
        dict(
            rope_parameters=_DROP,
            rope_theta=1e4,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
        "['rope_theta']",
        "500000.0",
        "10000.0",
    ),
    "rope-factor-v4": (
        dict(
            rope_parameters=_DROP,
            rope_theta=5e5,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
        "['rope_scaling']['factor']",
        "32.0",
        "8.0",
    ),
    "rms-norm-eps": (dict(rms_norm_eps=1e-6), "['rms_norm_eps']", "1e-05", "1e-06"),
    "tie": (dict(tie_word_embeddings=True), "['tie_word_embeddings']", "False", "True"),
    "head-dim": (dict(head_dim=32), "['head_dim']", "16", "32"),
    "vocab": (dict(vocab_size=100), "['vocab_size']", "128", "100"),
}


# case -> (config.json changes, the key the allow-list names, expected, received): keys the model's
# family does not read as written (tests/test_hf_config_keys.py has them all, through model_config_from_hf)
_ALLOW_LIST_CASES = {
    "no-rope-layers": (dict(no_rope_layers=[1, 0]), "no_rope_layers", "None or [1] * 2", "[1, 0]"),
    "tie-string": (dict(tie_word_embeddings="false"), "tie_word_embeddings", "a bool (JSON true or false)", "'false'"),
    "max-positions-zero": (dict(max_position_embeddings=0), "max_position_embeddings", "an int >= 1", "0"),
    "rope-interleave": (dict(rope_interleave=True), "rope_interleave", "False (interleaved RoPE", "True"),
    "unknown-key": (dict(attention_chunk_size=8192), "attention_chunk_size", "no such key: model_type 'llama'", "8192"),
    "attention-bias": (dict(attention_bias=True), "attention_bias", "False (o_proj bias", "True"),
    "mlp-bias": (dict(mlp_bias=True), "mlp_bias", "False (a bias on the MLP", "True"),
    "hidden-act": (dict(hidden_act="gelu"), "hidden_act", "'silu' (SwiGLU) for model_type 'llama'", "'gelu'"),
    "partial-rotary": (
        dict(partial_rotary_factor=0.5),
        "partial_rotary_factor",
        "1.0 (RoPE on part of each head",
        "0.5",
    ),
    "layer-types": (
        dict(layer_types=["sliding_attention", "full_attention"]),
        "layer_types",
        "None or ['full_attention'] * 2",
        "['sliding_attention', 'full_attention']",
    ),
}


def test_checkpoint_config_must_match_the_model(checkpoints, tmp_path):
    path, ids, ref = checkpoints["llama"]
    _CKPT_CACHE["llama"] = path
    cases = {}
    for case, (changes, *_rest) in _CONFIG_CASES.items():
        if isinstance(changes, str):  # one entry of rope_parameters changed
            key, value = changes.split("=")
            rope = _rope5("llama")
            rope[key] = value if key == "rope_type" else float(value)
            if value == "default":
                rope = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
            changes = {"rope_parameters": rope}
        cases[case] = _variant(path, tmp_path / case, changes)
    cases["unchanged"] = _variant(path, tmp_path / "unchanged")
    for case, (changes, *_rest) in _ALLOW_LIST_CASES.items():
        cases[case] = _variant(path, tmp_path / case, changes)
    cases["corrupt"] = _variant(path, tmp_path / "corrupt")
    text = (Path(cases["corrupt"]) / "config.json").read_text()
    (Path(cases["corrupt"]) / "config.json").write_text(text[: len(text) // 2])  # a write cut short
    res = run_ranks(_load_cases, 1, path, cases, ids)[0]
    assert (res.pop("unchanged") - ref).abs().max().item() <= TOL
    for case, (_, key, want, have) in _ALLOW_LIST_CASES.items():  # the file read through the allow-list
        msg, untouched = res[case]
        check_message(InputError(msg), InputError, "load_hf_weights", f"config.json[{key!r}]", want, have)
        assert untouched, case
    msg, untouched = res["corrupt"]
    assert msg.startswith("CheckpointError: ") and untouched, msg
    check_message(
        InputError(msg[17:]),
        InputError,
        "load_hf_weights",
        "path",
        "a JSON object in config.json",
        f"{cases['corrupt']}/config.json', which is not valid JSON (truncated or corrupt: ",
    )
    for case, (_, key, want, have) in _CONFIG_CASES.items():
        msg, untouched = res[case]
        head = f"fnppo.io.hf.load_hf_weights: argument 'config.json{key}' expected {want} (what the model was built for"
        assert msg.startswith(head), (case, msg)
        assert f", received {have} (in {cases[case]}/config.json" in msg, (case, msg)
        assert untouched, case
    # every difference is listed, not only the first
    assert "sliding_window: 4 (model: None)" in res["mistral-sliding-window"][0]
    assert "architectures: ['MistralForCausalLM'] (model: ['LlamaForCausalLM'])" in res["mistral-sliding-window"][0]


def test_qwen2_sliding_window_checkpoint_is_refused_by_the_loader(checkpoints, tmp_path):
    path, ids, _ = checkpoints["qwen2"]
    bad = _variant(path, tmp_path / "sw", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0))
    msg, untouched = run_ranks(_load_cases, 1, path, {"sw": bad}, ids)[0]["sw"]
    assert msg.startswith(  # read through the family's allow-list before it is compared with the model
        "fnppo.io.hf.load_hf_weights: argument 'config.json['use_sliding_window']' expected False "
        "(sliding-window attention is not supported) for model_type 'qwen2', received True"
    ), msg
    assert untouched


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_rope_errors_name_the_key_the_file_uses(key):
    rope = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    d = {k: v for k, v in _hf_dict("llama").items() if k not in ("rope_parameters", "rope_scaling")}
    d[key] = dict(rope, rope_theta=1e4) if key == "rope_parameters" else rope
    with pytest.raises(InputError) as err:
        model_config_from_hf(d)
    assert str(err.value).startswith(
        f"fnppo.io.hf.model_config_from_hf: argument 'config.{key}['low_freq_factor']' "
        "expected 1 (the llama3 scaling Megatron implements) for model_type 'llama', received 2.0"
    ), str(err.value)


# ---------------------------------------------------------------------------------------------
# Mixture of Experts: Qwen3-MoE (a dense first layer, renormalized top-k), Qwen2-MoE (shared
# expert with a sigmoid gate, top-k not renormalized, q/k/v bias), Mixtral (block_sparse_moe names)
# ---------------------------------------------------------------------------------------------
_MOE = dict(num_experts_per_tok=2)
MOE_FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            _COMMON,
            **_MOE,
            head_dim=32,
            num_local_experts=4,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            tie_word_embeddings=False,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            _COMMON,
            **_MOE,
            num_experts=4,
            moe_intermediate_size=48,
            norm_topk_prob=False,
            shared_expert_intermediate_size=80,
            tie_word_embeddings=True,
            rope_theta=1e6,
        ),
    ),
    "mixtral": ("MixtralConfig", dict(_COMMON, **_MOE, num_local_experts=4, tie_word_embeddings=False)),
}
# (name, tp, pp, ep) of each layout; one run_ranks call (2 ranks) re-initializes the layouts in turn
# (a name ending in "-stacked": the model's experts are fnppo's StackedExperts, moe_experts="stacked")
MOE_RUNS = {
    "ep2-pp2": [("ep2", 1, 1, 2), ("pp2", 1, 2, 1), ("ep2-stacked", 1, 1, 2)],
    "tp2-dp2": [("tp2", 2, 1, 1), ("tp1", 1, 1, 1), ("tp2-stacked", 2, 1, 1)],  # tp2: expert TP 2 as well
}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """family -> (checkpoint dir, token ids [1, SEQ], transformers' logits)."""
    transformers = _transformers()
    root = tmp_path_factory.mktemp("hf-moe")
    out = {}
    for i, (family, (cls_name, kwargs)) in enumerate(MOE_FAMILIES.items()):
        config = getattr(transformers, cls_name)(**kwargs)
        config._attn_implementation = "eager"
        torch.manual_seed(20 + i)
        model = transformers.AutoModelForCausalLM.from_config(config).float()
        g = torch.Generator().manual_seed(20 + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
        path = root / family
        model.eval().save_pretrained(str(path))
        ids = torch.randint(0, _COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(30 + i))
        out[family] = (str(path), ids, _hf_logits(model, ids))
    return out


MOE_VALUE = "qwen2_moe-token"  # the MoE critic: a Qwen2-MoE token classifier (shared expert, q/k/v bias, score.bias)
MOE_VALUE_LAYOUTS = (
    "ep2",
    "tp1",
    "pp2",
    "tp2",
)  # the layouts that also load, run, export and reload it (tp2: expert TP 2)


@pytest.fixture(scope="module")
def moe_value_checkpoint(tmp_path_factory):
    """{MOE_VALUE: (checkpoint dir, token ids [1, SEQ], transformers' logits[0, :, 0] in float64)}."""
    transformers = _transformers()
    cls_name, kwargs = MOE_FAMILIES["qwen2_moe"]
    config = getattr(transformers, cls_name)(**kwargs, num_labels=1)
    config._attn_implementation = "eager"
    torch.manual_seed(60)
    model = transformers.Qwen2MoeForTokenClassification(config).float()
    g = torch.Generator().manual_seed(60)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
        model.score.bias.fill_(0.5)  # far from the zero a dropped bias would leave
        ids = torch.randint(0, _COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(61))
        ref = model.eval()(input_ids=ids).logits[0, :, 0].double()
    path = tmp_path_factory.mktemp("hf-moe-value") / MOE_VALUE
    model.save_pretrained(str(path))
    tensors = _hf_tensors(path)
    assert (
        "score.bias" in tensors
        and "model.layers.1.mlp.shared_expert_gate.weight" in tensors
        and "lm_head.weight" not in tensors
    )
    return {MOE_VALUE: (str(path), ids, ref)}


def _moe_worker(ckpts: dict, export_root: str, layouts: list, value: dict | None = None) -> dict:
    """Per layout and family: full logits on the last stage, and an export; in MOE_VALUE_LAYOUTS
    also the MoE critic's checks of _value_worker."""
    import fnppo

    res: dict = {}
    for name, tp, pp, ep in layouts:
        layout = fnppo.init_parallel(tp=tp, pp=pp, ep=ep, device="cpu")
        for family, (path, ids, _) in ckpts.items():
            experts = "stacked" if name.endswith("-stacked") else None
            chunks = build_gpt_from_hf(path, dtype="fp32", moe_experts=experts)
            if experts:
                assert any(type(m).__name__ == "StackedExperts" for m in chunks[0].modules())
            load_hf_weights(chunks, path)
            res[(name, family)] = _megatron_logits(chunks, ids)
            export_hf_weights(chunks, f"{export_root}/{name}/{family}", hf_config=path)
        if value is not None and name in MOE_VALUE_LAYOUTS:
            res[(name, "values")] = _value_worker(value, f"{export_root}/{name}")
        if name == "tp1":
            res["errors"] = _moe_errors(ckpts, export_root)
        res[(name, "layout")] = (layout.tp, layout.pp, layout.ep, layout.etp)
    return res


def _moe_errors(ckpts: dict, root: str) -> dict:
    """A model the families cannot hold is refused by export; a checkpoint whose config.json
    renormalizes differently is refused by the loader."""
    import fnppo

    path = ckpts["qwen3_moe"][0]
    out = {}
    sigmoid = fnppo.build_gpt(fnppo.io.hf.model_config_from_hf(path, moe_score_function="sigmoid"))
    chunks = build_gpt_from_hf(path, dtype="fp32")
    rank = fnppo.parallel.current_layout().rank
    flipped = _variant(path, Path(root) / f"flipped-{rank}", {"norm_topk_prob": False})
    shared = build_gpt_from_hf(ckpts["qwen2_moe"][0], dtype="fp32")
    wider = _variant(ckpts["qwen2_moe"][0], Path(root) / f"shared-{rank}", {"shared_expert_intermediate_size": 96})
    for case, call in (
        ("sigmoid", lambda: export_hf_weights(sigmoid, f"{root}/never")),
        ("norm_topk_prob", lambda: load_hf_weights(chunks, flipped)),
        ("shared_expert", lambda: load_hf_weights(shared, wider)),
    ):
        try:
            call()
            out[case] = "no error"
        except InputError as err:
            out[case] = str(err)
    return out


@pytest.fixture(scope="module")
def moe_runs(moe_checkpoints, moe_value_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-export")
    return {
        run: run_ranks(_moe_worker, 2, moe_checkpoints, str(root / run), layouts, value=moe_value_checkpoint)
        for run, layouts in MOE_RUNS.items()
    }, root


@pytest.mark.parametrize("run", list(MOE_RUNS))
def test_moe_logits_match_transformers_and_export_is_the_checkpoint(moe_checkpoints, moe_runs, run):
    results, root = moe_runs
    for name, tp, pp, ep in MOE_RUNS[run]:
        assert results[run][0][(name, "layout")] == (tp, pp, ep, tp)
        last = [r[(name, family)] for r in results[run] for family in MOE_FAMILIES if r[(name, family)] is not None]
        assert len(last) == len(MOE_FAMILIES) * 2 // pp
        for family, (path, _, ref) in moe_checkpoints.items():
            for r in results[run]:
                got = r[(name, family)]
                if got is not None:
                    assert got.shape == ref.shape and (got - ref).abs().max().item() <= TOL, (name, family)
            original, exported = _hf_tensors(Path(path)), _hf_tensors(root / run / name / family)
            if MOE_FAMILIES[family][1]["tie_word_embeddings"]:
                original.pop("lm_head.weight", None)
            assert sorted(exported) == sorted(original), (name, family)
            for key, t in original.items():
                assert torch.equal(exported[key], t), (name, family, key)


def test_moe_export_loads_in_transformers(moe_checkpoints, moe_runs):
    _, root = moe_runs
    for family, (_, ids, ref) in moe_checkpoints.items():
        reloaded = (
            _transformers().AutoModelForCausalLM.from_pretrained(str(root / "ep2-pp2" / "ep2" / family)).float().eval()
        )
        assert (_hf_logits(reloaded, ids) - ref).abs().max().item() <= 1e-5, family


def test_moe_value_model_loads_and_exports_under_ep2_pp2_tp2_and_one_model_per_rank(moe_value_checkpoint, moe_runs):
    """A Qwen2-MoE token classifier (num_labels=1) as a value model under EP=2 (two experts per rank),
    PP=2 (the value head on the last stage), TP=2 (expert TP 2) and one model per rank: compute_values equals transformers' logits[..., 0] on every rank, nothing
    is skipped, the export is the checkpoint bit for bit, a moved critic reloads bit for bit, and
    transformers reads the moved export with the same values."""
    results, root = moe_runs
    ((path, ids, _),) = moe_value_checkpoint.values()
    transformers = _transformers()
    for layout in MOE_VALUE_LAYOUTS:
        run = next(run for run, layouts in MOE_RUNS.items() if layout in [entry[0] for entry in layouts])
        ranks = [{"values": r[(layout, "values")]} for r in results[run]]
        assert len(ranks) == 2
        _assert_values_and_value_export(
            ranks, moe_value_checkpoint, root / run / layout, {MOE_VALUE: "Qwen2MoeForTokenClassification"}
        )
        hf = transformers.AutoModelForTokenClassification.from_pretrained(
            str(root / run / layout / f"{MOE_VALUE}-moved"), dtype=torch.float32
        )
        assert type(hf).__name__ == "Qwen2MoeForTokenClassification" and hf.config.num_labels == 1
        with torch.no_grad():
            scores = hf.eval()(input_ids=ids).logits[0, :-1, 0].double()
        for r in ranks:
            assert (r["values"][MOE_VALUE]["moved"].double() - scores).abs().max().item() <= TOL, layout
            local = {
                n.split("local_experts.")[1].split(".")[0]
                for n in r["values"][MOE_VALUE]["params"]
                if "local_experts." in n
            }
            assert local == ({"0", "1"} if layout == "ep2" else {"0", "1", "2", "3"}), (
                layout,
                local,
            )  # EP=2: 2 of 4 experts a rank


def test_moe_config_mapping():
    qwen3 = model_config_from_hf(_moe_dict("qwen3_moe"))
    assert (qwen3.num_experts, qwen3.moe_topk, qwen3.moe_ffn_hidden_size, qwen3.ffn_hidden_size) == (4, 2, 48, 96)
    assert (
        qwen3.moe_layer_freq == (0, 1)
        and qwen3.qk_layernorm
        and not qwen3.moe_pre_softmax
        and qwen3.moe_router_dtype is None
    )
    qwen2 = model_config_from_hf(_moe_dict("qwen2_moe"))
    assert (
        qwen2.moe_pre_softmax
        and qwen2.moe_shared_expert_size == 80
        and qwen2.moe_shared_expert_gate
        and qwen2.add_qkv_bias
    )
    assert qwen2.moe_layer_freq == 1 and not model_config_from_hf(_moe_dict("qwen2_moe", qkv_bias=False)).add_qkv_bias
    assert model_config_from_hf(_moe_dict("qwen2_moe", decoder_sparse_step=2)).moe_layer_freq == (0, 1)
    mixtral = model_config_from_hf(_moe_dict("mixtral"))
    assert (mixtral.num_experts, mixtral.moe_ffn_hidden_size, mixtral.moe_layer_freq, mixtral.moe_pre_softmax) == (
        4,
        96,
        1,
        False,
    )
    assert mixtral.moe_shared_expert_size is None and mixtral.moe_load_balancing == "none"


def _moe_dict(family: str, **changes) -> dict:
    cls_name, kwargs = MOE_FAMILIES[family]
    d = getattr(_transformers(), cls_name)(**kwargs).to_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize(
    "family, changes, arg, expected, received",
    [
        (
            "mixtral",
            dict(router_jitter_noise=0.1),
            "config.router_jitter_noise",
            "0 (Megatron's input jitter scales the router's input only)",
            "0.1",
        ),
        (
            "mixtral",
            dict(sliding_window=8),
            "config.sliding_window",
            "None (sliding-window attention is not supported)",
            "8",
        ),
        ("qwen3_moe", dict(mlp_only_layers=[0, 1]), "config.mlp_only_layers", "at least one MoE layer", "[0, 1]"),
        ("qwen2_moe", dict(num_experts_per_tok=None), "config.num_experts_per_tok", "an int >= 1", "None"),
    ],
)
def test_unsupported_moe_configs_are_refused(family, changes, arg, expected, received):
    with raises_message("model_config_from_hf", arg, expected, received):
        model_config_from_hf(_moe_dict(family, **changes))


def test_moe_models_the_families_cannot_hold_are_refused(moe_runs):
    results, _ = moe_runs
    for r in results["tp2-dp2"]:
        errors = r["errors"]
        check_message(
            InputError(errors["sigmoid"]),
            InputError,
            "export_hf_weights",
            "model_chunks[0].config.moe_router_score_function",
            "'softmax' (Llama/Qwen/Mixtral layout)",
            "'sigmoid'",
        )
        assert errors["norm_topk_prob"].startswith(
            "fnppo.io.hf.load_hf_weights: argument 'config.json['norm_topk_prob']' expected True (what the model was built for), received False"
        ), errors["norm_topk_prob"]
        assert errors["shared_expert"].startswith(
            "fnppo.io.hf.load_hf_weights: argument 'config.json['shared_expert_intermediate_size']' expected 80"
        ), errors["shared_expert"]


@pytest.mark.parametrize(
    "qk, bias, shared, moe_layers, family",
    [
        (False, False, 0, (), "llama"),  # Llama before Mistral: the same layout
        (False, True, 0, (), "qwen2"),
        (True, False, 0, (), "qwen3"),
        (False, False, 0, (0, 1), "mixtral"),  # the family with the fewest options first
        (False, False, 0, (1,), "qwen2_moe"),  # a dense layer: mlp_only_layers
        (False, False, 32, (0, 1), "qwen2_moe"),  # a shared expert
        (False, True, 0, (0, 1), "qwen2_moe"),  # q/k/v bias switched by qkv_bias
        (True, False, 0, (1,), "qwen3_moe"),
        (True, True, 0, (), None),  # no family has both
        (True, False, 32, (0, 1), None),
    ],
)
def test_the_family_of_a_model_built_without_a_hf_config(qk, bias, shared, moe_layers, family):
    """A model from ``fnppo.build_gpt`` is exported as the first family record that can hold it."""
    from types import SimpleNamespace

    from fnppo.io.hf.arch import _family_of

    c = SimpleNamespace(
        qk_layernorm=qk, add_qkv_bias=bias, moe_shared_expert_intermediate_size=shared or None, num_layers=2
    )
    if family is None:
        with raises_message("model_arch", "model_chunks", "a layout one of the Hugging Face families has", "MoE"):
            _family_of(SimpleNamespace(), c, moe_layers)
    else:
        assert _family_of(SimpleNamespace(), c, moe_layers) == family
