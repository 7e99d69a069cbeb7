"""A checkpoint's manifest and integrity: what was written (sizes, sha256), how to check it, which is newest.

``manifest.json`` is written last into the temporary directory of a save, after every file is on
disk, and lists every other file of the checkpoint with its size and sha256, the step, the train
states' names and the parallel layout the checkpoint was saved under (a record, not a condition:
any layout loads it). A directory without one is not a checkpoint fnppo will load.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fnppo.core.errors import CheckpointError as CheckpointError
from fnppo.core.errors import checkpoint_error as checkpoint_error
from fnppo.io.files import json_kind, read_json

__all__ = [
    "CheckpointError",
    "MANIFEST",
    "FORMAT",
    "TMP_MARK",
    "checkpoint_error",
    "sha256",
    "file_entries",
    "read_manifest",
    "manifest_problem",
    "check_files",
    "verify_checkpoint",
    "report",
]

MANIFEST = "manifest.json"
FORMAT = "fnppo-checkpoint-2"  # Megatron distributed checkpoint (torch_dist) + this manifest
TMP_MARK = ".tmp-"  # a save in progress (or one that died): ".<name>.tmp-<id>" next to the final name
logger = logging.getLogger("fnppo.checkpoint")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(directory: Path) -> list[str]:
    """Every file under ``directory`` but the manifest, as sorted relative POSIX paths."""
    return sorted(
        p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def _share(names: Sequence[str]) -> list[str]:
    """This rank's part of ``names`` (every ``world``-th), so that the ranks hash a checkpoint together."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(names)
    return list(names[dist.get_rank() :: dist.get_world_size()])


def _gather(value: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def file_entries(directory: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` of every file under ``directory``, each fsync'ed first (the
    ranks share the work; collective when torch.distributed is initialized)."""
    names = _files(directory)
    mine: dict[str, dict[str, Any]] = {}
    for name in _share(names):
        path = directory / name
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        mine[name] = {"size": path.stat().st_size, "sha256": sha256(path)}
    out: dict[str, dict[str, Any]] = {}
    for part in _gather(mine):
        out.update(part)
    return dict(sorted(out.items()))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _file_entry_problem(name: Any, info: Any) -> str | None:
    """Why one ``files`` entry of a manifest is not ``{relative path: {"size": int, "sha256": hex}}``."""
    if not isinstance(name, str) or not name or name.startswith("/") or ".." in name.split("/") or name == MANIFEST:
        return f"a file name {name!r} (a relative path inside the checkpoint is expected)"
    if not isinstance(info, dict):
        return f"files[{name!r}] holding a JSON {json_kind(info)} (an object with the size and sha256 is expected)"
    if not _is_count(info.get("size")):
        return f"files[{name!r}]['size'] = {info.get('size')!r} (an int >= 0 is expected)"
    digest = info.get("sha256")
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        return f"files[{name!r}]['sha256'] = {digest!r} (64 hex digits are expected)"
    return None


def _base_entry_problem(name: str, entry: Any) -> str | None:
    """Why one ``lora_bases`` entry is not None or ``{"arch": obj|None, "dtype": str|None, "tensors": {...}}``."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        return f"lora_bases[{name!r}] holding a JSON {json_kind(entry)} (an object or null is expected)"
    if entry.get("arch") is not None and not isinstance(entry["arch"], dict):
        return f"lora_bases[{name!r}]['arch'] holding a JSON {json_kind(entry['arch'])} (an object or null is expected)"
    if entry.get("dtype") is not None and not isinstance(entry["dtype"], str):
        return f"lora_bases[{name!r}]['dtype'] = {entry['dtype']!r} (a dtype name is expected)"
    tensors = entry.get("tensors")
    if tensors is None:
        return None
    ok = isinstance(tensors, dict) and all(
        isinstance(v, list) and len(v) == 2 and all(isinstance(d, str) for d in v) for v in tensors.values()
    )
    return None if ok else f"lora_bases[{name!r}]['tensors'] not an object of digest pairs"


def manifest_problem(manifest: Any) -> str | None:
    """What in a parsed ``manifest.json`` is not as :func:`save_checkpoint` writes it (the first
    problem, naming the key), or None. Only the keys a load reads are checked: ``step``, ``files``,
    ``states``, ``layout``, ``lora_bases``."""
    if not isinstance(manifest, dict):
        return f"a JSON {json_kind(manifest)} (an object is expected)"
    if not _is_count(manifest.get("step")):
        return f"'step' = {manifest.get('step')!r} (an int >= 0 is expected)"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return f"'files' holding a JSON {json_kind(files)} (an object of the checkpoint's files is expected)"
    for name, info in files.items():
        problem = _file_entry_problem(name, info)
        if problem:
            return problem
    states = manifest.get("states")
    if states is not None and not (
        isinstance(states, list) and states and all(isinstance(n, str) and n for n in states)
    ):
        return f"'states' = {states!r} (null or a list of train-state names is expected)"
    layout = manifest.get("layout")
    if layout is not None and not (isinstance(layout, dict) and all(_is_count(v) for v in layout.values())):
        return f"'layout' = {layout!r} (an object of parallel sizes is expected)"
    bases = manifest.get("lora_bases")
    if bases is not None and not isinstance(bases, dict):
        return f"'lora_bases' holding a JSON {json_kind(bases)} (an object is expected)"
    for name, entry in (bases or {}).items():
        problem = _base_entry_problem(name, entry)
        if problem:
            return problem
    return None


def read_manifest(path: Path, fn: str = "load_checkpoint") -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``; :class:`CheckpointError` if there is none, or
    it is not JSON (truncated, corrupt) or not a manifest as :func:`save_checkpoint` writes it
    (:func:`manifest_problem`: the first wrong key named)."""
    if not path.exists():
        raise checkpoint_error(
            fn, "directory", "an existing checkpoint directory", f"{str(path)!r}, which does not exist"
        )
    if not path.is_dir():
        raise checkpoint_error(fn, "directory", "a checkpoint directory", f"{str(path)!r}, which is not a directory")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise checkpoint_error(
            fn,
            "directory",
            "a complete checkpoint (a directory with manifest.json)",
            f"{str(path)!r}, which has no manifest.json (an interrupted save, or not a checkpoint)",
        )
    manifest = read_json(fn, "directory", mpath, "a manifest.json holding JSON")
    problem = manifest_problem(manifest)
    if problem:
        raise checkpoint_error(
            fn,
            "directory",
            f"a manifest.json of fnppo (format {FORMAT!r}: the step, the files with their sizes and sha256)",
            f"{str(mpath)!r} holding {problem}",
        )
    return manifest


def _file_problem(path: Path, name: str, info: Mapping[str, Any], hash_it: bool) -> str | None:
    fpath = path / name
    if not fpath.is_file():
        return f"a checkpoint where {fpath} is missing"
    size = fpath.stat().st_size
    if size != info.get("size"):
        return f"{size} bytes instead of {info.get('size')}: {fpath} is truncated or altered"
    if hash_it and sha256(fpath) != info.get("sha256"):
        return f"a file whose sha256 differs from the manifest: {fpath} is altered"
    return None


def check_files(
    path: Path, manifest: Mapping[str, Any], *, fn: str = "load_checkpoint", hash_it: bool = True
) -> str | None:
    """Why the files of ``path`` do not match ``manifest`` (the full message), None when they do. Every file
    is checked for presence and size, and (``hash_it``) its sha256. Collective when torch.distributed is
    initialized: the ranks share the hashing and all get the same answer."""
    files = manifest["files"]
    mine = None
    for name in _share(sorted(files)):
        problem = _file_problem(path, name, files[name], hash_it)
        if problem:
            mine = (name, problem)
            break
    found = [p for p in _gather(mine) if p]
    if not found:
        return None
    name, problem = min(found)
    expected = (
        f"the file {str(path / name)!r} that the manifest lists, of {files[name].get('size')} bytes with its sha256"
    )
    return str(checkpoint_error(fn, "directory", expected, problem))


def verify_checkpoint(directory: str | os.PathLike, *, hash_files: bool = True) -> dict[str, Any]:
    """Check the checkpoint in ``directory`` against its manifest; return the manifest.

    Raises :class:`CheckpointError` naming the problem: no directory, no ``manifest.json`` (an
    interrupted save), a manifest that is not JSON, a file that is missing, truncated (its size) or
    altered (its sha256, unless ``hash_files=False``). Collective when torch.distributed is initialized
    (every rank gets the same answer; the ranks share the hashing).
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise checkpoint_error("verify_checkpoint", "directory", "a checkpoint directory path", repr(directory))
    path = Path(directory)
    try:
        manifest = read_manifest(path, "verify_checkpoint")
        problem = None
    except CheckpointError as err:
        manifest, problem = None, str(err)
    problems = [p for p in _gather(problem) if p]
    if problems:
        raise CheckpointError(problems[0])
    problem = check_files(path, manifest, fn="verify_checkpoint", hash_it=hash_files)
    if problem:
        raise CheckpointError(problem)
    return manifest


def report(message: str, *args: Any) -> None:
    """A warning on the ``fnppo.checkpoint`` logger, from rank 0 only."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        logger.warning(message, *args)
