"""LoRA adapters in PEFT's on-disk format: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT (Hugging Face's ``peft`` library) stores one adapter per Hugging Face projection,
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``, with
``r``, ``lora_alpha`` (scaling ``lora_alpha / r``, ``/ sqrt(r)`` with ``use_rslora``),
``target_modules`` and per-module ``rank_pattern`` / ``alpha_pattern`` in ``adapter_config.json``.
fnppo's adapter of a fused Megatron linear holds one adapter per projection it fuses
(:mod:`fnppo.megatron.lora_linear`): ``A`` stacks the projections' ``A`` (query, key, value; gate,
up), ``B`` holds their rows in the base weight's layout (fused QKV per query group, ``[gate; up]``),
so the conversion is exact both ways: the rows of ``B`` are moved as the base weight's rows are
(:func:`fnppo.io.hf.layouts.to_hf` / :func:`~fnppo.io.hf.layouts.read_shard`).

:func:`save_peft_adapter` writes a model's adapters (collective; rank 0 writes);
:func:`load_peft_adapter` loads an adapter saved by ``peft`` (``PeftModel.save_pretrained``) into a
model built with the adapter's ranks and alphas; :func:`lora_config_from_peft`
(:mod:`fnppo.io.hf.peft_config`) reads the :class:`~fnppo.megatron.lora.LoRAConfig` to build that
model with. Ranks and alphas per module follow PEFT's rules (:mod:`fnppo.io.hf.peft_rules`).
Adapters inside MoE experts (``SequentialMLP`` or stacked experts, per expert or shared) are PEFT's
``target_parameters`` adapters of ``transformers`` 5's fused ``mlp.experts.gate_up_proj`` /
``down_proj``, in PEFT's fused form or fnppo's split one (:mod:`fnppo.io.hf.peft_experts`).
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

from fnppo.core.errors import CheckpointError, InputError, checkpoint_error, input_error
from fnppo.core.typing import Tensor
from fnppo.io.hf.arch import Arch, expected_hf_shapes, model_arch
from fnppo.io.hf.families import FAMILIES
from fnppo.io.hf.keys import param_rule
from fnppo.io.hf.layouts import read_shard, to_hf
from fnppo.io.hf.peft_config import (
    CONFIG_FILE,
    RECORD_KEY,
    WEIGHTS_FILE,
    adapted_names,
    file_values,
    hf_alpha,
    lora_config_from_peft,
    read_config,
    read_header,
    read_record,
    read_tensors,
)
from fnppo.io.hf.peft_experts import EXPERT_NAME, PARAMS, from_peft_expert, param_key, tensor_key, to_peft_expert
from fnppo.io.hf.peft_rules import names_parameter, write_patterns
from fnppo.megatron.lora import LoRAConfig, lora_config_of
from fnppo.megatron.parallel import current_layout
from fnppo.megatron.stacked_experts import named_weights
from fnppo.megatron.unwrap import unwrap_model
from fnppo.megatron.weights import full_shape, gather_full_weights, global_name, load_full_weights, tp_of

__all__ = ["save_peft_adapter", "load_peft_adapter", "lora_config_from_peft", "CONFIG_FILE", "WEIGHTS_FILE"]

_PREFIX = "base_model.model."
_LOAD = "fnppo.lora.load_peft_adapter"
#: the safetensors metadata key of the base model's record (:func:`base_fingerprint`)
BASE_KEY = "fnppo_base"
_EXPERT_LIKE = {"gate_proj", "up_proj", "down_proj"}


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
    ``peft.PeftModel.from_pretrained(hf_model, path)`` then computes what the fnppo model computes,
    without a warning.

    Expert adapters are written in PEFT's ``target_parameters`` form (:mod:`fnppo.io.hf.peft_experts`;
    a shared adapter as the same adapter for every expert), in the model's form
    (``LoRAConfig.expert_gate_up``), recorded in the safetensors metadata (``fnppo_lora``) so that
    :func:`lora_config_from_peft` builds the same form. Per-linear ranks and alphas (the split
    form's doubled ``gate_up_proj`` rank, ``LoRAConfig.overrides``) are written as ``rank_pattern`` /
    ``alpha_pattern`` whose keys each match an adapted module (:func:`fnppo.io.hf.peft_rules.write_patterns`;
    where there is none, an expert adapter is written zero-padded to one rank). PEFT's expert
    adapters take no dropout: with expert adapters ``lora_dropout`` is written 0 (the model's
    dropout is kept in the record). An adapter whose ``B`` is all zeros (it adds nothing, e.g. one
    PEFT did not adapt) is left out of the file (``target_parameters`` then names the layers'
    parameters one by one), unless all are (fresh adapters: all are written).

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
    error: list[Any] = [None]
    if current_layout().rank == 0:
        try:
            _write_peft(fn, a, config, full, Path(path), base_model_name_or_path)
        except InputError as err:  # a refusal (before anything is written): the same on every rank
            error[0] = ("input", str(err))
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            error[0] = ("write", f"{type(err).__name__}: {err}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None and error[0][0] == "input":
        raise InputError(error[0][1])
    if error[0] is not None:
        raise checkpoint_error(
            fn, "path", "a directory rank 0 can write the adapter into", f"{str(path)!r} ({error[0][1]})"
        )


def _dense(fn: str, a: Arch, config: LoRAConfig, full: dict[str, Tensor], zeros: bool) -> tuple[dict, dict, set[str]]:
    """PEFT's tensors of the dense adapters (``zeros``: those whose ``B`` is all zeros too), their
    modules' ``(rank, alpha)``, and the leaf names."""
    tensors: dict[str, Tensor] = {}
    values: dict[str, tuple[int, float]] = {}
    leaves: set[str] = set()
    for gname in sorted(n for n in full if n.endswith(".lora_A") and ".experts." not in n):
        b = full[gname[: -len("A")] + "B"]
        if not zeros and not bool(b.ne(0).any()):
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
        value = config.rank_alpha(gname.removesuffix(".lora_A"))
        values.update({m: value for m in modules})
        leaves.update(m.rpartition(".")[2] for m in modules)
    return tensors, values, leaves


def _per_expert(full: dict[str, Tensor], experts: int) -> dict[tuple[int, str, str], list[Tensor]]:
    """``(layer, projection, A/B)`` -> the ``experts`` per-expert tensors (a shared adapter repeated)."""
    out: dict[tuple[int, str, str], list[Any]] = {}
    for name, t in full.items():
        m = EXPERT_NAME.match(name)
        if m:
            slots = out.setdefault((int(m.group(1)), m.group(3), m.group(4)), [None] * experts)
            for j in range(experts) if m.group(2) is None else (int(m.group(2)),):
                slots[j] = t
    return out


def _experts(
    config: LoRAConfig, full: dict[str, Tensor], experts: int, modules: dict, zeros: bool
) -> tuple[dict, dict, dict]:
    """PEFT's tensors of the expert adapters (``zeros``: those whose ``B`` is all zeros too), their
    parameters' ``(rank, alpha)`` as written, and the record of those written zero-padded (name ->
    true ``[rank, alpha]``)."""
    stacks = _per_expert(full, experts)
    values, ranks = {}, {}
    for layer, proj, ab in stacks:
        if ab == "A" and (zeros or any(bool(b.ne(0).any()) for b in stacks[(layer, proj, "B")])):
            r, alpha = config.rank_alpha(f"decoder.layers.{layer}.mlp.experts.{proj}")
            parts = stacks[(layer, proj, "A")][0].shape[0] // r
            ranks[(layer, proj)] = r
            values[param_key(layer, PARAMS[proj])] = (parts * r, hf_alpha(alpha, parts, config.rslora))
    # ranks that no adapted module has: PEFT needs a rank_pattern key for all but one of them, and
    # warns about a key that matches parameters only; so all but the largest are written zero-padded
    only = sorted({v[0] for v in values.values()} - {v[0] for v in modules.values()})
    padded = {}
    if len(only) > 1:
        for name, (rank, alpha) in list(values.items()):
            if rank in only and rank != only[-1]:
                padded[name] = [rank, alpha]
                values[name] = (only[-1], hf_alpha(alpha, only[-1] / rank, config.rslora))
    tensors = {}
    for (layer, proj), r in sorted(ranks.items()):
        both = all((layer, p) in ranks for p in PARAMS)
        written = values[param_key(layer, PARAMS[proj])][0]
        a, b = to_peft_expert(stacks[(layer, proj, "A")], stacks[(layer, proj, "B")], r, written)
        tensors[tensor_key(layer, PARAMS[proj], both, "A")] = a
        tensors[tensor_key(layer, PARAMS[proj], both, "B")] = b
    return tensors, values, padded


def _target_parameters(params: dict[str, Any], moe_layers: Sequence[int]) -> list[str]:
    """``target_parameters`` naming exactly the written fused parameters: ``gate_up_proj`` where
    every MoE layer has it, else each layer's full name."""
    out = []
    for p in sorted(PARAMS.values()):
        layers = [i for i in moe_layers if param_key(i, p) in params]
        out += [p] if layers and layers == list(moe_layers) else [param_key(i, p) for i in layers]
    return out


def _write_peft(fn: str, a: Arch, config: LoRAConfig, full: dict[str, Tensor], out: Path, base: str | None) -> None:
    """Rank 0: PEFT's two files from the full adapters."""
    zeros = not any(bool(t.ne(0).any()) for n, t in full.items() if n.rpartition(".")[2].startswith("lora_B"))
    tensors, values, leaves = _dense(fn, a, config, full, zeros)  # all zero (fresh): written all the same
    expert_tensors, params, padded = _experts(config, full, a.experts, values, zeros)
    tensors.update(expert_tensors)
    r, alpha, rank_pattern, alpha_pattern = write_patterns({**values, **params}, set(values))
    record = {"expert_gate_up": config.expert_gate_up, "dropout": config.dropout, "padded": padded}
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    metadata = {"format": "pt", BASE_KEY: json.dumps(base_fingerprint(a)), RECORD_KEY: json.dumps(record)}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata=metadata)
    targets = _target_parameters(params, a.moe_layers)
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0 if targets else config.dropout,  # PEFT's expert adapters take no dropout
        "target_modules": sorted(leaves),
        "target_parameters": targets or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": config.rslora,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "base_model_name_or_path": base,
        "lora_bias": False,
    }
    with open(out / CONFIG_FILE, "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=2)
        fh.write("\n")


def base_fingerprint(a: Arch) -> dict[str, Any]:
    """The base model an adapter was trained on, as ``save_peft_adapter`` records it in the
    safetensors metadata (``fnppo_base``): its architecture (family, sizes, biases, tying, MoE
    layout), what an adapter's numbers mean only on."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(a).items()}


def _check_base(fn: str, metadata: dict[str, str], a: Arch) -> None:
    """Refuse an adapter that fnppo saved for another base model (PEFT's own files carry no record)."""
    recorded = metadata.get(BASE_KEY)
    if recorded is None:
        return
    try:
        theirs = json.loads(recorded)
    except ValueError:
        theirs = None
    if not isinstance(theirs, dict):  # a damaged file: the record fnppo wrote is a JSON object
        raise checkpoint_error(
            fn, "path", f"a JSON object as the {BASE_KEY} record of {WEIGHTS_FILE}", f"{recorded[:80]!r}"
        )
    mine = base_fingerprint(a)
    order = ["family", *(k for k in mine if k != "family")]  # the family first
    differ = {k: (theirs.get(k), mine[k]) for k in order if theirs.get(k) != mine[k]}
    if differ:
        first = ", ".join(f"{k}={t!r} (the model's {m!r})" for k, (t, m) in list(differ.items())[:4])
        raise input_error(fn, "path", "an adapter saved for this base model", f"one saved for a base with {first}")


def _check_value(name: str, file: tuple[int, float, int], rank: int, scaling: float, rslora: bool, linear: str) -> None:
    """Refuse a file whose adapter of ``name`` has another rank or scaling than the model's."""
    theirs = file[1] / (math.sqrt(file[0]) if rslora else file[0])
    if file[0] != rank or not math.isclose(theirs, scaling, rel_tol=1e-12):
        raise input_error(
            _LOAD,
            f"the rank and alpha of {name} ({CONFIG_FILE}: r, lora_alpha, rank_pattern, alpha_pattern)",
            f"rank {rank}, scaling {scaling:g} (the model's adapter of {linear}: build it with lora_config_from_peft)",
            f"rank {file[0]}, alpha {file[1]:g}, scaling {theirs:g}",
        )


def _from_peft(
    a: Arch,
    kind: str,
    modules: tuple[str, ...],
    peft: dict[str, Tensor],
    rank: int,
    shapes: dict,
    inputs: int,
    targeted: list[str],
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
        elif names_parameter(targeted, m):  # PEFT's rule for a list of target_modules: the name or a dotted tail
            name = next(t for t in targeted if m == t or m.endswith(f".{t}"))
            raise input_error(_LOAD, "path", f"the adapter of {m} (its target_modules name {name!r})", "no tensors")
        else:
            As.append(torch.zeros(rank, inputs))
            Bs[m + ".weight"] = torch.zeros(shapes[m + ".weight"][0], rank)
    weights = tuple(m + ".weight" for m in modules)

    def read(name: str, idx: Any) -> Tensor:
        return Bs[name] if idx is None else Bs[name][idx]

    rows = sum(shapes[w][0] for w in weights)
    b = read_shard(read, a, kind, weights, torch.empty(rows, rank, device="meta"), 1, 0, a.padded_vocab)
    return torch.cat(As, dim=0), b, used


def _load_experts(
    fn: str,
    cfg: dict[str, Any],
    peft: dict[str, Tensor],
    values: dict[str, tuple[int, float, int]],
    wanted: dict[str, tuple[int, ...]],
    experts: int,
    config: LoRAConfig,
) -> tuple[dict[str, Tensor], set[str]]:
    """fnppo's full expert adapters (the names and full shapes in ``wanted``) from PEFT's tensors, and
    the PEFT keys used. Every layer's fused parameter that ``target_parameters`` names must have its
    tensors; a shared adapter (no expert index) takes PEFT's only if all experts' are equal."""
    targets = list(cfg.get("target_parameters") or [])
    groups: dict[tuple[int, str], list[tuple[str, str | None, str, tuple[int, ...]]]] = {}
    for name, shape in wanted.items():
        m = EXPERT_NAME.match(name)
        if m:
            groups.setdefault((int(m.group(1)), m.group(3)), []).append((name, m.group(2), m.group(4), shape))
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for (layer, proj), members in sorted(groups.items()):
        key = param_key(layer, PARAMS[proj])
        if not names_parameter(targets, key):
            continue
        both = all(names_parameter(targets, param_key(layer, p)) for p in PARAMS.values())
        ka, kb = tensor_key(layer, PARAMS[proj], both, "A"), tensor_key(layer, PARAMS[proj], both, "B")
        if (ka in peft) != (kb in peft):
            raise input_error(fn, "path", f"both {ka} and {kb}", f"only {ka if ka in peft else kb}")
        if ka not in peft:
            raise input_error(fn, "path", f"the tensor {ka} (target_parameters names {key})", "none")
        linear = f"decoder.layers.{layer}.mlp.experts.{proj}"
        r, alpha = config.rank_alpha(linear)
        shape_a = next(s for _, _, ab, s in members if ab == "A")
        shape_b = next(s for _, _, ab, s in members if ab == "B")
        parts = shape_a[0] // r
        _check_value(key, values[key], parts * r, config.scaling_for(r, alpha), config.rslora, linear)
        shapes = ((shape_a[0], shape_a[1]), (shape_b[0], shape_b[1]))
        a_s, b_s = from_peft_expert(fn, (ka, kb), (peft[ka], peft[kb]), experts, shapes, parts, values[key][2])
        used.update((ka, kb))
        for name, e, ab, _ in members:
            ts = a_s if ab == "A" else b_s
            if e is not None:
                out[name] = ts[int(e)]
            elif all(torch.equal(t, ts[0]) for t in ts[1:]):
                out[name] = ts[0]
            else:
                raise input_error(
                    fn,
                    "path",
                    "per-expert adapters that are all equal for LoRAConfig(expert_layout='shared')",
                    f"different adapters of the experts of layer {layer} ({PARAMS[proj]})",
                )
    return out, used


def _read_peft(
    fn: str, model_chunks: Sequence[nn.Module], config: LoRAConfig, src: Path
) -> tuple[dict[str, Tensor], set[str], list[str], list[str]]:
    """This rank's full adapters from the directory ``src`` (every check before anything is loaded),
    the PEFT keys used, the model's adapters the file did not fill, and the file's keys."""
    cfg = read_config(fn, src)
    keys, metadata = read_header(fn, src)
    record = read_record(fn, metadata)
    a = model_arch(fn, model_chunks)
    _check_base(fn, metadata, a)
    if bool(cfg.get("use_rslora", False)) != config.rslora:
        raise input_error(fn, f"{CONFIG_FILE}['use_rslora']", f"{config.rslora} (the model's)", repr(cfg["use_rslora"]))
    modules, params = adapted_names(cfg, keys, list(a.moe_layers))
    values = file_values(fn, cfg, record, modules + params)
    peft = read_tensors(fn, src)
    shapes = expected_hf_shapes(a, a.padded_vocab)
    layout = current_layout()
    names = cfg.get("target_modules") or []
    # the projections the file must hold in every layer (a regex or a layer selection: not checked)
    some_layers = cfg.get("layers_to_transform") is not None or cfg.get("exclude_modules")
    targeted = [] if isinstance(names, str) or some_layers else list(names)
    wanted, dense = {}, []
    for chunk in model_chunks:
        core = unwrap_model(chunk)
        for name, param in named_weights(core, adapters=True):
            gname = global_name(core, name)
            if ".experts." in gname:
                wanted[gname] = full_shape(param, tp_of(param, layout)[0])
            elif gname.endswith(".lora_A"):
                dense.append((gname, full_shape(param, tp_of(param, layout)[0])[1]))
    full, used = _load_experts(fn, cfg, peft, values, wanted, a.experts, config)
    empty = sorted(set(wanted) - set(full))
    for gname, inputs in dense:
        kind, modules_of = _modules(fn, a, gname)
        linear = gname.removesuffix(".lora_A")
        r, alpha = config.rank_alpha(linear)
        for m in modules_of:
            if m in values:
                _check_value(m, values[m], r, config.scaling_for(r, alpha), config.rslora, linear)
        lora_a, lora_b, keys_used = _from_peft(a, kind, modules_of, peft, r, shapes, inputs, targeted)
        full[gname], full[gname[: -len("A")] + "B"] = lora_a, lora_b
        used.update(keys_used)
        if not keys_used:
            empty += [gname, gname[: -len("A")] + "B"]
    for gname in set(wanted) - set(full):  # experts PEFT does not adapt: zero adapters
        full[gname] = torch.zeros(wanted[gname])
    return full, used, sorted(empty), list(peft)


def load_peft_adapter(model_chunks: Sequence[nn.Module], path: str | os.PathLike) -> list[str]:
    """Load a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``, as
    ``PeftModel.save_pretrained`` writes it) into a model with adapters (:func:`fnppo.lora.apply_lora`
    with the adapter's ranks and alphas, e.g. from :func:`lora_config_from_peft`).

    Collective: every rank reads the file and checks it against its part of the model; a refusal on
    any rank is raised on every rank, before anything is loaded; then every rank loads its shard
    (:func:`fnppo.megatron.weights.load_full_weights` with ``adapters=True``). A projection of an
    adapted Megatron linear that PEFT does not adapt (e.g. ``k_proj`` when PEFT targets ``q_proj``
    and ``v_proj``, or an MoE layer ``target_parameters`` does not name) gets a zero adapter.

    Returns:
        The model's adapter names (full, 1-rank) that PEFT's file did not fill at all.

    Raises:
        InputError: a model without adapters; an adapted module or parameter whose rank or scaling
            (by PEFT's rules, :mod:`fnppo.io.hf.peft_rules`) differ from the model's adapter of it; a
            file that fnppo saved for another base model (its ``fnppo_base`` record: family, sizes,
            MoE layout); a file that is not PEFT's LoRA (see :func:`lora_config_from_peft`); tensors
            missing, of other shapes, or that no adapter of the model takes; a split-form expert
            ``gate_up_proj`` adapter whose ``B`` mixes gate and up.
        CheckpointError: an unreadable (truncated, corrupt) ``adapter_config.json`` or
            ``adapter_model.safetensors``, naming the path and the cause.
    """
    fn = _LOAD
    config = lora_config_of(model_chunks)
    if config is None:
        raise input_error(fn, "model_chunks", "a model with adapters (fnppo.lora.apply_lora)", "no adapters")
    try:
        full, used, empty, keys = _read_peft(fn, model_chunks, config, Path(path))
        error = None
    except (InputError, CheckpointError) as err:
        full, used, empty, keys, error = {}, set(), [], [], (type(err) is CheckpointError, str(err))
    everyone: list[Any] = [(error, used)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (error, used))
    errors = [e for e, _ in everyone if e is not None]
    if errors:
        raise (CheckpointError if errors[0][0] else InputError)(errors[0][1])
    unused = sorted(set(keys) - set().union(*(u for _, u in everyone)))
    if unused:
        raise input_error(fn, "path", "PEFT tensors of the model's adapted projections", f"unused tensors {unused[:4]}")
    load_full_weights(model_chunks, full, strict=False, adapters=True)
    return empty
