"""The metrics sinks (``--log``) and the progress report (a tqdm bar on a terminal, lines in CI logs)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fnppo import sinks


def open_logging(args: argparse.Namespace, out_dir: Path, layout, resume_step: int | None = None) -> list:
    """Rank 0: the ``--log`` sinks under ``out_dir``, given the run's settings (every argument and the
    layout) as hyperparameters; other ranks: none. ``resume_step``: the step of the checkpoint a resumed
    run continues from (TensorBoard drops the earlier run's events after it: each step once)."""
    opened = sinks.open_sinks(args.log, out_dir, rank=layout.rank, run_name=out_dir.name, resume_step=resume_step)
    settings = {
        **{k: v for k, v in vars(args).items() if k != "given_flags"},
        "world_size": layout.world_size,
        "dp": layout.dp,
        "ep": layout.ep,
    }
    sinks.log_hparams(opened, settings)
    return opened


class LineProgress:
    """The progress report when stdout is not a terminal (CI logs): one line every ``every`` steps and
    at the last, instead of a bar redrawn at every step (the ``tqdm`` methods the loops use)."""

    def __init__(self, total: int, initial: int, desc: str, every: int) -> None:
        self.total, self.n, self.desc, self.every = total, initial, desc, every
        self.start_n, self.t0, self.postfix = initial, time.perf_counter(), {}

    def set_postfix(self, **values) -> None:
        self.postfix = values

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n >= self.total:
            rate = (time.perf_counter() - self.t0) / max(1, self.n - self.start_n)
            fields = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            print(f"{self.desc} {self.n}/{self.total} {fields} ({rate:.2f} s/step)", flush=True)

    def close(self) -> None:
        pass


def make_progress(args: argparse.Namespace, initial: int, desc: str):
    """Rank 0's progress report: a ``tqdm`` bar on a terminal, :class:`LineProgress` otherwise, None
    with ``--no-progress``."""
    if args.no_progress:
        return None
    if not sys.stdout.isatty():
        return LineProgress(args.steps, initial, desc, args.progress_every)
    from tqdm import tqdm

    return tqdm(total=args.steps, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
