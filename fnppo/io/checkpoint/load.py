"""``load_checkpoint``: a checkpoint of :func:`save_checkpoint`, read under this run's layout (any layout).

Before anything is loaded, every rank agrees that the checkpoint is whole (its manifest, every file's
size and sha256), holds the train states passed, and has every tensor this model asks for with the
same global shape (Megatron's sharded keys; the first difference is named). Then Megatron's
``dist_checkpointing.load`` reads each rank's part (resharding model and optimizer state to this
layout), the model chunks and the optimizer load it, and the RNG states are restored: every rank's own
under the layout it was saved in; under another layout, every rank gets saved rank 0's CPU generators
(torch, Python, NumPy, CUDA: ranks that must draw alike, such as TP peers, do) and keeps the Megatron
trackers that ``init_parallel`` seeded for its new position.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

from fnppo.io.checkpoint.base import base_problem, base_record
from fnppo.io.checkpoint.content import (
    drop_filled_state,
    fill_empty_adam_state,
    layout_record,
    lora_base_params,
    model_sharded_state_dict,
    named_states,
    optimizer_sharded_state_dict,
    quiet_checkpointing,
    rng_object,
    set_rng_state,
    sub_optimizers,
)
from fnppo.io.checkpoint.latest import clean_before_reading
from fnppo.io.checkpoint.manifest import CheckpointError, check_files, checkpoint_error, read_manifest
from fnppo.megatron.state import TrainState, TrainStates
from fnppo.megatron.unwrap import unwrap_model

__all__ = ["load_checkpoint"]


def _gather(value: Any) -> list[Any]:
    if dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _raise_first(problem: str | None) -> None:
    """Raise the first rank's problem on every rank (collective)."""
    found = next((p for p in _gather(problem) if p), None)
    if found:
        raise CheckpointError(found)


def _check_names(manifest: Mapping[str, Any], state: TrainStates) -> str | None:
    names = list(state) if isinstance(state, Mapping) else None
    if manifest.get("states") == names:
        return None
    saved = manifest.get("states") or "of one TrainState"
    passed = names or "one TrainState"
    return str(
        checkpoint_error(
            "load_checkpoint",
            "state",
            "the train states the checkpoint holds",
            f"other ones (checkpoint holds the train states {saved}, this run passes {passed})",
        )
    )


def _check_bases(manifest: Mapping[str, Any], named: Mapping[str, TrainState]) -> str | None:
    """The first train state whose LoRA base differs from the one its adapters were saved on
    (collective: every rank computes the same records)."""
    saved = manifest.get("lora_bases") or {}
    for name, one in named.items():
        problem = base_problem(saved.get(name), base_record(one.model))
        if problem:
            arg = f"state[{name!r}]" if name else "state"
            return str(
                checkpoint_error(
                    "load_checkpoint", arg, "the base model the checkpoint's adapters were trained on", problem
                )
            )
    return None


def _saved_shapes(path: Path) -> dict[str, list[int]]:
    """Global shape of every tensor in the checkpoint, by Megatron's sharded key."""
    return {k: list(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(str(path)).items()}


def _requested_shapes(model_sds: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Global shape of every tensor the models ask for (factories applied), by sharded key, in model order."""
    out: dict[str, list[int]] = {}
    for sd in model_sds:
        pre, _, _ = load_preprocess(sd)
        for sh in nested_values(pre):
            if isinstance(sh, ShardedTensor):
                out.setdefault(sh.key, list(sh.global_shape))
    return out


def _check_shapes(path: Path, model_sds: list[dict[str, Any]]) -> str | None:
    saved = _saved_shapes(path)
    for key, shape in _requested_shapes(model_sds).items():
        if saved.get(key) != shape:
            return str(
                checkpoint_error(
                    "load_checkpoint",
                    "state",
                    "a model of the checkpoint's parameter names and global shapes",
                    f"a model that differs from the checkpoint's: parameter {key!r}: checkpoint "
                    f"{saved.get(key, 'absent')}, this model {shape}",
                )
            )
    return None


def _unshare_steps(optimizer: Any) -> None:
    """Megatron's load gives every parameter the *same* Adam 'step' tensor; torch's Adam increments each
    parameter's step in place, so a shared tensor would advance once per parameter: one copy each."""
    for sub in sub_optimizers(optimizer):
        for st in getattr(getattr(sub, "optimizer", None), "state", {}).values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()


def _load_optimizer(optimizer: Any, loaded: Mapping[str, Any], index: list[list[int]] | None) -> None:
    """Load what :func:`optimizer_sharded_state_dict` asked for into ``optimizer``.

    For each distributed part: the param groups (Megatron picks the part's own by its group keys; this
    sets 'step'), then the parameter state in the part's order, with the 'step' entries set aside (Megatron's
    ``fully_reshardable`` load copies every key of a parameter's state, 'step' included, from tensors that
    have none; torch's Adam keeps a 'step' per parameter)."""
    if loaded["kind"] != "distributed" or index is None:
        optimizer.load_state_dict(loaded["state"])
        _unshare_steps(optimizer)
        return
    common = {"optimizer": {"param_groups": loaded["param_groups"]}}
    if "grad_scaler" in loaded:
        common["grad_scaler"] = loaded["grad_scaler"]
    for i, (sub, part) in enumerate(zip(sub_optimizers(optimizer), index, strict=True)):
        sub.load_state_dict(common)
        inner = sub.optimizer.state
        steps = {p: st.pop("step") for p, st in inner.items() if "step" in st}
        try:
            sub.load_parameter_state_from_fully_reshardable({k: loaded["param_state"][i][k] for k in part})
        finally:
            for p, step in steps.items():
                inner[p]["step"] = step
    _unshare_steps(optimizer)


def _strip(sd: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :] if prefix and k.startswith(prefix) else k: v for k, v in sd.items()}


def _load_model(one: TrainState, loaded: Mapping[str, Any], prefix: str) -> None:
    skip = lora_base_params(one.model)
    for i, chunk in enumerate(one.model):
        core = unwrap_model(chunk)
        missing, unexpected = core.load_state_dict(_strip(loaded[f"chunk{i}"], prefix), strict=False)
        skipped = {n for n, p in core.named_parameters() if id(p) in skip}
        missing = [m for m in missing if not m.endswith("_extra_state") and m not in skipped]
        if missing or unexpected:
            raise checkpoint_error(
                "load_checkpoint",
                "state",
                "the names of the checkpoint's model state",
                f"a model state missing {missing[:5]} and not expecting {unexpected[:5]}",
            )


def load_checkpoint(directory: str | os.PathLike, state: TrainStates) -> tuple[TrainStates, dict[str, Any]]:
    """Restore model, optimizer, RNG states and step from ``directory`` into ``state``'s objects.

    Any parallel layout loads a checkpoint saved under any other (TP, PP, VPP, DP, EP, CP); the same
    layout resumes bit for bit. ``state``: a :class:`~fnppo.megatron.state.TrainState`, or the same
    mapping of names to train states that was saved. Parameters tagged ``fnppo_lora_base`` are not
    loaded (load the base weights first). Returns ``(state, extra)`` (a new mapping for a mapping).
    Raises :class:`CheckpointError` (nothing loaded), on every rank, in the standard format
    ``load_checkpoint: argument 'directory' expected ..., received ...``: the directory does not exist
    or is no directory, its manifest is missing (an interrupted save) or not JSON, a file is missing,
    truncated or altered (size, sha256); and ``argument 'state' ...``: other train-state names, or
    another model (it names the first parameter that is absent or of another global shape, with the
    checkpoint's shape and this model's); LoRA adapters saved on another base model (it names the
    architecture entries or the base weights that differ: :mod:`fnppo.io.checkpoint.base`).
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise checkpoint_error(
            "load_checkpoint", "directory", "a checkpoint directory path (str or os.PathLike)", f"{directory!r}"
        )
    path = Path(directory)
    named = named_states(state, "load_checkpoint")
    clean_before_reading(path.parent)
    rank = dist.get_rank()
    manifest, problem = None, None
    try:
        manifest = read_manifest(path)
        problem = _check_names(manifest, state)
    except CheckpointError as err:
        problem = str(err)
    _raise_first(problem)
    problem = check_files(path, manifest)
    if problem:
        raise CheckpointError(problem)
    _raise_first(_check_bases(manifest, named))
    prefixes = {name: f"{name}." if name else "" for name in named}
    model_sds = {name: model_sharded_state_dict(one, prefixes[name]) for name, one in named.items()}
    try:
        problem = _check_shapes(path, list(model_sds.values()))
    except Exception as err:  # noqa: BLE001 - an unreadable metadata file is a damaged checkpoint
        problem = str(
            checkpoint_error("load_checkpoint", "directory", "a readable checkpoint", f"{str(path)!r}: {err}")
        )
    _raise_first(problem)

    saved_layout = manifest.get("layout") or {}
    same_layout = saved_layout == layout_record()
    saved_world = int(saved_layout.get("world_size", 1))
    filled: list = []
    request: dict[str, Any] = {"states": {}}
    indexes: dict[str, Any] = {}
    try:
        for name, one in named.items():
            filled += fill_empty_adam_state(one.optimizer)  # Megatron's load needs allocated state
            opt_sd, indexes[name] = optimizer_sharded_state_dict(one.optimizer, model_sds[name], is_loading=True)
            request["states"][name] = {"model": model_sds[name], "optimizer": opt_sd}
            _unshare_steps(one.optimizer)
        src = rank if same_layout else 0  # another layout: one stream for all (TP/PP/CP peers must agree)
        request["rng"] = rng_object(None, src, saved_world)
        with quiet_checkpointing():
            loaded = dist_checkpointing.load(request, str(path), validate_access_integrity=False)
    except BaseException:
        drop_filled_state(filled)
        raise
    restored = {}
    for name, one in named.items():
        part = loaded["states"][name]
        _load_model(one, part["model"], prefixes[name])
        _load_optimizer(one.optimizer, part["optimizer"], indexes[name])
        restored[name] = dataclasses.replace(one, step=int(part["step"]))
    set_rng_state(loaded["rng"], trackers=same_layout)
    dist.barrier()
    extra = dict(loaded["fnppo"]["extra"])
    return (restored if isinstance(state, Mapping) else restored[""]), extra
