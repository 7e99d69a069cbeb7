"""``save_checkpoint``: a Megatron distributed checkpoint (``torch_dist``), written atomically, no forks.

Megatron's default ``torch_dist`` save strategy writes through worker processes that it forks (which
hangs on CPU/gloo and is refused in daemonic processes); :class:`SyncTorchDistSave` keeps Megatron's
translation of sharded tensors to ``torch.distributed.checkpoint`` and its planner but writes with
torch's own ``FileSystemWriter`` in the calling thread (one file per rank, fsync'ed).

The save goes to a temporary directory ``.<name>.tmp-<id>`` next to ``directory``: the sharded state
(every rank), ``common.pt`` and Megatron's ``metadata.json`` (rank 0), then ``manifest.json`` with the
size and sha256 of every file; then the directory is renamed into place (a checkpoint already there
is replaced). After each phase the ranks agree: a failure on any rank (a full disk, say) removes the
temporary directory and raises :class:`CheckpointError` on every rank.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException: every rank's write errors)

from fnppo.core.errors import input_error
from fnppo.io.checkpoint.base import base_record
from fnppo.io.checkpoint.content import (
    drop_filled_state,
    fill_empty_adam_state,
    layout_record,
    model_sharded_state_dict,
    named_states,
    optimizer_sharded_state_dict,
    quiet_checkpointing,
    rng_object,
    rng_state,
)
from fnppo.io.checkpoint.lock import hold_while_writing, remove_stale_saves
from fnppo.io.checkpoint.manifest import FORMAT, MANIFEST, TMP_MARK, checkpoint_error, file_entries, logger
from fnppo.megatron.state import TrainStates

__all__ = ["SyncTorchDistSave", "save_checkpoint", "sharded_checkpoint_state"]


class SyncTorchDistSave(TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` format, written synchronously by torch's ``FileSystemWriter`` (no worker
    processes, no threads: ``thread_count=1``), every file fsync'ed."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, keep_only_main_replica=True, thread_count=1)

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded, False)
        writer = dcp.FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, sync_files=True, thread_count=1)
        planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
        dcp.save(pyt_state_dict, storage_writer=writer, planner=planner)


def _rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _os_errors(error: BaseException) -> Iterator[OSError]:
    """The OS errors behind ``error``: itself, its causes, and torch's per-rank write failures."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # torch's (exception, traceback) pairs
            todo += [f for f in (failure if isinstance(failure, tuple) else (failure,)) if isinstance(f, BaseException)]


def _size_limit() -> int | None:
    """The file-size limit of this process (RLIMIT_FSIZE's soft limit, ``ulimit -f``), None when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _at_size_limit(written: Path | None) -> Path | None:
    """A file under ``written`` that reached the file-size limit (None: no limit, or no such file).

    torch's own file writer (``torch.save``: ``common.pt``) loses the ``EFBIG`` of a write past the
    limit (it reports ``basic_ios::clear: iostream error`` or ``unexpected pos ...``); a write that
    crosses the limit stops exactly at it, so the file's size tells."""
    limit = _size_limit()
    if limit is None or written is None or not written.is_dir():
        return None
    for f in sorted(written.rglob("*")):
        with contextlib.suppress(OSError):
            if f.is_file() and f.stat().st_size >= limit:
                return f
    return None


def _why(error: BaseException, written: Path | None = None) -> str:
    """What the OS error behind a failed write means, in words (the file-size limit named as such, also
    where torch's writer lost the ``EFBIG``: a file under ``written`` at the limit)."""
    limit = _size_limit()
    at_limit = "unlimited" if limit is None else f"{limit} bytes"
    for e in _os_errors(error):
        if e.errno == errno.EFBIG:
            where = f" ({e.filename})" if e.filename else ""
            return f"; a file{where} reached the file-size limit (RLIMIT_FSIZE, `ulimit -f`): {at_limit}"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return "; the disk (or quota) is full"
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return "; the directory is read-only or not writable by this process"
    full = _at_size_limit(written)
    if full is not None:
        return f"; File too large: {full.name} reached the file-size limit (RLIMIT_FSIZE, `ulimit -f`): {at_limit}"
    return ""


def _agree(error: BaseException | None, written: Path | None = None) -> str | None:
    """Every rank's failure of the phase just run (the first one's message), or None when all succeeded."""
    mine = None if error is None else f"{type(error).__name__}: {error}{_why(error, written)}"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return next((m for m in everyone if m), None)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sharded_checkpoint_state(state: Any, extra: Mapping[str, Any] | None, fn: str) -> tuple[dict[str, Any], list]:
    """The sharded state dict a save writes, and the optimizer state filled for it (to drop after)."""
    named = named_states(state, fn)
    rank, world = _rank_world()
    first = next(iter(named.values()))
    filled: list = []
    states: dict[str, Any] = {}
    try:
        for name, one in named.items():
            filled += fill_empty_adam_state(one.optimizer)
            model_sd = model_sharded_state_dict(one, f"{name}." if name else "")
            states[name] = {
                "step": int(one.step),
                "model": model_sd,
                "optimizer": optimizer_sharded_state_dict(one.optimizer, model_sd, is_loading=False)[0],
            }
    except BaseException:
        drop_filled_state(filled)
        raise
    sd = {
        "fnppo": {
            "format": FORMAT,
            "step": int(first.step),
            "names": None if not isinstance(state, Mapping) else list(named),
            "extra": dict(extra or {}),
        },
        "states": states,
        "rng": rng_object(rng_state(), rank, world),
    }
    return sd, filled


def _phase(work: Callable[[], Any], tmp: Path, rank: int, directory: Path) -> None:
    """Run ``work``; if it failed on any rank, remove ``tmp`` (rank 0) and raise on every rank. A Ctrl-C
    stays a ``KeyboardInterrupt``, also when torch's checkpoint writer wrapped it in its
    ``CheckpointException`` (``save_checkpoint`` then removes ``tmp``)."""
    error: BaseException | None = None
    try:
        work()
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported on every rank below
        if isinstance(err, CheckpointException) and any(
            isinstance(exc, KeyboardInterrupt) for exc, _ in err.failures.values()
        ):
            raise KeyboardInterrupt from err
        error = err
    problem = _agree(error, tmp)
    if problem is None:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    raise checkpoint_error(
        "save_checkpoint",
        "directory",
        "a directory the checkpoint can be written to (room on the disk, write permission)",
        f"{str(directory)!r}, where writing failed ({problem}); nothing was left behind",
    ) from error


def save_checkpoint(
    directory: str | os.PathLike, state: TrainStates, *, extra: Mapping[str, Any] | None = None
) -> Path:
    """Save ``state`` (model chunks, optimizer, step) plus RNG states and ``extra`` to ``directory``.

    A Megatron distributed checkpoint (``torch_dist``): a later :func:`load_checkpoint` reads it under any
    parallel layout (TP, PP, VPP, DP, EP, CP). ``state``: a :class:`~fnppo.megatron.state.TrainState`, or a
    mapping of names to train states (all in one checkpoint; its ``step`` is the first state's).
    ``extra``: run state (data position, KL controller, settings, ...), the same on every rank (rank 0's is
    written, every rank gets it back). Parameters tagged ``fnppo_lora_base`` are left out; the manifest
    records that base instead (:func:`fnppo.io.checkpoint.base.base_record`: its architecture and
    layout-independent digests of its weights), which :func:`load_checkpoint` checks. Atomic: the
    checkpoint appears complete under ``directory`` or not at all (a checkpoint already there is
    replaced). Collective; returns the path. Raises :class:`CheckpointError` (on every rank, nothing
    left behind) when writing fails.
    """
    directory = _check_target(directory, extra)
    named_states(state, "save_checkpoint")  # refused before anything is written
    rank, world = _rank_world()
    box = [f".{directory.name}{TMP_MARK}{uuid.uuid4().hex[:12]}"]
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    tmp = directory.parent / box[0]
    if rank == 0:
        for done in remove_stale_saves(directory.parent):
            logger.warning("save_checkpoint: a save that did not finish: %s", done)
    try:
        with contextlib.ExitStack() as held:
            held.enter_context(_file_size_errors())
            _write(directory, tmp, rank, state, extra, held)
    except KeyboardInterrupt:  # Ctrl-C mid-save: no half-written save left behind (the last complete one stays)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _check_target(directory: Any, extra: Any) -> Path:
    """Refuse a ``directory`` that is no path or an existing file, and an ``extra`` that is no mapping."""
    if not isinstance(directory, (str, os.PathLike)):
        raise input_error(
            "save_checkpoint", "directory", "a path (str or os.PathLike)", f"{directory!r} ({type(directory).__name__})"
        )
    if extra is not None and not isinstance(extra, Mapping):
        raise input_error(
            "save_checkpoint", "extra", "a mapping of names to values (a dict) or None", f"{type(extra).__name__}"
        )
    directory = Path(directory)
    try:
        exists, is_dir = directory.exists(), directory.is_dir()
    except OSError as err:  # a parent that this process may not enter
        raise checkpoint_error(
            "save_checkpoint",
            "directory",
            "a directory the checkpoint can be written to (room on the disk, write permission)",
            f"{str(directory)!r} ({type(err).__name__}: {err}{_why(err)}); nothing was written",
        ) from None
    if exists and not is_dir:
        raise checkpoint_error(
            "save_checkpoint",
            "directory",
            "a new path or a checkpoint directory (replaced)",
            f"{str(directory)!r}, an existing file (not replaced)",
        )
    return directory


@contextlib.contextmanager
def _file_size_errors() -> Iterator[None]:
    """During the save, a write past the file-size limit raises ``EFBIG`` (named in the error) instead of
    the default SIGXFSZ that kills the process (main thread only: signals cannot be set elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGXFSZ, previous)


def _write(directory: Path, tmp: Path, rank: int, state: Any, extra: Any, held: contextlib.ExitStack) -> None:
    sd, filled = sharded_checkpoint_state(state, extra, "save_checkpoint")
    bases = {name: base_record(one.model) for name, one in named_states(state, "save_checkpoint").items()}
    try:
        holder: dict[str, Any] = {}

        def prepare() -> None:
            if rank == 0:
                tmp.mkdir(parents=True)
                held.enter_context(hold_while_writing(tmp))  # a live save: not removed as stale by others
            holder["sharded"], holder["common"] = save_preprocess(sd, validate_access_integrity=True)

        _phase(prepare, tmp, rank, directory)
        dist.barrier()  # the directory exists for every rank

        def common() -> None:
            if rank == 0:
                TorchCommonSaveStrategy("torch", 1).save_common(holder["common"], tmp)

        _phase(common, tmp, rank, directory)
        with quiet_checkpointing():
            _phase(lambda: SyncTorchDistSave().save(holder["sharded"], tmp), tmp, rank, directory)
    finally:
        drop_filled_state(filled)

    def config() -> None:
        if rank == 0:
            save_config(CheckpointingConfig("torch_dist", 1), str(tmp))

    _phase(config, tmp, rank, directory)
    entries: dict[str, Any] = {}
    _phase(lambda: entries.update(file_entries(tmp)), tmp, rank, directory)

    def finish() -> None:
        if rank != 0:
            return
        manifest = {
            "format": FORMAT,
            "step": sd["fnppo"]["step"],
            "states": sd["fnppo"]["names"],
            "layout": layout_record(),
            "lora_bases": bases,
            "files": entries,
        }
        with open(tmp / MANIFEST, "w") as f:
            f.write(json.dumps(manifest, indent=1))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = None
        if directory.exists():  # replaced: moved aside first, removed once the new one is in place
            old = directory.parent / f".{directory.name}{TMP_MARK}old-{uuid.uuid4().hex[:12]}"
            os.replace(directory, old)
        os.replace(tmp, directory)
        _fsync_dir(directory.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    _phase(finish, tmp, rank, directory)
