"""Checkpoints of a TrainState (model, optimizer, step, RNG and run state), verified on load.
Implementation: :mod:`fnppo.io.checkpoint`."""

from __future__ import annotations

from fnppo.io.checkpoint import CheckpointError as CheckpointError
from fnppo.io.checkpoint import DirectoryLock as DirectoryLock
from fnppo.io.checkpoint import latest_checkpoint as latest_checkpoint
from fnppo.io.checkpoint import load_checkpoint as load_checkpoint
from fnppo.io.checkpoint import lock_directory as lock_directory
from fnppo.io.checkpoint import read_checkpoint as read_checkpoint
from fnppo.io.checkpoint import remove_stale_saves as remove_stale_saves
from fnppo.io.checkpoint import save_checkpoint as save_checkpoint
from fnppo.io.checkpoint import verify_checkpoint as verify_checkpoint

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "verify_checkpoint",
    "read_checkpoint",
    "CheckpointError",
    "lock_directory",
    "DirectoryLock",
    "remove_stale_saves",
]
