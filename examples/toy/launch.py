"""The entry point: parse and validate (before torch is imported), set up the parallel layout, run,
tear down. A refusal (an :class:`~toy.errors.ArgumentError`, a library ``fnppo.InputError`` about
a setting of the command line, a checkpoint that cannot be written) is one line from rank 0 and exit 2 on every rank; Ctrl-C is one line
saying how to resume and exit 130."""

from __future__ import annotations

import argparse
import os
import sys
import time

from toy.checks import validate_args
from toy.cli import parse_args
from toy.errors import ArgumentError, Interrupted

#: the exit status of a run stopped by Ctrl-C (128 + SIGINT, what a shell reports)
EXIT_INTERRUPTED = 130


def _is_rank0_env() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _cuda_available(args: argparse.Namespace) -> bool:
    """Whether torch sees a CUDA device; asked (importing torch) only for ``--device cuda``."""
    if getattr(args, "device", "cpu") != "cuda":
        return False
    import torch  # (only here: --help and refusals never import torch)

    return torch.cuda.is_available()


def _refuse(prog: str, message: str, rank0: bool) -> int:
    """One line on rank 0; the other ranks wait a moment (torchrun stops every rank when one exits: rank 0
    must have printed its line first) and exit quietly. Exit status 2."""
    if rank0:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(3.0)
    return 2


def cli_main(prog: str, argv: list[str] | None, parse, validate, run_fn) -> int:
    """A toy run's command line: ``parse(argv)``, ``validate(args, world_size, cuda_available)`` it
    before torch is imported (``cuda_available`` is asked only for ``--device cuda``, else False; an
    :class:`ArgumentError` is printed as ``{prog}: error: ...`` on rank 0 and every rank exits with
    status 2), then import fnppo, set up the parallel layout, ``run_fn(args, layout)`` (its
    ArgumentError, an ``fnppo.InputError`` the library raises for a setting of the command line, or a
    ``CheckpointError`` of a checkpoint that cannot be written (a full disk, the file-size limit),
    likewise: one line from rank 0, exit 2), tear the layout down. Ctrl-C: the line
    :class:`~toy.errors.Interrupted` carries (how to resume), exit 130, no traceback."""
    args = parse(argv)
    try:
        validate(args, int(os.environ.get("WORLD_SIZE", "1")), _cuda_available(args))
    except ArgumentError as err:
        return _refuse(prog, str(err), _is_rank0_env())
    # the run path: torch, Megatron and fnppo are imported only now, after every argument is validated
    import fnppo

    try:
        layout = fnppo.init_parallel(args.tp, args.pp, ep=getattr(args, "ep", 1), seed=args.seed, device=args.device)
    except KeyboardInterrupt:
        return _interrupted(prog, None)
    try:
        return run_fn(args, layout)
    except (ArgumentError, fnppo.InputError, fnppo.checkpoint.CheckpointError) as err:
        return _refuse(prog, str(err), layout.rank == 0)
    except KeyboardInterrupt as err:
        return _interrupted(prog, err if isinstance(err, Interrupted) else None, layout.rank == 0)
    finally:
        fnppo.megatron.parallel.destroy_parallel()


def _interrupted(prog: str, err: Interrupted | None, rank0: bool = True) -> int:
    if rank0:
        print(f"\n{prog}: interrupted" + ("" if err is None else f"; {err.how_to_resume}"), file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def run(args: argparse.Namespace, layout) -> int:
    """:func:`toy.loop.run`, imported on the run path only (torch, Megatron, fnppo): after validation."""
    from toy import loop

    return loop.run(args, layout)


def main(argv: list[str] | None = None) -> int:
    return cli_main("ppo_toy.py", argv, parse_args, validate_args, run)
