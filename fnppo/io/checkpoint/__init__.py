"""Checkpoints of train states as Megatron distributed checkpoints: any layout saves, any layout loads.

``save_checkpoint`` writes a :class:`~fnppo.megatron.state.TrainState` (or a mapping of names to train
states) with Megatron's ``dist_checkpointing`` in its ``torch_dist`` format: the model chunks'
sharded state dicts, the optimizer's (the distributed optimizer's state in model space), every
rank's RNG states and the run state (step, ``extra``), plus a ``manifest.json`` with the size and
sha256 of every file. ``load_checkpoint`` reads it back under the current layout, whatever the
layout of the save (TP, PP, VPP, DP, EP, CP); the same layout resumes bit for bit.

Layout of a checkpoint directory::

    <dir>/__<rank>_0.distcp   every rank's shards (torch.distributed.checkpoint files)
    <dir>/.metadata           torch.distributed.checkpoint's index of the shards (global shapes)
    <dir>/common.pt           the non-sharded state: step, train-state names, extra, optimizer settings
    <dir>/metadata.json       Megatron's format record (torch_dist)
    <dir>/manifest.json       written last: step, layout of the save, each file's size and sha256

Modules: :mod:`.content` (what is saved, as sharded state dicts), :mod:`.save` (the atomic, non-forking
save), :mod:`.load`, :mod:`.manifest` (integrity), :mod:`.latest` (:func:`latest_checkpoint`), :mod:`.lock`
(:func:`lock_directory`: one run per output directory; :func:`remove_stale_saves`: what dead saves
left), :mod:`.reader` (:func:`read_checkpoint`: the contents in one process).
"""

from __future__ import annotations

from fnppo.io.checkpoint.latest import latest_checkpoint
from fnppo.io.checkpoint.load import load_checkpoint
from fnppo.io.checkpoint.lock import DirectoryLock, lock_directory, remove_stale_saves
from fnppo.io.checkpoint.manifest import CheckpointError, verify_checkpoint
from fnppo.io.checkpoint.reader import read_checkpoint
from fnppo.io.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "verify_checkpoint",
    "read_checkpoint",
    "lock_directory",
    "DirectoryLock",
    "remove_stale_saves",
]
