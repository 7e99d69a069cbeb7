"""Reading a PEFT adapter directory: ``adapter_config.json``, the safetensors header and tensors, and
the :class:`~fnppo.megatron.lora.LoRAConfig` of the adapter (:func:`lora_config_from_peft`).

Each adapted Hugging Face module (``model.layers.0.self_attn.q_proj``, from the file's tensors) and
each adapted fused expert parameter (``model.layers.1.mlp.experts.gate_up_proj``, from
``target_parameters`` by PEFT's rule, :mod:`fnppo.io.hf.peft_rules`) gets its rank and alpha by
PEFT's ``rank_pattern`` / ``alpha_pattern`` rule; they are then grouped by the Megatron linear that
holds them (q, k, v: the fused QKV; gate, up: fc1), which must agree on one rank and alpha, and
linears other than the most common ``(rank, alpha)`` become ``LoRAConfig.overrides``. A file
written by fnppo carries a record (safetensors metadata ``fnppo_lora``): the form of its expert
``gate_up_proj`` adapters (``LoRAConfig.expert_gate_up``; a file without it is PEFT's fused form),
the adapter dropout, and the true rank and alpha of an adapter written zero-padded.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

from fnppo.core.errors import input_error
from fnppo.io.files import load_safetensors, open_safetensors, read_json_object
from fnppo.io.hf.peft_experts import PARAMS, PREFIX, param_key
from fnppo.io.hf.peft_rules import check_patterns, names_parameter, resolve
from fnppo.megatron.lora import GATE_UP_FORMS, TARGETS, LoRAConfig

__all__ = [
    "lora_config_from_peft",
    "read_config",
    "read_header",
    "read_tensors",
    "adapted_names",
    "file_values",
    "linear_of",
    "hf_alpha",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "RECORD_KEY",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: the safetensors metadata key of fnppo's record of the adapter (form, dropout, padded ranks)
RECORD_KEY = "fnppo_lora"
_FN = "fnppo.lora.lora_config_from_peft"
#: Hugging Face module / fused parameter (layer-relative) -> (Megatron linear, layer-relative)
_LINEARS = {
    "self_attn.q_proj": "self_attention.linear_qkv",
    "self_attn.k_proj": "self_attention.linear_qkv",
    "self_attn.v_proj": "self_attention.linear_qkv",
    "self_attn.o_proj": "self_attention.linear_proj",
    "mlp.gate_proj": "mlp.linear_fc1",
    "mlp.up_proj": "mlp.linear_fc1",
    "mlp.down_proj": "mlp.linear_fc2",
    "mlp.shared_expert.gate_proj": "mlp.shared_experts.linear_fc1",
    "mlp.shared_expert.up_proj": "mlp.shared_experts.linear_fc1",
    "mlp.shared_expert.down_proj": "mlp.shared_experts.linear_fc2",
    "mlp.experts.gate_up_proj": "mlp.experts.linear_fc1",
    "mlp.experts.down_proj": "mlp.experts.linear_fc2",
}
#: ``target_modules`` name -> Megatron target
_LEAF_TARGETS = {m.rpartition(".")[2]: t.rpartition(".")[2] for m, t in _LINEARS.items() if ".experts." not in m}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TENSOR = re.compile(r"^base_model\.model\.(.+?)(?:\.base_layer)?\.lora_[AB]\.weight$")


def linear_of(name: str) -> str | None:
    """The Megatron linear (1-rank name, experts without ``local_experts``) of a Hugging Face module
    or fused expert parameter, or None."""
    m = _LAYER.match(name)
    linear = _LINEARS.get(m.group(2)) if m else None
    return None if linear is None else f"decoder.layers.{m.group(1)}.{linear}"


def read_config(fn: str, path: Path) -> dict[str, Any]:
    """``adapter_config.json`` of ``path``, checked: a LoRA adapter fnppo computes (each option it
    does not compute refused by name), ``r`` / ``lora_alpha`` / the patterns well-formed.

    Raises:
        CheckpointError: the file is not readable JSON (truncated, corrupt), naming the path and cause.
        InputError: no such file; an option fnppo does not compute; bad numbers or patterns.
    """
    file = path / CONFIG_FILE
    if not file.is_file():
        raise input_error(fn, "path", f"a directory with {CONFIG_FILE}", repr(str(path)))
    cfg = read_json_object(fn, "path", file)  # CheckpointError: a damaged file (fnppo.io.files)
    checks = (
        ("peft_type", "LORA", cfg.get("peft_type")),
        ("use_dora", False, bool(cfg.get("use_dora", False))),
        ("fan_in_fan_out", False, bool(cfg.get("fan_in_fan_out", False))),
        ("bias", "none", cfg.get("bias", "none")),
        ("lora_bias", False, bool(cfg.get("lora_bias", False))),
        ("modules_to_save", None, cfg.get("modules_to_save") or None),
        ("trainable_token_indices", None, cfg.get("trainable_token_indices") or None),
        ("layer_replication", None, cfg.get("layer_replication") or None),
        ("alora_invocation_tokens", None, cfg.get("alora_invocation_tokens") or None),
        ("use_qalora", False, bool(cfg.get("use_qalora", False))),
        ("use_bdlora", None, cfg.get("use_bdlora") or None),
    )
    for key, want, got in checks:
        if got != want:
            raise input_error(fn, f"{CONFIG_FILE}[{key!r}]", repr(want), repr(got))
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise input_error(fn, f"{CONFIG_FILE}['use_rslora']", "a bool", repr(cfg.get("use_rslora")))
    params = cfg.get("target_parameters") or []
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        raise input_error(fn, f"{CONFIG_FILE}['target_parameters']", "a list of names", repr(params))
    bad = [p for p in params if p.rpartition(".")[2] not in PARAMS.values()]
    if bad:
        raise input_error(
            fn,
            f"{CONFIG_FILE}['target_parameters']",
            f"names of transformers' fused expert parameters, ending in {sorted(PARAMS.values())}",
            repr(params),
        )
    check_patterns(fn, cfg, CONFIG_FILE)
    return cfg


def read_header(fn: str, path: Path) -> tuple[list[str], dict[str, str]]:
    """The tensor names and the metadata of ``adapter_model.safetensors`` (no tensor data read).

    Raises:
        InputError: no such file. CheckpointError: a file that is not safetensors (truncated, corrupt).
    """
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise input_error(fn, "path", f"a directory with {WEIGHTS_FILE}", repr(str(path)))
    with open_safetensors(fn, "path", file) as fh:
        return list(fh.keys()), dict(fh.metadata() or {})


def read_tensors(fn: str, path: Path) -> dict[str, Any]:
    """The tensors of ``adapter_model.safetensors`` (CheckpointError naming the path if unreadable)."""
    return load_safetensors(fn, "path", path / WEIGHTS_FILE)


def read_record(fn: str, metadata: dict[str, str]) -> dict[str, Any]:
    """fnppo's record of the adapter (empty for a file fnppo did not write), checked."""
    raw = metadata.get(RECORD_KEY)
    if raw is None:
        return {}
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    ok = (
        isinstance(record, dict)
        and record.get("expert_gate_up") in GATE_UP_FORMS
        and isinstance(record.get("padded", {}), dict)
    )
    if not ok:
        raise input_error(fn, "path", f"a JSON {RECORD_KEY} record in {WEIGHTS_FILE}", repr(raw[:80]))
    return record


def adapted_names(cfg: dict[str, Any], keys: list[str], layers: list[int]) -> tuple[list[str], list[str]]:
    """``(modules, parameters)``: the Hugging Face modules with tensors in the file, and the fused
    expert parameters of ``layers`` (MoE layers) that ``target_parameters`` names by PEFT's rule."""
    targets = list(cfg.get("target_parameters") or [])
    modules = set()
    for key in keys:
        m = _TENSOR.match(key)
        if m and ".mlp.experts" not in m.group(1) + ".":
            modules.add(m.group(1))
    params = [param_key(i, p) for i in layers for p in PARAMS.values() if names_parameter(targets, param_key(i, p))]
    return sorted(modules), params


def _file_layers(keys: list[str]) -> list[int]:
    """The layers of the file's expert tensors."""
    found = {
        int(m.group(1))
        for k in keys
        if (m := re.match(rf"^{re.escape(PREFIX)}model\.layers\.(\d+)\.mlp\.experts\.", k))
    }
    return sorted(found)


def file_values(
    fn: str, cfg: dict[str, Any], record: dict[str, Any], names: list[str]
) -> dict[str, tuple[int, float, int]]:
    """Per adapted name: ``(true rank, alpha at the true rank, rank stored in the file)`` (the file's
    rank and alpha by PEFT's rule; fnppo's record gives the true ones of a zero-padded adapter)."""
    out = {}
    padded = record.get("padded", {})
    for name, (rank, alpha) in resolve(fn, cfg, names, CONFIG_FILE).items():
        true = padded.get(name)
        if true is None:
            out[name] = (rank, alpha, rank)
            continue
        if not (isinstance(true, list) and len(true) == 2 and isinstance(true[0], int) and 0 < true[0] <= rank):
            raise input_error(fn, "path", f"a {RECORD_KEY} record with a rank <= {rank} for {name}", repr(true))
        out[name] = (true[0], float(true[1]), rank)
    return out


def hf_alpha(alpha: float, parts: int, rslora: bool) -> float:
    """The alpha of PEFT's rank-``parts * r`` adapter that holds ``parts`` rank-``r`` adapters of
    alpha ``alpha`` block-diagonally (the same scaling: ``parts`` times, ``sqrt(parts)`` with rsLoRA)."""
    return alpha * (math.sqrt(parts) if rslora else parts)


def _per_linear(
    fn: str, values: dict[str, tuple[int, float, int]], form: str, rslora: bool
) -> dict[str, tuple[int, float]]:
    """Megatron linear -> (rank, alpha), from the Hugging Face names' (one value per linear)."""
    found: dict[str, dict[str, tuple[int, float]]] = {}
    for name, (rank, alpha, _) in values.items():
        linear = linear_of(name)
        if linear is None:
            raise input_error(fn, f"{CONFIG_FILE}['target_modules']", "projections fnppo adapts", repr(name))
        if name.endswith(".experts.gate_up_proj") and form == "split":
            if rank % 2:
                raise input_error(
                    fn, f"the rank of {name}", "an even rank for LoRAConfig(expert_gate_up='split')", str(rank)
                )
            rank, alpha = rank // 2, alpha / (math.sqrt(2) if rslora else 2)
        found.setdefault(linear, {})[name] = (rank, alpha)
    out = {}
    for linear, parts in found.items():
        distinct = set(parts.values())
        if len(distinct) > 1:
            raise input_error(
                fn,
                f"{CONFIG_FILE}['rank_pattern'] / ['alpha_pattern']",
                f"one rank and alpha for {sorted(parts)} (one fused Megatron linear, {linear})",
                repr(parts),
            )
        out[linear] = distinct.pop()
    return out


def lora_config_from_peft(path: str | os.PathLike, **changes: Any) -> LoRAConfig:
    """The :class:`~fnppo.megatron.lora.LoRAConfig` of a PEFT adapter directory (rank, alpha,
    rsLoRA, dropout, the Megatron targets, per-layer ranks and alphas), with ``changes`` applied.

    ``target_parameters`` (the fused experts' ``gate_up_proj`` / ``down_proj``, any spelling PEFT
    accepts) adapt the experts' ``linear_fc1`` / ``linear_fc2`` (``experts=True``); their form is
    PEFT's fused one unless the file is fnppo's split form (its record), or ``changes`` names
    ``expert_gate_up``. ``rank_pattern`` / ``alpha_pattern`` are resolved by PEFT's rule for every
    adapted module and parameter (:mod:`fnppo.io.hf.peft_rules`); the linears whose ``(rank,
    alpha)`` is not the most common become ``overrides``.

    Raises:
        InputError: not a LoRA adapter PEFT's way (DoRA, biases, ``modules_to_save``, ...: each
            named), target modules or parameters no Megatron target holds, a pattern key that
            matches nothing, parts of one Megatron linear with different ranks or alphas, bad
            numbers (``r``, ``lora_alpha``, pattern values: a positive int rank, a finite alpha > 0).
        CheckpointError: ``adapter_config.json`` or ``adapter_model.safetensors`` unreadable
            (truncated, corrupt), naming the path and the cause.
    """
    src = Path(path)
    cfg = read_config(_FN, src)
    keys, metadata = read_header(_FN, src)
    record = read_record(_FN, metadata)
    names = cfg.get("target_modules") or []
    names = [names] if isinstance(names, str) else list(names)
    known = set(_LEAF_TARGETS)
    params = list(cfg.get("target_parameters") or [])
    if [n for n in names if not isinstance(n, str) or n.rpartition(".")[2] not in known] or not (names or params):
        raise input_error(
            _FN, f"{CONFIG_FILE}['target_modules']", f"names (or dotted tails) ending in {sorted(known)}", repr(names)
        )
    modules, adapted = adapted_names(cfg, keys, _file_layers(keys))
    form = changes.get("expert_gate_up", record.get("expert_gate_up", "fused"))
    rslora = bool(changes.get("rslora", cfg.get("use_rslora", False)))
    linears = _per_linear(_FN, file_values(_FN, cfg, record, modules + adapted), form, rslora)
    counts = Counter(linears.values())
    default = (int(cfg["r"]), float(cfg["lora_alpha"]))  # else the most common (the file's r first on a tie)
    if counts:
        default = max(counts, key=lambda v: (counts[v], v == default, -v[0], -v[1]))
    wanted = {linear.rpartition(".")[2] for linear in linears} | {_LEAF_TARGETS[n.rpartition(".")[2]] for n in names}
    wanted |= {k for k, v in PARAMS.items() if any(p.rpartition(".")[2] == v for p in params)}
    dropout = record.get("dropout", cfg.get("lora_dropout", 0.0))
    fields = dict(
        rank=default[0],
        alpha=default[1],
        dropout=float(dropout) if isinstance(dropout, int) and not isinstance(dropout, bool) else dropout,
        targets=tuple(t for t in TARGETS if t in wanted),
        experts=bool(params),
        rslora=rslora,
        expert_gate_up=form,
        overrides=tuple((n, r, a) for n, (r, a) in sorted(linears.items()) if (r, a) != default),
    )
    fields.update(changes)
    return LoRAConfig(**fields)
