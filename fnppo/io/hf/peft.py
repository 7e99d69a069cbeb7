"""LoRA adapters in PEFT's on-disk format: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT (Hugging Face's ``peft`` library) stores one adapter per Hugging Face projection,
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``, with
``r``, ``lora_alpha`` (scaling ``lora_alpha / r``) and ``target_modules`` in ``adapter_config.json``.
fnppo's adapter of a fused Megatron linear holds one adapter per projection it fuses
(:mod:`fnppo.megatron.lora_linear`): ``A`` stacks the projections' ``A`` (query, key, value; gate,
up), ``B`` holds their rows in the base weight's layout (fused QKV per query group, ``[gate; up]``),
so the conversion is exact both ways: the rows of ``B`` are moved as the base weight's rows are
(:func:`fnppo.io.hf.layouts.to_hf` / :func:`~fnppo.io.hf.layouts.read_shard`).

:func:`save_peft_adapter` writes a model's adapters (collective; rank 0 writes);
:func:`load_peft_adapter` loads an adapter saved by ``peft`` (``PeftModel.save_pretrained``) into a
model with adapters of the same rank and alpha; :func:`lora_config_from_peft` reads the
:class:`~fnppo.megatron.lora.LoRAConfig` to build that model with. Adapters inside MoE experts
(``SequentialMLP`` or stacked experts, per expert or shared) are PEFT's ``target_parameters`` adapters of
``transformers`` 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj`` (:mod:`fnppo.io.hf.peft_experts`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fnppo.core.errors import checkpoint_error, input_error
from fnppo.core.typing import Tensor
from fnppo.io.files import load_safetensors, open_safetensors, read_json_object
from fnppo.io.hf.arch import Arch, expected_hf_shapes, model_arch
from fnppo.io.hf.families import FAMILIES
from fnppo.io.hf.keys import param_rule
from fnppo.io.hf.layouts import read_shard, to_hf
from fnppo.io.hf.peft_experts import PARAMS, expert_targets, from_peft_experts, to_peft_experts
from fnppo.megatron.lora import TARGETS, LoRAConfig, lora_config_of
from fnppo.megatron.parallel import current_layout
from fnppo.megatron.stacked_experts import named_weights
from fnppo.megatron.unwrap import unwrap_model
from fnppo.megatron.weights import full_shape, gather_full_weights, global_name, load_full_weights, tp_of

__all__ = ["save_peft_adapter", "load_peft_adapter", "lora_config_from_peft", "CONFIG_FILE", "WEIGHTS_FILE"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
#: Megatron target -> the Hugging Face projections PEFT names
_LOAD = "fnppo.lora.load_peft_adapter"
#: the safetensors metadata key of the base model's record (:func:`base_fingerprint`)
BASE_KEY = "fnppo_base"
_EXPERT_LIKE = {"gate_proj", "up_proj", "down_proj"}
_HF_TARGETS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


def _modules(fn: str, a: Arch, gname: str) -> tuple[str, tuple[str, ...]]:
    """(layout kind, Hugging Face modules) of the adapter ``gname`` (``<linear>.lora_A`` or ``lora_B``)."""
    if ".experts." in gname:
        raise input_error(fn, "model_chunks", "adapters on dense projections (PEFT's format)", f"an adapter at {gname}")
    kind, names = param_rule(fn, a, gname.rpartition(".")[0] + ".weight")
    return kind, tuple(n.removesuffix(".weight") for n in names)


def _to_peft(a: Arch, kind: str, modules: tuple[str, ...], lora_a: Tensor, lora_b: Tensor) -> dict[str, Tensor]:
    """PEFT's tensors of one fnppo adapter (full tensors)."""
    weights = tuple(m + ".weight" for m in modules)
    bs = {k.removesuffix(".weight"): v for k, v in to_hf(a, kind, weights, lora_b, 0).items()}
    As = lora_a.chunk(len(modules), dim=0)
    out = {}
    for m, am in zip(modules, As, strict=True):
        out[f"{_PREFIX}{m}.lora_A.weight"] = am.contiguous()
        out[f"{_PREFIX}{m}.lora_B.weight"] = bs[m].contiguous()
    return out


def save_peft_adapter(
    model_chunks: Sequence[nn.Module], path: str | os.PathLike, *, base_model_name_or_path: str | None = None
) -> None:
    """Write the model's adapters in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``).

    Collective over the whole world (the adapters are gathered as full tensors,
    :func:`fnppo.megatron.weights.gather_full_weights` with ``adapters=True``); rank 0 writes.
    ``peft.PeftModel.from_pretrained(hf_model, path)`` then computes what the fnppo model computes.

    Expert adapters are written in PEFT's ``target_parameters`` form (:mod:`fnppo.io.hf.peft_experts`;
    a shared adapter as the same adapter for every expert). A dense projection's adapter whose ``B``
    is all zeros (it adds nothing, e.g. one PEFT did not adapt) is left out of the file.

    Raises:
        InputError: a model without adapters; a Qwen3-MoE or Mixtral model with non-zero adapters on
            a dense MLP (PEFT reads ``gate_proj`` / ``up_proj`` / ``down_proj`` of these families as
            the experts' names).
        CheckpointError: rank 0 failed to write the files (the message names the path and the cause).
    """
    fn = "fnppo.lora.save_peft_adapter"
    config = lora_config_of(model_chunks)
    if config is None:
        raise input_error(fn, "model_chunks", "a model with adapters (fnppo.lora.apply_lora)", "no adapters")
    a = model_arch(fn, model_chunks)
    full = gather_full_weights(model_chunks, adapters=True)
    error: list[str | None] = [None]
    if current_layout().rank == 0:
        try:
            _write_peft(fn, a, config, full, Path(path), base_model_name_or_path)
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            error[0] = f"{type(err).__name__}: {err}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise checkpoint_error(
            fn, "path", "a directory rank 0 can write the adapter into", f"{str(path)!r} ({error[0]})"
        )


def _write_peft(fn: str, a: Arch, config: LoRAConfig, full: dict[str, Tensor], out: Path, base: str | None) -> None:
    """Rank 0: PEFT's two files from the full adapters."""
    tensors: dict[str, Tensor] = {}
    modules_written: set[str] = set()
    for gname in sorted(n for n in full if n.endswith(".lora_A") and ".experts." not in n):
        b = full[gname[: -len("A")] + "B"]
        if not bool(b.ne(0).any()):
            continue  # a zero adapter adds nothing
        kind, modules = _modules(fn, a, gname)
        moe = FAMILIES[a.family].moe
        if a.moe_layers and moe is not None and moe.mlp_names_are_experts and set(modules) & _EXPERT_LIKE:
            raise input_error(
                fn,
                "model_chunks",
                f"no trained adapters on a dense MLP of a {a.family} model (PEFT reads gate_proj, up_proj and "
                "down_proj of this family as its experts' names)",
                f"a non-zero adapter at {gname}",
            )
        tensors.update(_to_peft(a, kind, modules, full[gname], b))
        modules_written.update(m.rpartition(".")[2] for m in modules)
    experts = {n: t for n, t in full.items() if ".experts." in n}
    if experts:
        tensors.update(to_peft_experts(experts, a.experts, config.rank))
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt", BASE_KEY: json.dumps(base_fingerprint(a))})
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted(modules_written),
        "target_parameters": expert_targets(experts) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": base,
        "lora_bias": False,
    }
    parts = 2 if any(".linear_fc1." in n for n in experts) else 1  # the families' experts are gated
    if "gate_up_proj" in (cfg["target_parameters"] or []) and parts > 1:  # one rank-r adapter for gate and up each
        cfg["rank_pattern"] = {r".*\.gate_up_proj": parts * config.rank}
        cfg["alpha_pattern"] = {r".*\.gate_up_proj": parts * config.alpha}
    with open(out / CONFIG_FILE, "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
        fh.write("\n")


def base_fingerprint(a: Arch) -> dict[str, Any]:
    """The base model an adapter was trained on, as ``save_peft_adapter`` records it in the
    safetensors metadata (``fnppo_base``): its architecture (family, sizes, biases, tying, MoE
    layout), what an adapter's numbers mean only on."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(a).items()}


def _check_base(fn: str, weights: Path, a: Arch) -> None:
    """Refuse an adapter that fnppo saved for another base model (PEFT's own files carry no record)."""
    with open_safetensors(fn, "path", weights) as fh:
        recorded = (fh.metadata() or {}).get(BASE_KEY)
    if recorded is None:
        return
    try:
        theirs = json.loads(recorded)
    except ValueError:
        theirs = None
    if not isinstance(theirs, dict):  # a damaged file: the record fnppo wrote is a JSON object
        raise checkpoint_error(
            fn, "path", f"a JSON object as the {BASE_KEY} record of {WEIGHTS_FILE}", f"{recorded[:80]!r} in {weights}"
        )
    mine = base_fingerprint(a)
    order = ["family", *(k for k in mine if k != "family")]  # the family first
    differ = {k: (theirs.get(k), mine[k]) for k in order if theirs.get(k) != mine[k]}
    if differ:
        first = ", ".join(f"{k}={t!r} (the model's {m!r})" for k, (t, m) in list(differ.items())[:4])
        raise input_error(fn, "path", "an adapter saved for this base model", f"one saved for a base with {first}")


def _read_config(fn: str, path: Path) -> dict[str, Any]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise input_error(fn, "path", f"a directory with {CONFIG_FILE}", repr(str(path)))
    cfg = read_json_object(fn, "path", file, f"a JSON object in {CONFIG_FILE}")  # CheckpointError: a damaged file
    checks = (
        ("peft_type", "LORA", cfg.get("peft_type")),
        ("use_dora", False, bool(cfg.get("use_dora", False))),
        ("use_rslora", False, bool(cfg.get("use_rslora", False))),
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
    for key in ("rank_pattern", "alpha_pattern"):  # only the fused experts' (PEFT's conversion writes them)
        bad = [p for p in (cfg.get(key) or {}) if not p.endswith(tuple(PARAMS.values()))]
        if bad:
            raise input_error(
                fn, f"{CONFIG_FILE}[{key!r}]", f"patterns for {sorted(PARAMS.values())} only", repr(cfg.get(key))
            )
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise input_error(fn, f"{CONFIG_FILE}[{key!r}]", "a finite number > 0", repr(value))
    return cfg


def lora_config_from_peft(path: str | os.PathLike, **changes: Any) -> LoRAConfig:
    """The :class:`~fnppo.megatron.lora.LoRAConfig` of a PEFT adapter directory (rank, alpha,
    dropout, and the Megatron targets its ``target_modules`` name), with ``changes`` applied.

    ``target_parameters`` (the fused experts' ``gate_up_proj`` / ``down_proj``) adapt the experts'
    ``linear_fc1`` / ``linear_fc2`` (``experts=True``).

    Raises:
        InputError: not a LoRA adapter PEFT's way (DoRA, rsLoRA, per-module ranks other than the
            fused experts', biases, ``modules_to_save``, ...: each named), target modules or parameters
            no Megatron target holds.
        CheckpointError: an ``adapter_config.json`` that cannot be read or is no JSON object (truncated,
            corrupt), naming the file and the cause (:mod:`fnppo.io.files`).
    """
    fn = "fnppo.lora.lora_config_from_peft"
    cfg = _read_config(fn, Path(path))
    names = cfg.get("target_modules") or []
    names = [names] if isinstance(names, str) else list(names)
    params = list(cfg.get("target_parameters") or [])
    known = {m: t for t, ms in _HF_TARGETS.items() for m in ms}
    unknown = [n for n in names if n not in known]
    if unknown or not (names or params):
        raise input_error(fn, f"{CONFIG_FILE}['target_modules']", f"names from {sorted(known)}", repr(names))
    fused = {v: k for k, v in PARAMS.items()}
    bad = [p for p in params if p.rpartition(".")[2] not in fused]
    if bad:
        raise input_error(fn, f"{CONFIG_FILE}['target_parameters']", f"names from {sorted(fused)}", repr(params))
    wanted = {known[n] for n in names} | {fused[p.rpartition(".")[2]] for p in params}
    targets = tuple(t for t in TARGETS if t in wanted)
    fields = dict(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), dropout=float(cfg.get("lora_dropout", 0.0)))
    fields.update(targets=targets, experts=bool(params))
    fields.update(changes)
    return LoRAConfig(**fields)


def _from_peft(
    a: Arch,
    kind: str,
    modules: tuple[str, ...],
    peft: dict[str, Tensor],
    rank: int,
    shapes: dict,
    inputs: int,
    targeted: set[str],
) -> tuple[Tensor, Tensor, list[str]]:
    """(A, B) of one fnppo adapter from PEFT's tensors (a projection PEFT does not adapt: zeros), and
    the PEFT keys used."""
    used, As, Bs = [], [], {}
    for m in modules:
        ka, kb = f"{_PREFIX}{m}.lora_A.weight", f"{_PREFIX}{m}.lora_B.weight"
        if (ka in peft) != (kb in peft):
            raise input_error(_LOAD, "path", f"both {ka} and {kb}", f"only {ka if ka in peft else kb}")
        if ka in peft and kb in peft:
            want = {ka: (rank, inputs), kb: (shapes[m + ".weight"][0], rank)}
            for key, shape in want.items():
                if tuple(peft[key].shape) != shape:
                    raise input_error(
                        _LOAD, f"PEFT tensor {key}", f"shape {shape} (the model's)", str(tuple(peft[key].shape))
                    )
            As.append(peft[ka].float())
            Bs[m + ".weight"] = peft[kb].float()
            used += [ka, kb]
        elif m.rpartition(".")[2] in targeted:
            raise input_error(
                _LOAD, "path", f"the adapter of {m} (its target_modules name {m.rpartition('.')[2]!r})", "no tensors"
            )
        else:
            As.append(torch.zeros(rank, inputs))
            Bs[m + ".weight"] = torch.zeros(shapes[m + ".weight"][0], rank)
    weights = tuple(m + ".weight" for m in modules)

    def read(name: str, idx: Any) -> Tensor:
        return Bs[name] if idx is None else Bs[name][idx]

    rows = sum(shapes[w][0] for w in weights)
    b = read_shard(read, a, kind, weights, torch.empty(rows, rank, device="meta"), 1, 0, a.padded_vocab)
    return torch.cat(As, dim=0), b, used


def load_peft_adapter(model_chunks: Sequence[nn.Module], path: str | os.PathLike) -> list[str]:
    """Load a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``, as
    ``PeftModel.save_pretrained`` writes it) into a model with adapters (:func:`fnppo.lora.apply_lora`
    with the adapter's rank and alpha, e.g. from :func:`lora_config_from_peft`).

    Collective: every rank reads the file and loads its shard (:func:`fnppo.megatron.weights.load_full_weights`
    with ``adapters=True``; all ranks load or none does). A projection of an adapted Megatron linear
    that PEFT does not adapt (e.g. ``k_proj`` when PEFT targets ``q_proj`` and ``v_proj``) gets a zero
    adapter.

    Returns:
        The model's adapter names (full, 1-rank) that PEFT's file did not fill at all.

    Raises:
        InputError: a model without adapters, or whose rank or alpha differ from the file's; a file
            that fnppo saved for another base model (its ``fnppo_base`` record: family, sizes, MoE layout); a file
            that is not PEFT's LoRA (see :func:`lora_config_from_peft`); PEFT tensors that no adapter
            of the model takes.
        CheckpointError: a damaged file (``adapter_config.json``, ``adapter_model.safetensors`` or its
            ``fnppo_base`` record: truncated, corrupt), naming the file and the cause; nothing loaded.
    """
    fn = _LOAD
    src = Path(path)
    cfg = _read_config(fn, src)
    config = lora_config_of(model_chunks)
    if config is None:
        raise input_error(fn, "model_chunks", "a model with adapters (fnppo.lora.apply_lora)", "no adapters")
    for key, mine in (("r", config.rank), ("lora_alpha", config.alpha)):
        if float(cfg.get(key, -1)) != float(mine):
            raise input_error(fn, f"{CONFIG_FILE}[{key!r}]", f"{mine} (the model's adapters)", repr(cfg.get(key)))
    weights = src / WEIGHTS_FILE
    if not weights.is_file():
        raise input_error(fn, "path", f"a directory with {WEIGHTS_FILE}", repr(str(src)))
    peft = load_safetensors(fn, "path", weights)
    a = model_arch(fn, model_chunks)
    _check_base(fn, weights, a)
    shapes = expected_hf_shapes(a, a.padded_vocab)
    layout = current_layout()
    names = cfg.get("target_modules") or []
    some_layers = cfg.get("layers_to_transform") is not None or cfg.get("exclude_modules")
    # the projections the file must hold in every layer (a regex or a layer selection: not checked)
    targeted = set() if isinstance(names, str) or some_layers else set(names)
    full: dict[str, Tensor] = {}
    used: set[str] = set()
    empty: list[str] = []
    wanted = {}
    for chunk in model_chunks:
        core = unwrap_model(chunk)
        for name, param in named_weights(core, adapters=True):
            gname = global_name(core, name)
            if ".experts." in gname:
                wanted[gname] = full_shape(param, tp_of(param, layout)[0])
    experts, expert_keys = from_peft_experts(
        fn, cfg, peft, wanted, a.experts, config.rank, config.scaling, strict=not some_layers
    )
    full.update(experts)
    used.update(expert_keys)
    empty += sorted(set(wanted) - set(experts))
    for chunk in model_chunks:
        core = unwrap_model(chunk)
        for name, param in named_weights(core, adapters=True):
            gname = global_name(core, name)
            if not gname.endswith(".lora_A") or ".experts." in gname:
                continue
            kind, modules = _modules(fn, a, gname)
            inputs = full_shape(param, tp_of(param, layout)[0])[1]
            lora_a, lora_b, keys = _from_peft(a, kind, modules, peft, config.rank, shapes, inputs, targeted)
            full[gname], full[gname[: -len("A")] + "B"] = lora_a, lora_b
            used.update(keys)
            if not keys:
                empty += [gname, gname[: -len("A")] + "B"]
    everyone: list[Any] = [used]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, used)
    unused = sorted(set(peft) - set().union(*everyone))
    if unused:
        raise input_error(fn, "path", "PEFT tensors of the model's adapted projections", f"unused tensors {unused[:4]}")
    for gname in set(wanted) - set(full):  # experts PEFT does not adapt: zero adapters
        full[gname] = torch.zeros(wanted[gname])
    load_full_weights(model_chunks, full, strict=False, adapters=True)
    return sorted(empty)
