"""Damaged files of a Hugging Face checkpoint or a PEFT adapter: a ``config.json``, a
``model.safetensors.index.json``, a ``model.safetensors`` shard, an ``adapter_config.json`` or an
``adapter_model.safetensors`` (and the base record fnppo writes into its metadata) that is truncated,
empty, not UTF-8, not JSON or of the wrong JSON type is one ``CheckpointError`` naming the file and the
cause (``fnppo.io.files``), never a raw ``JSONDecodeError`` / ``SafetensorError`` / ``AttributeError``,
and the model is left as it was.

The files are written by fnppo itself (``export_hf_weights``, ``save_peft_adapter``) from a tiny Llama
built from ``transformers``' own ``LlamaConfig``, then damaged; the loads run on one gloo rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import fnppo
from fnppo.io.hf.peft_config import read_config
from fnppo.testing import run_ranks

pytest.importorskip("transformers")

RANK = 4


def _config() -> dict:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ).to_dict()


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


#: damage done to one file: case -> (how, what the refusal says of the file)
DAMAGE = {
    "truncated": (_truncate, "truncated or corrupt"),
    "empty": (lambda p: p.write_bytes(b""), None),
    "not-utf8": (lambda p: p.write_bytes(b'{"model_type": "\xff\xfe"}'), "not UTF-8 text"),
    "array": (lambda p: p.write_text("[1, 2]"), "which holds a JSON array"),
}


def _damaged(src: Path, root: Path, name: str, file: str, damage) -> str:
    d = root / name
    shutil.copytree(src, d)
    damage(d / file)
    return str(d)


def _json_readers() -> dict:
    """Per JSON file: (its name, a good body, the public reader, the reader's message prefix)."""
    adapter = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    return {
        "config": (
            "config.json",
            _config(),
            lambda d: fnppo.hf.model_config_from_hf(d).num_layers == 2,
            fnppo.hf.model_config_from_hf,
            "fnppo.io.hf.model_config_from_hf: argument 'config_or_path' expected a JSON object in config.json",
        ),
        "adapter": (
            "adapter_config.json",
            adapter,
            lambda d: read_config("fn", d)["r"] == RANK,  # the reader lora_config_from_peft starts with
            fnppo.lora.lora_config_from_peft,
            "fnppo.lora.lora_config_from_peft: argument 'path' expected a JSON object in adapter_config.json",
        ),
    }


@pytest.mark.parametrize("which", ["config", "adapter"])
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_json_file_is_a_checkpoint_error(tmp_path, case, which):
    """``model_config_from_hf`` / ``build_gpt_from_hf`` (and ``export_hf_weights(hf_config=path)``) read a
    ``config.json`` path, ``lora_config_from_peft`` an ``adapter_config.json``, through one reader: a
    damaged file names itself and the cause."""
    name, body, reads_good, reader, prefix = _json_readers()[which]
    good = tmp_path / "good"
    good.mkdir()
    (good / name).write_text(json.dumps(body))
    assert reads_good(good)
    damage, says = DAMAGE[case]
    d = Path(_damaged(good, tmp_path, case, name, damage))
    with pytest.raises(fnppo.checkpoint.CheckpointError) as err:
        reader(d)
    msg = str(err.value)
    assert msg.startswith(f"{prefix}, received '{d / name}', which "), msg
    assert (says or "not valid JSON (an empty file)") in msg, msg


def _outcome(call, chunks) -> tuple[str, bool]:
    """(the error's type and message, or "no error"; whether every parameter is as before the call)."""
    before = [p.detach().clone() for c in chunks for p in c.parameters()]
    try:
        call()
        text = "no error"
    except Exception as err:  # noqa: BLE001 - the type is part of the outcome
        text = f"{type(err).__name__}: {err}"
    after = [p.detach() for c in chunks for p in c.parameters()]
    return text, all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _with_metadata(path: Path, record: str) -> None:
    """Rewrite the safetensors file ``path`` with its ``fnppo_base`` metadata record replaced."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        meta = dict(fh.metadata() or {})
    save_file(tensors, str(path), metadata={**meta, "fnppo_base": record})


def _worker(root: str, cfg: dict) -> dict:
    from fnppo.hf import build_gpt_from_hf, export_hf_weights, load_hf_weights

    root = Path(root)
    chunks = build_gpt_from_hf(cfg, dtype="fp32")
    good = root / "good"
    export_hf_weights(chunks, good, hf_config=cfg)
    sharded = root / "sharded"  # the same weights as two shards and an index
    export_hf_weights(chunks, sharded, hf_config=cfg, max_shard_bytes=40_000)
    index = "model.safetensors.index.json"
    shard = sorted(p.name for p in sharded.glob("model-*.safetensors"))[0]
    fresh = build_gpt_from_hf(cfg, dtype="fp32")  # other random weights: a load would change them
    weights = {
        "weights-truncated": _damaged(good, root, "w1", "model.safetensors", _truncate),
        "weights-empty": _damaged(good, root, "w2", "model.safetensors", lambda p: p.write_bytes(b"")),
        "weights-garbage": _damaged(good, root, "w3", "model.safetensors", lambda p: p.write_text("not a file" * 9)),
        "config-truncated": _damaged(good, root, "c1", "config.json", _truncate),
        "index-truncated": _damaged(sharded, root, "i1", index, _truncate),
        "index-weight-map-array": _damaged(sharded, root, "i2", index, lambda p: p.write_text('{"weight_map": []}')),
        "shard-truncated": _damaged(sharded, root, "i3", shard, _truncate),
    }
    out = {case: _outcome(lambda p=p: load_hf_weights(fresh, p), fresh) for case, p in weights.items()}
    out["good"] = _outcome(lambda: load_hf_weights(fresh, sharded), fresh)[0]

    fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(rank=RANK, alpha=8.0))
    with torch.no_grad():
        for c in chunks:
            for name, p in c.named_parameters():
                if name.endswith("lora_B"):
                    p.copy_(torch.randn_like(p))
    adapter = root / "adapter"
    fnppo.lora.save_peft_adapter(chunks, adapter)
    fnppo.lora.apply_lora(fresh, fnppo.lora.lora_config_from_peft(adapter))
    file = "adapter_model.safetensors"
    adapters = {
        "adapter-truncated": _damaged(adapter, root, "a1", file, _truncate),
        "adapter-empty": _damaged(adapter, root, "a2", file, lambda p: p.write_bytes(b"")),
        "base-record-array": _damaged(adapter, root, "a3", file, lambda p: _with_metadata(p, "[1, 2]")),
        "base-record-not-json": _damaged(adapter, root, "a4", file, lambda p: _with_metadata(p, '{"family": "ll')),
    }
    for case, p in adapters.items():
        out[case] = _outcome(lambda p=p: fnppo.lora.load_peft_adapter(fresh, p), fresh)
    out["adapter-good"] = _outcome(lambda: fnppo.lora.load_peft_adapter(fresh, adapter), fresh)[0]
    out["paths"] = {**weights, **adapters, "shard": shard}
    return out


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    return run_ranks(_worker, 1, str(tmp_path_factory.mktemp("hf-files")), _config())[0]


LOADS = {  # case -> (the file named, what the refusal says of it)
    "weights-truncated": ("model.safetensors", "which is not a whole safetensors file (truncated or corrupt: "),
    "weights-empty": ("model.safetensors", "which is not a whole safetensors file (truncated or corrupt: "),
    "weights-garbage": ("model.safetensors", "which is not a whole safetensors file (truncated or corrupt: "),
    "config-truncated": ("config.json", "which is not valid JSON (truncated or corrupt: "),
    "index-truncated": ("model.safetensors.index.json", "which is not valid JSON (truncated or corrupt: "),
    "index-weight-map-array": ("model.safetensors.index.json", ""),
    "shard-truncated": ("<shard>", "which is not a whole safetensors file (truncated or corrupt: "),
}


@pytest.mark.parametrize("case", list(LOADS))
def test_a_damaged_checkpoint_file_is_a_checkpoint_error_and_loads_nothing(loads, case):
    assert loads["good"] == "no error"
    msg, untouched = loads[case]
    file, says = LOADS[case]
    file = loads["paths"]["shard"] if file == "<shard>" else file
    path = Path(loads["paths"][case]) / file
    assert msg.startswith("CheckpointError: fnppo.io.hf.load_hf_weights: argument 'path' expected "), msg
    assert f"received '{path}'" in msg and says in msg, msg
    assert untouched, case


ADAPTERS = {
    "adapter-truncated": "which is not a whole safetensors file (truncated or corrupt: ",
    "adapter-empty": "which is not a whole safetensors file (truncated or corrupt: ",
    "base-record-array": "expected a JSON object as the fnppo_base record of adapter_model.safetensors, received '[1, 2]'",
    "base-record-not-json": "expected a JSON object as the fnppo_base record of adapter_model.safetensors",
}


@pytest.mark.parametrize("case", list(ADAPTERS))
def test_a_damaged_adapter_file_is_a_checkpoint_error_and_loads_nothing(loads, case):
    assert loads["adapter-good"] == "no error"
    msg, untouched = loads[case]
    assert msg.startswith("CheckpointError: fnppo.lora.load_peft_adapter: argument 'path' expected "), msg
    assert ADAPTERS[case] in msg and "adapter_model.safetensors" in msg, msg
    assert untouched, case


# ---------------------------------------------------------------------------------------------
# the record of a LoRA base: one base built in fp32 and in bf16 is the same base
# ---------------------------------------------------------------------------------------------
def _lora(chunks) -> None:
    fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(rank=RANK, alpha=8.0))
    with torch.no_grad():
        for c in chunks:
            for name, p in c.named_parameters():
                if name.endswith("lora_B"):
                    p.copy_(torch.randn_like(p))


def _bases(root: str, cfg: dict) -> dict:
    from fnppo.hf import build_gpt_from_hf
    from fnppo.io.checkpoint.base import base_problem, base_record
    from fnppo.io.hf.arch import model_arch
    from fnppo.io.hf.peft import base_fingerprint
    from fnppo.megatron.unwrap import unwrap_model

    f32 = build_gpt_from_hf(cfg, dtype="fp32")
    fnppo.models.layout_invariant_init(f32, seed=5)
    bf16 = build_gpt_from_hf(cfg, dtype="bf16")  # the same base, its weights rounded to bfloat16
    weights = dict(unwrap_model(f32[0]).named_parameters())
    with torch.no_grad():
        for name, p in unwrap_model(bf16[0]).named_parameters():
            p.copy_(weights[name])
    other = build_gpt_from_hf(cfg, dtype="bf16")
    fnppo.models.layout_invariant_init(other, seed=6)
    for chunks in (f32, bf16, other):
        _lora(chunks)
    rec = {"f32": base_record(f32), "bf16": base_record(bf16), "other": base_record(other)}
    arch = {k: base_fingerprint(model_arch("test", m)) for k, m in (("f32", f32), ("bf16", bf16))}
    adapter = Path(root) / "fp32-adapter"
    fnppo.lora.save_peft_adapter(f32, adapter)
    return {
        "dtypes": (rec["f32"]["dtype"], rec["bf16"]["dtype"]),
        "tensors": len(rec["f32"]["tensors"]),
        "same": base_problem(rec["f32"], rec["bf16"]),
        "same_reversed": base_problem(rec["bf16"], rec["f32"]),
        "other": base_problem(rec["f32"], rec["other"]),
        "arch_equal": arch["f32"] == arch["bf16"] == rec["f32"]["arch"] == rec["bf16"]["arch"],
        "peft_into_bf16": _outcome(lambda: fnppo.lora.load_peft_adapter(bf16, adapter), bf16)[0],
    }


def test_one_base_built_in_fp32_and_in_bf16_has_one_record(tmp_path):
    """A LoRA checkpoint's base record (``base_record``: digests of each base weight, exact and rounded to
    bfloat16) and the architecture fingerprint of fnppo's PEFT files (``base_fingerprint``) of one base
    built in fp32 and in bf16 (its fp32 weights rounded): the same base both ways (the records compare
    the rounded digests across dtypes), a PEFT adapter saved on the fp32 base loads on the bf16 one; a
    base of other weights in bf16 is another base."""
    r = run_ranks(_bases, 1, str(tmp_path), _config())[0]
    assert r["dtypes"] == ("float32", "bfloat16") and r["tensors"] > 0
    assert r["same"] is None and r["same_reversed"] is None, r
    assert r["other"].startswith("another base model: ") and (
        f"of {r['tensors']} base weights differ rounded to bfloat16 (float32 saved, bfloat16 now)" in r["other"]
    ), r["other"]  # (the norms, ones in both, agree)
    assert r["arch_equal"] and r["peft_into_bf16"] == "no error", r
