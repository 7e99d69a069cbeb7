"""The few collectives the toy needs outside fnppo's steps: the vocabulary gathered over tensor-parallel
ranks, the last pipeline stage's values on every stage, rank 0's decision on every rank."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

import fnppo
from toy.errors import ArgumentError
from toy.rundir import choose_run_dir


def gather_vocab(x, layout):
    """``x [n, vocab_shard]`` of every tensor-parallel rank, concatenated: ``[n, padded vocab]``."""
    if layout.tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(layout.tp)]
    dist.all_gather(parts, x.contiguous(), group=layout.tp_group)
    return torch.cat(parts, dim=-1)


def from_last_stage(x, layout, device):
    """The last pipeline stage's ``x`` (a CPU tensor) on every stage."""
    if layout.pp == 1:
        return x
    buf = x.to(device)
    dist.broadcast(buf, src=dist.get_global_rank(layout.pp_group, layout.pp - 1), group=layout.pp_group)
    return buf.cpu()


def agree(value, layout):
    """Rank 0's value on every rank (an error on rank 0 becomes the same error everywhere)."""
    if layout.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agreed_run_dir(args: argparse.Namespace, layout, root: Path | None = None) -> Path:
    """:func:`choose_run_dir` on rank 0, the same directory (or the same :class:`ArgumentError`) on every rank."""
    choice: Path | ArgumentError
    try:
        choice = choose_run_dir(args, root) if layout.rank == 0 else Path()
    except ArgumentError as err:
        choice = err
    choice = agree(choice, layout)
    if isinstance(choice, ArgumentError):
        raise choice
    return choice


def agreed_lock(out_dir: Path, layout):
    """Rank 0 locks ``out_dir`` for the run's life (``fnppo.checkpoint.lock_directory``: one run per
    directory); a directory another run holds is the same :class:`ArgumentError` on every rank. Returns
    the lock on rank 0 (release it when the run ends), None elsewhere."""
    lock: object = None
    if layout.rank == 0:
        try:
            lock = fnppo.checkpoint.lock_directory(out_dir)
        except fnppo.checkpoint.CheckpointError as err:
            lock = ArgumentError(f"--out-dir: {err}")
    verdict = agree(lock if isinstance(lock, ArgumentError) else None, layout)
    if isinstance(verdict, ArgumentError):
        raise verdict
    return lock


def agreed_sinks(args: argparse.Namespace, layout) -> None:
    """Rank 0 (the one that logs) imports the packages of the ``--log`` sinks
    (``fnppo.sinks.check_sinks``); one that is missing or fails to import is the same
    :class:`ArgumentError` on every rank, before anything is locked or created."""
    refusal = None
    if layout.rank == 0:
        try:
            fnppo.sinks.check_sinks(args.log)
        except fnppo.InputError as err:
            refusal = ArgumentError(f"--log-to {args.log}: {err}")
    refusal = agree(refusal, layout)
    if refusal is not None:
        raise refusal
