"""``latest_checkpoint``: the newest complete checkpoint under a root, after removing dead saves' debris."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from fnppo.io.checkpoint.lock import remove_stale_saves
from fnppo.io.checkpoint.manifest import (
    MANIFEST,
    TMP_MARK,
    CheckpointError,
    checkpoint_error,
    report,
    verify_checkpoint,
)

__all__ = ["latest_checkpoint", "clean_before_reading"]


def clean_before_reading(root: Path) -> None:
    """Rank 0 removes (or puts back) what dead saves left under ``root``; the other ranks wait for it."""
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        for done in remove_stale_saves(root):
            report("a save that did not finish under %s: %s", root, done)
    if distributed:
        dist.barrier()


def _step_of(d: Path) -> int | None:
    try:
        return int(json.loads((d / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_checkpoint(root: str | os.PathLike, *, fallback: bool = False) -> Path | None:
    """The newest checkpoint (highest step) under ``root``, verified; None when there is none.

    First the temporary directories of saves that died are removed (:func:`remove_stale_saves`, on rank
    0; a checkpoint whose save died between its final renames is put back), each reported. Every
    other directory under ``root`` without a readable manifest (an interrupted save, a leftover
    temporary directory of a save that died) is reported on the ``fnppo.checkpoint`` logger (a warning)
    and skipped. The newest complete checkpoint is verified (:func:`verify_checkpoint`: sizes and
    sha256). A damaged one raises :class:`CheckpointError`, unless ``fallback=True``: then it is reported
    (a warning naming the damage) and the next newest is tried. Collective when torch.distributed is
    initialized (call it on every rank).
    """
    if not isinstance(root, (str, os.PathLike)):
        raise checkpoint_error("latest_checkpoint", "root", "a path (str or os.PathLike)", f"{root!r}")
    root = Path(root)
    if not root.is_dir():
        return None
    clean_before_reading(root)
    steps: list[tuple[int, str, Path]] = []
    for d in sorted(root.iterdir()):
        if not d.is_dir():
            continue
        step = _step_of(d)
        if step is None:
            kind = (
                "the temporary directory of a save that did not finish"
                if TMP_MARK in d.name
                else "no readable manifest.json"
            )
            report("skipping incomplete checkpoint %s: %s", d, kind)
            continue
        steps.append((step, d.name, d))
    for _, _, d in sorted(steps, reverse=True):
        try:
            verify_checkpoint(d)
            return d
        except CheckpointError as err:
            if not fallback:
                raise checkpoint_error(
                    "latest_checkpoint",
                    "root",
                    "a newest checkpoint that verifies (pass fallback=True to use the previous one)",
                    f"the damaged checkpoint {str(d)!r}: {err}",
                ) from None
            report("skipping damaged checkpoint %s (fallback=True): %s", d, err)
    return None
