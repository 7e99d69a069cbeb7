"""Atomic, layout-checked checkpoints of a :class:`~fnppo.steps.config.TrainState` (torch files per rank).

``state`` may also be a mapping of names to train states (e.g. ``{"policy": ..., "critic": ...}``
for PPO with a critic): they are saved into the same rank files under one manifest, so the
checkpoint holds all of them or, when incomplete, none.

Layout of a checkpoint directory::

    <dir>/rank00000.pt ... rank<N-1>.pt   model chunks, optimizer (incl. this DP rank's shard of the
                                          distributed optimizer state), RNG states, user extras
    <dir>/manifest.json                   written last: layout (TP/PP/DP/VPP, EP/ETP, CP), model
                                          shape, step, file sizes + sha256, the experts of each file

Every file is written to a temporary name and renamed into place; the manifest is renamed last,
after a barrier, so a directory without a manifest is an incomplete checkpoint and is refused.
Loading checks the manifest (layout, model shape, sizes, checksums) before touching any state, so
a truncated file, another TP/PP/DP/EP/CP layout or another model shape is refused with a clear
message and nothing is loaded partially.

Mixture-of-Experts models: each rank's file holds the experts of its expert-parallel rank only
(``local_experts.<i>`` of Megatron's state dict is global expert ``ep_rank * E / ep + i``); the
manifest records that range per file (``"experts": [first, end)``, ``{name: [first, end)}`` for
several train states; it follows from the layout,
which a load checks, EP and ETP included). The distributed optimizer's state of expert parameters is sharded
over the expert-data-parallel group and saved the same way as the dense state (per rank).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from fnppo.core.errors import input_error
from fnppo.megatron.parallel import current_layout
from fnppo.megatron.unwrap import unwrap_model

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_checkpoint"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the current run. Its message has the
    one format of every refusal: ``<function>: argument '<argument>' expected <what>, received <what>``."""


def _error(fn: str, arg: str, expected: str, received: str) -> CheckpointError:
    """The standard message (:func:`fnppo.core.errors.input_error`'s) as a :class:`CheckpointError`."""
    return CheckpointError(str(input_error(fn, arg, expected, received)))


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    try:
        out["megatron"] = {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()
        }
    except Exception:  # noqa: BLE001 - tracker not initialized
        pass
    return out


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "megatron" in state:
        tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["megatron"]))


def _layout_dict() -> dict[str, int]:
    lay = current_layout()
    return {
        "world_size": lay.world_size,
        "tp": lay.tp,
        "pp": lay.pp,
        "dp": lay.dp,
        "vpp": lay.vpp or 0,
        "ep": lay.ep,
        "etp": lay.etp,
        "cp": lay.cp,
    }


def _saved_layout(manifest: Mapping[str, Any]) -> dict[str, int] | None:
    """The manifest's layout; one written before EP/ETP/CP were recorded had ep = cp = 1, etp = tp."""
    saved = manifest.get("layout")
    if not isinstance(saved, Mapping):
        return None
    return {"ep": 1, "etp": saved.get("tp", 1), "cp": 1, **saved}


def _expert_range(state) -> list[int] | None:
    """``[first, end)``: the global experts this rank holds (its EP rank's), None for a dense model."""
    if isinstance(state, Mapping):  # several train states: {name: range} of those with experts
        ranges = {key: _expert_range(one) for key, one in state.items()}
        return {key: r for key, r in ranges.items() if r is not None} or None
    config = unwrap_model(state.model[0]).config
    experts = getattr(config, "num_moe_experts", None)
    if not experts:
        return None
    lay = current_layout()
    per = experts // lay.ep
    return [lay.ep_rank * per, (lay.ep_rank + 1) * per]


def _named(state) -> dict[str, Any]:
    """``{name: TrainState}`` of a mapping; ``{"": state}`` of one train state."""
    return dict(state) if isinstance(state, Mapping) else {"": state}


def _model_shapes(state) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for key, one in _named(state).items():
        prefix = f"{key}/" if key else ""
        for i, chunk in enumerate(one.model):
            for name, p in unwrap_model(chunk).named_parameters():
                shapes[f"{prefix}{i}.{name}"] = list(p.shape)
    return shapes


def _state_payload(state) -> dict[str, Any]:
    return {
        "step": state.step,
        "model": [unwrap_model(c).state_dict() for c in state.model],
        "optimizer": _optimizer_state(state.optimizer),
    }


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_write_bytes(path: Path, write) -> None:  # noqa: ANN001
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sub_optimizers(optimizer: Any) -> list[Any]:
    """Megatron wraps its optimizers in a ChainedOptimizer; the state lives in the parts."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _optimizer_state(optimizer: Any) -> dict[str, Any]:
    """``state_dict()`` plus, for each distributed optimizer, this DP rank's parameter-state shard."""
    out: dict[str, Any] = {"state_dict": optimizer.state_dict(), "param_state": []}
    for sub in _sub_optimizers(optimizer):
        has = hasattr(sub, "get_parameter_state_dp_reshardable")
        out["param_state"].append(sub.get_parameter_state_dp_reshardable() if has else None)
    return out


def _load_optimizer_state(optimizer: Any, saved: Mapping[str, Any]) -> None:
    optimizer.load_state_dict(saved["state_dict"])
    subs = _sub_optimizers(optimizer)
    if len(saved["param_state"]) != len(subs):
        raise _error(
            "load_checkpoint",
            "state",
            f"an optimizer of {len(saved['param_state'])} parts (the checkpoint's)",
            f"an optimizer of {len(subs)} parts",
        )
    for sub, param_state in zip(subs, saved["param_state"]):
        if param_state is None:
            continue
        for gbuf_idx, by_dtype in param_state.items():
            if not isinstance(gbuf_idx, int):
                continue
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for elem in bucket:
                        elem.setdefault("padding", False)
        with torch.no_grad():  # main params may be views of the model's (fp32 models)
            sub.load_parameter_state_from_dp_reshardable(param_state)
    # Megatron's load gives every parameter the *same* Adam 'step' tensor; torch's Adam increments
    # each parameter's step in place, so a shared tensor would advance once per parameter.
    for sub in subs:
        inner = getattr(sub, "optimizer", None)
        for st in getattr(inner, "state", {}).values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()


def save_checkpoint(directory: str | os.PathLike, state, *, extra: Mapping[str, Any] | None = None) -> Path:
    """Save ``state`` (model chunks, optimizer, step) plus RNG states and ``extra`` to ``directory``.

    ``state``: a :class:`~fnppo.steps.config.TrainState`, or a mapping of names to train states (all in the
    same files, one manifest; its ``step`` is the first state's). Collective: every rank writes its
    own file; rank 0 writes the manifest last. Returns the path.
    """
    path = Path(directory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    path.mkdir(parents=True, exist_ok=True)
    named = _named(state)
    if isinstance(state, Mapping) and not (named and all(isinstance(k, str) and k for k in named)):
        raise _error(
            "save_checkpoint",
            "state",
            "a TrainState or a non-empty mapping of non-empty names to train states",
            repr(list(named)),
        )
    first = next(iter(named.values()))
    payload: dict[str, Any] = {"rng": _rng_state(), "extra": dict(extra or {})}
    if isinstance(state, Mapping):
        payload.update(step=first.step, states={k: _state_payload(v) for k, v in named.items()})
    else:
        payload.update(_state_payload(state))
    fname = path / f"rank{rank:05d}.pt"
    _atomic_write_bytes(fname, lambda f: torch.save(payload, f))
    info = {
        "file": fname.name,
        "size": fname.stat().st_size,
        "sha256": _sha256(fname),
        "shapes": _shapes_digest(state),
        "experts": _expert_range(state),
    }
    infos: list[Any] = [info]
    if dist.is_initialized() and world > 1:
        infos = [None] * world
        dist.all_gather_object(infos, info)
    if rank == 0:
        manifest = {
            "format": "fnppo-checkpoint-1",
            "step": first.step,
            "layout": _layout_dict(),
            "files": infos,
        }
        if isinstance(state, Mapping):
            manifest["states"] = list(named)
        _atomic_write_bytes(path / "manifest.json", lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    if dist.is_initialized() and world > 1:
        dist.barrier()
    return path


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint (one with a manifest) with the highest step under ``root``, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for d in root.iterdir():
        m = d / "manifest.json"
        if d.is_dir() and m.is_file():
            try:
                step = int(json.loads(m.read_text())["step"])
            except (ValueError, KeyError, json.JSONDecodeError):
                continue
            if best is None or step > best[0]:
                best = (step, d)
    return None if best is None else best[1]


def _validate(path: Path, rank: int, state) -> str | None:
    """Why this rank cannot load ``path`` (the full message), None if it can. Reads no state into the model."""

    def refuse(arg: str, expected: str, received: str) -> str:
        return str(_error("load_checkpoint", arg, expected, received))

    if not path.exists():
        return refuse("directory", "an existing checkpoint directory", f"{str(path)!r}, which does not exist")
    if not path.is_dir():
        return refuse("directory", "a checkpoint directory", f"{str(path)!r}, which is not a directory")
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        return refuse(
            "directory",
            "a complete checkpoint (a directory with manifest.json)",
            f"{str(path)!r}, which has no manifest.json (an interrupted save, or not a checkpoint)",
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return refuse(
            "directory", "a manifest.json holding JSON", f"{str(manifest_path)!r}, which is not valid JSON ({err})"
        )
    if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), list)):
        return refuse(
            "directory",
            "a manifest.json of fnppo (an object with a list of rank 'files')",
            f"{str(manifest_path)!r} holding {type(manifest).__name__} without them",
        )
    names = list(state) if isinstance(state, Mapping) else None
    if manifest.get("states") != names:
        saved = manifest.get("states") or "of one TrainState"
        passed = names or "one TrainState"
        return refuse(
            "state",
            "the train states the checkpoint holds",
            f"other ones (checkpoint holds the train states {saved}, this run passes {passed})",
        )
    layout = _layout_dict()
    if _saved_layout(manifest) != layout:
        return refuse(
            "directory",
            f"a checkpoint of this run's layout {layout}",
            f"checkpoint layout {manifest.get('layout')}; convert it first "
            "(gather_full_weights, then load_full_weights in the new layout)",
        )
    files = manifest["files"]
    if rank >= len(files):
        return refuse("directory", f"a rank file for rank {rank}", f"a checkpoint of {len(files)} rank files")
    info = files[rank]
    fname = path / info["file"]
    if not fname.is_file():
        return refuse(
            "directory",
            f"the rank file {str(fname)!r} that the manifest lists",
            f"a checkpoint where {fname} is missing",
        )
    if fname.stat().st_size != info["size"]:
        return refuse(
            "directory",
            f"{str(fname)!r} of {info['size']} bytes (the manifest's)",
            f"{fname.stat().st_size} bytes: {fname} is truncated or altered",
        )
    if _sha256(fname) != info["sha256"]:
        return refuse(
            "directory",
            f"{str(fname)!r} with the sha256 of the manifest",
            f"a file whose sha256 differs from the manifest: {fname} is altered",
        )
    if info.get("shapes") != _shapes_digest(state):
        first = _first_shape_difference(fname, state)
        return refuse(
            "state",
            f"the model shape of the checkpoint (rank {rank})",
            f"a model that differs from the checkpoint's on rank {rank}: {first}",
        )
    return None


def _saved_shapes(fname: Path, state) -> dict[str, list[int]]:
    """The parameter-and-buffer shapes in the rank file ``fname``, named like :func:`_model_shapes`
    (tensors memory-mapped, not read)."""
    payload = torch.load(fname, map_location="cpu", weights_only=False, mmap=True)
    saved = payload["states"] if isinstance(state, Mapping) else {"": payload}
    out: dict[str, list[int]] = {}
    for key, part in saved.items():
        prefix = f"{key}/" if key else ""
        for i, sd in enumerate(part["model"]):
            for name, t in sd.items():
                if isinstance(t, torch.Tensor) and not name.endswith("_extra_state"):
                    out[f"{prefix}{i}.{name}"] = list(t.shape)
    return out


def _first_shape_difference(fname: Path, state) -> str:
    """The first parameter whose shape differs between the rank file and ``state`` (absent on one side
    included), with both shapes."""
    ours = _model_shapes(state)
    try:
        saved = _saved_shapes(fname, state)
    except Exception as err:  # noqa: BLE001 - the digests still tell that they differ
        return f"parameter names/shapes digest {_shapes_digest(state)} (the rank file cannot be read: {err})"
    buffers = {
        f"{f'{key}/' if key else ''}{i}.{name}"
        for key, one in _named(state).items()
        for i, chunk in enumerate(one.model)
        for name, _ in unwrap_model(chunk).named_buffers()
    }
    for name, shape in ours.items():
        if saved.get(name) != shape:
            return f"parameter {name!r}: checkpoint {saved.get(name, 'absent')}, this model {shape}"
    for name, shape in saved.items():
        if name not in ours and name not in buffers:
            return f"parameter {name!r}: checkpoint {shape}, this model absent"
    return "the parameter names/shapes digests differ"


def _shapes_digest(state) -> str:
    return hashlib.sha256(json.dumps(_model_shapes(state), sort_keys=True).encode()).hexdigest()[:16]


def load_checkpoint(directory: str | os.PathLike, state):
    """Restore model, optimizer, RNG states and step from ``directory`` into ``state``'s objects.

    ``state``: a :class:`~fnppo.steps.config.TrainState`, or the same mapping of names to train states that
    was saved. Returns ``(state, extra)`` (a new mapping for a mapping). Raises
    :class:`CheckpointError` (nothing loaded), on every rank, in the standard format
    ``load_checkpoint: argument 'directory' expected ..., received ...``: the directory does not
    exist or is no directory, its manifest is missing (an interrupted save) or not JSON, the layout
    differs from the current run's, a rank file is missing, truncated or altered (size, sha256); and
    ``argument 'state' ...``: other train-state names, or another model shape (it names the first
    differing parameter with the checkpoint's shape and this model's).
    """
    path = Path(directory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = _validate(path, rank, state)
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    if problem:
        raise CheckpointError(problem)
    manifest = json.loads((path / "manifest.json").read_text())
    fname = path / manifest["files"][rank]["file"]
    payload = torch.load(fname, map_location="cpu", weights_only=False)
    saved = payload["states"] if isinstance(state, Mapping) else {"": payload}
    restored = {}
    for key, one in _named(state).items():
        part = saved[key]
        for chunk, sd in zip(one.model, part["model"]):
            core = unwrap_model(chunk)
            missing, unexpected = core.load_state_dict(sd, strict=False)
            missing = [m for m in missing if not m.endswith("_extra_state")]
            if missing or unexpected:
                raise _error(
                    "load_checkpoint",
                    "state",
                    "the names of the checkpoint's model state",
                    f"a model state missing {missing[:5]} and not expecting {unexpected[:5]}",
                )
        _load_optimizer_state(one.optimizer, part["optimizer"])
        restored[key] = dataclasses.replace(one, step=int(part["step"]))
    _set_rng_state(payload["rng"])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return (restored if isinstance(state, Mapping) else restored[""]), payload["extra"]
