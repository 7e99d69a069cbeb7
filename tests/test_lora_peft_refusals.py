"""Bad PEFT adapter files are refused by name before anything changes.

A tiny Mixtral (``tests/test_hf.py``'s config) gets a ``peft`` adapter in PEFT's fused expert form
(``tests/test_lora_peft_experts.py``'s config: per-layer ``rank_pattern`` / ``alpha_pattern``,
``target_parameters`` in two spellings). Each case edits a copy of the directory (its
``adapter_config.json`` or ``adapter_model.safetensors``): ``lora_config_from_peft`` refusals run
in this process (it reads files only); ``load_peft_adapter`` refusals run on a model that already
holds the good adapter, which must be unchanged after each refusal (one 1-rank launch).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fnppo
from fnppo.core.errors import CheckpointError, InputError
from fnppo.testing import run_ranks
from tests.test_hf import _COMMON
from tests.test_lora_peft_experts import _base_model, _peft_config

FAMILY = "mixtral"
CFG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
GATE_UP0 = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"  # layer 0: gate_up_proj only
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
GATE_UP1_B = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora-peft-refusals")
    _base_model(FAMILY, seed=5).save_pretrained(str(root / "base"))
    torch.manual_seed(6)
    adapted = peft.get_peft_model(_base_model(FAMILY, seed=5), _peft_config(FAMILY, "fused"))
    adapted.save_pretrained(str(root / "good"))
    return root


def _edited(root: Path, name: str, config: dict | None = None, raw_config: bytes | None = None, tensors=None, raw=None):
    """A copy of the good adapter with its config updated by ``config`` (or replaced by the bytes
    ``raw_config``) and its tensors replaced by ``tensors`` (or the file by the bytes ``raw``)."""
    dst = root / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(root / "good", dst)
    if config is not None:
        cfg = json.loads((dst / CFG).read_text())
        cfg.update(config)
        (dst / CFG).write_text(json.dumps(cfg))
    if raw_config is not None:
        (dst / CFG).write_bytes(raw_config)
    if tensors is not None:
        save_file(tensors, str(dst / WEIGHTS))
    if raw is not None:
        (dst / WEIGHTS).write_bytes(raw)
    return dst


def _good_bytes(root: Path, file: str) -> bytes:
    return (root / "good" / file).read_bytes()


CONFIG_CASES = {
    # name: (config update, expected exception, message excerpt)
    "r-string": ({"r": "8"}, InputError, "argument 'adapter_config.json['r']' expected a positive int, received '8'"),
    "r-zero": ({"r": 0}, InputError, "argument 'adapter_config.json['r']' expected a positive int, received 0"),
    "r-negative": ({"r": -4}, InputError, "expected a positive int, received -4"),
    "r-float": ({"r": 4.5}, InputError, "expected a positive int, received 4.5"),
    "r-bool": ({"r": True}, InputError, "expected a positive int, received True"),
    "alpha-zero": ({"lora_alpha": 0}, InputError, "'adapter_config.json['lora_alpha']' expected a finite number > 0"),
    "alpha-nan": ({"lora_alpha": math.nan}, InputError, "expected a finite number > 0, received nan"),
    "alpha-string": ({"lora_alpha": "16"}, InputError, "expected a finite number > 0, received '16'"),
    "rank-pattern-zero": (
        {"rank_pattern": {"o_proj": 0}},
        InputError,
        "argument 'adapter_config.json['rank_pattern']['o_proj']' expected a positive int rank, received 0",
    ),
    "rank-pattern-float": ({"rank_pattern": {"o_proj": 2.5}}, InputError, "expected a positive int rank, received 2.5"),
    "rank-pattern-string": (
        {"rank_pattern": {"o_proj": "8"}},
        InputError,
        "expected a positive int rank, received '8'",
    ),
    "alpha-pattern-negative": (
        {"alpha_pattern": {"o_proj": -1.0}},
        InputError,
        "argument 'adapter_config.json['alpha_pattern']['o_proj']' expected a finite alpha > 0, received -1.0",
    ),
    "alpha-pattern-inf": (
        {"alpha_pattern": {"o_proj": math.inf}},
        InputError,
        "expected a finite alpha > 0, received inf",
    ),
    "pattern-not-a-dict": (
        {"rank_pattern": ["o_proj"]},
        InputError,
        "argument 'adapter_config.json['rank_pattern']' expected a dict of regular expressions to numbers",
    ),
    "pattern-bad-regex": (
        {"alpha_pattern": {"model.layers.[": 8.0}},
        InputError,
        "argument 'adapter_config.json['alpha_pattern']' expected keys that are regular expressions, received "
        "'model.layers.['",
    ),
    "pattern-matches-nothing": (
        {"rank_pattern": {"model.layers.7.mlp.experts.down_proj": 8}},
        InputError,
        "argument 'adapter_config.json['rank_pattern']' expected keys that each match an adapted module or "
        "parameter (PEFT's rule",
    ),
    "pattern-no-dot-boundary": (  # "_proj" is not a dot-separated tail of "o_proj": it matches nothing
        {"alpha_pattern": {"_proj": 8.0}},
        InputError,
        "received ['_proj'] matching none",
    ),
    "parts-of-one-linear": (
        {"rank_pattern": {"q_proj": 8}},
        InputError,
        "expected one rank and alpha for ['model.layers.0.self_attn.k_proj', 'model.layers.0.self_attn.q_proj', "
        "'model.layers.0.self_attn.v_proj'] (one fused Megatron linear, decoder.layers.0.self_attention.linear_qkv)",
    ),
    "rslora-string": (
        {"use_rslora": "yes"},
        InputError,
        "argument 'adapter_config.json['use_rslora']' expected a bool",
    ),
    "target-parameters-string": (
        {"target_parameters": "gate_up_proj"},
        InputError,
        "argument 'adapter_config.json['target_parameters']' expected a list of names, received 'gate_up_proj'",
    ),
    "target-parameters-other": (
        {"target_parameters": ["router.weight"]},
        InputError,
        "argument 'adapter_config.json['target_parameters']' expected names of transformers' fused expert parameters",
    ),
    "modules-to-save": (
        {"modules_to_save": ["lm_head"]},
        InputError,
        "argument 'adapter_config.json['modules_to_save']' expected None, received ['lm_head']",
    ),
    "lora-bias": ({"lora_bias": True}, InputError, "argument 'adapter_config.json['lora_bias']' expected False"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_adapter_config_is_refused_by_name(adapter, case):
    update, error, excerpt = CONFIG_CASES[case]
    path = _edited(adapter, case, config=update)
    with pytest.raises(error) as caught:
        fnppo.lora.lora_config_from_peft(path)
    assert "fnppo.lora.lora_config_from_peft: argument" in str(caught.value)
    assert excerpt in str(caught.value), str(caught.value)


def _unreadable_cases(root: Path) -> dict[str, tuple[Path, str, str]]:
    """name -> (directory, file named, the cause's excerpt)."""
    cfg, weights = _good_bytes(root, CFG), _good_bytes(root, WEIGHTS)
    return {
        "config-truncated": (
            _edited(root, "config-truncated", raw_config=cfg[: len(cfg) // 2]),
            CFG,
            "which is not valid JSON (truncated or corrupt: ",
        ),
        "config-not-utf8": (
            _edited(root, "config-not-utf8", raw_config=b"\xff\xfe{"),
            CFG,
            "which is not valid JSON (not UTF-8 text: ",
        ),
        "config-a-list": (_edited(root, "config-a-list", raw_config=b"[1, 2]"), CFG, "which holds a JSON array"),
        "weights-truncated": (
            _edited(root, "weights-truncated", raw=weights[: len(weights) // 2]),
            WEIGHTS,
            "which is not a whole safetensors file (truncated or corrupt: ",
        ),
        "weights-garbage": (
            _edited(root, "weights-garbage", raw=b"\x07" * 64),
            WEIGHTS,
            "which is not a whole safetensors file (truncated or corrupt: ",
        ),
        "weights-empty": (
            _edited(root, "weights-empty", raw=b""),
            WEIGHTS,
            "which is not a whole safetensors file (truncated or corrupt: ",
        ),
    }


def test_unreadable_adapter_files_are_checkpoint_errors_naming_the_path(adapter):
    for case, (path, file, cause) in _unreadable_cases(adapter).items():
        with pytest.raises(CheckpointError) as caught:
            fnppo.lora.lora_config_from_peft(path)
        msg = str(caught.value)
        assert msg.startswith("fnppo.lora.lora_config_from_peft: argument 'path' expected "), (case, msg)
        assert f"{path / file}" in msg and cause in msg, (case, msg)


def _load_cases(root: Path) -> dict[str, Path]:
    good = load_file(str(root / "good" / WEIGHTS))
    wider = dict(good)
    wider[GATE_UP0] = torch.cat([good[GATE_UP0], torch.zeros(1, good[GATE_UP0].shape[1])])  # one row too many
    narrow_b = dict(good)
    narrow_b[GATE_UP1_B] = good[GATE_UP1_B][:, :-4].contiguous()  # a rank-6 B of 4 experts missing 4 columns
    no_layer0 = {k: v for k, v in good.items() if ".layers.0.mlp.experts." not in k}
    no_q0 = {k: v for k, v in good.items() if not k.startswith(Q0)}
    half_q0 = {k: v for k, v in good.items() if k != f"{Q0}.lora_B.weight"}
    hidden = dict(good)
    hidden[f"{Q0}.lora_A.weight"] = torch.zeros(4, 2 * _COMMON["hidden_size"])  # another base's hidden size
    weights = _good_bytes(root, WEIGHTS)
    cases = {
        "fused-a-rows": _edited(root, "fused-a-rows", tensors=wider),
        "fused-b-columns": _edited(root, "fused-b-columns", tensors=narrow_b),
        "experts-missing": _edited(root, "experts-missing", tensors=no_layer0),
        "module-missing": _edited(root, "module-missing", tensors=no_q0),
        "half-pair": _edited(root, "half-pair", tensors=half_q0),
        "hidden": _edited(root, "hidden", tensors=hidden),
        "other-alpha": _edited(
            root, "other-alpha", config={"alpha_pattern": {"layers.1.mlp.experts.gate_up_proj": 30.0, "o_proj": 24.0}}
        ),
        "weights-truncated": _edited(root, "weights-truncated-load", raw=weights[: len(weights) - 100]),
        "config-truncated": _edited(root, "config-truncated-load", raw_config=_good_bytes(root, CFG)[:40]),
    }
    return {k: str(v) for k, v in cases.items()}


def _load_refusals(root: str, cases: dict[str, str]) -> dict:
    fnppo.init_parallel(seed=1234, device="cpu")
    base, good = f"{root}/base", f"{root}/good"
    chunks = fnppo.hf.build_gpt_from_hf(base, dtype="fp32", moe_experts="stacked")
    fnppo.hf.load_hf_weights(chunks, base)
    fnppo.lora.apply_lora(chunks, fnppo.lora.lora_config_from_peft(good))
    fnppo.lora.load_peft_adapter(chunks, good)
    before = fnppo.models.gather_full_weights(chunks, adapters=True)
    fnppo.lora.save_peft_adapter(chunks, f"{root}/saved")  # fnppo's file: records its base and form
    cases = dict(cases)
    for case, key, value in (("other-base", "fnppo_base", "qwen3_moe"), ("bad-record", "fnppo_lora", "{'form'")):
        with safe_open(f"{root}/saved/{WEIGHTS}", framework="pt") as fh:
            meta = dict(fh.metadata())
        meta[key] = json.dumps(dict(json.loads(meta[key]), family=value)) if case == "other-base" else value
        dst = _edited(Path(root), case)
        save_file(load_file(f"{root}/saved/{WEIGHTS}"), str(dst / WEIGHTS), metadata=meta)
        shutil.copy(f"{root}/saved/{CFG}", dst / CFG)
        cases[case] = str(dst)
    out = {}
    for case, path in cases.items():
        try:
            fnppo.lora.load_peft_adapter(chunks, path)
            out[case] = "accepted"
        except (InputError, CheckpointError) as err:
            out[case] = f"{type(err).__name__}: {err}"
        after = fnppo.models.gather_full_weights(chunks, adapters=True)
        out[f"{case}-unchanged"] = all(torch.equal(after[k], before[k]) for k in before)
    split = fnppo.hf.build_gpt_from_hf(base, dtype="fp32", moe_experts="stacked")  # PEFT's fused B as split form
    fnppo.lora.apply_lora(split, fnppo.lora.lora_config_from_peft(good, expert_gate_up="split"))
    try:
        fnppo.lora.load_peft_adapter(split, good)
        out["split"] = "accepted"
    except InputError as err:
        out["split"] = str(err)
    return out


def test_bad_adapter_files_are_refused_by_name_before_anything_loads(adapter):
    got = run_ranks(_load_refusals, 1, str(adapter), _load_cases(adapter), timeout_s=600)[0]
    assert all(got[k] for k in got if k.endswith("-unchanged")), got
    assert not any(v == "accepted" for v in got.values()), got
    assert (
        "argument 'path' expected the adapter of model.layers.0.self_attn.q_proj (its target_modules name 'self_attn.q_proj'), "
        "received no tensors"
    ) in got["module-missing"]
    assert (
        f"argument 'path' expected both {Q0}.lora_A.weight and {Q0}.lora_B.weight, received only {Q0}.lora_A.weight"
    ) in got["half-pair"]
    assert (
        f"argument 'PEFT tensor {Q0}.lora_A.weight' expected shape (4, 64) (the model's), received (4, 128)"
        in (got["hidden"])
    )
    assert (
        "argument 'path' expected an adapter saved for this base model, received one saved for a base with "
        "family='qwen3_moe' (the model's 'mixtral')"
    ) in got["other-base"], got["other-base"]
    assert "argument 'path' expected a JSON fnppo_lora record in adapter_model.safetensors" in got["bad-record"]
    hidden = _COMMON["hidden_size"]
    assert (
        f"InputError: fnppo.lora.load_peft_adapter: argument 'PEFT tensor {GATE_UP0}' expected shape (16, {hidden}) "
        f"(the model's: 4 experts x rank 4, as the config's rank_pattern gives it), received (17, {hidden})"
    ) in got["fused-a-rows"], got["fused-a-rows"]
    assert f"argument 'PEFT tensor {GATE_UP1_B}' expected shape (" in got["fused-b-columns"], got["fused-b-columns"]
    assert "received (" in got["fused-b-columns"]
    assert (
        f"argument 'path' expected the tensor {GATE_UP0} (target_parameters names "
        "model.layers.0.mlp.experts.gate_up_proj), received none"
    ) in got["experts-missing"], got["experts-missing"]
    assert (
        "argument 'the rank and alpha of model.layers.0.self_attn.o_proj (adapter_config.json: r, lora_alpha, "
        "rank_pattern, alpha_pattern)' expected rank 4, scaling 5 (the model's adapter of "
        "decoder.layers.0.self_attention.linear_proj"
    ) in got["other-alpha"], got["other-alpha"]
    assert got["weights-truncated"].startswith(
        "CheckpointError: fnppo.lora.load_peft_adapter: argument 'path' expected a readable safetensors file "
        "(adapter_model.safetensors)"
    ), got["weights-truncated"]
    assert got["config-truncated"].startswith("CheckpointError: fnppo.lora.load_peft_adapter: argument 'path'")
    assert "which is not valid JSON (truncated or corrupt: " in got["config-truncated"]
    assert "expected a block-diagonal B over the 2 fused projections" in got["split"], got["split"]
