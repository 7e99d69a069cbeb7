"""Where a run's files go: the run directory (new per run, ``--out-dir``, ``--resume``, ``--overwrite``),
the metrics file, the newest complete checkpoint. Pure Python: used before torch is imported."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from toy.errors import ArgumentError

RUNS_ROOT = Path("runs/ppo_toy")


def check_file_target(flag: str, path: str) -> None:
    """``path`` can become a file: it is no directory, and its nearest existing ancestor is a directory."""
    p = Path(path)
    if p.is_dir():
        raise ArgumentError(f"{flag} {path}: is a directory (a file path is expected)")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise ArgumentError(f"{flag} {path}: {parent} is a file, not a directory")


def newest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint (a directory with a readable ``manifest.json``) with the highest step
    under ``root``, or None: what ``fnppo.checkpoint.latest_checkpoint`` finds, in plain Python (no torch)."""
    best: tuple[int, Path] | None = None
    for d in root.iterdir() if root.is_dir() else ():
        try:
            step = int(json.loads((d / "manifest.json").read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):  # (json.JSONDecodeError is a ValueError)
            continue
        if best is None or step > best[0]:
            best = (step, d)
    return None if best is None else best[1]


def check_run_paths(args: argparse.Namespace, root: Path | None = None) -> None:
    """The run directory and the files the run will write: ``--out-dir`` (a directory or nothing),
    ``--metrics-out`` / ``--profile-out`` (file paths; a non-empty ``--metrics-out`` only with
    ``--resume`` or ``--overwrite``), the run to resume (a complete checkpoint written with this
    ``--algo``), no run to replace without ``--overwrite`` (:func:`choose_run_dir`)."""
    if args.out_dir is not None and Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        raise ArgumentError(f"--out-dir {args.out_dir}: is a file, not a directory")
    for flag, path in (("--metrics-out", args.metrics_out), ("--profile-out", args.profile_out)):
        if path is not None:
            check_file_target(flag, path)
    out_dir = choose_run_dir(args, root)
    if args.metrics_out is not None and not (args.resume or args.overwrite):
        m = Path(args.metrics_out)
        if m.is_file() and m.stat().st_size > 0:
            raise ArgumentError(
                f"--metrics-out {m} already holds metrics; pass --resume to continue its run, "
                "--overwrite to replace it, or another --metrics-out"
            )
    if args.resume:
        latest = newest_checkpoint(out_dir / "checkpoints")
        if latest is None:
            raise ArgumentError(f"--resume: {out_dir} has no complete checkpoint (write some with --save-every N)")
        stored = json.loads((latest / "manifest.json").read_text()).get("states")
        if stored != (["policy", "critic"] if args.algo == "ppo" else None):
            raise ArgumentError(
                f"--resume: the checkpoint was written with --algo {'ppo' if stored else 'grpo'} "
                f"(now {args.algo}); resume with the stored values"
            )
        read_metrics(metrics_path(args, out_dir))  # a corrupt row is refused before anything changes


def choose_run_dir(args: argparse.Namespace, root: Path | None = None) -> Path:
    """The run directory (decided on rank 0 from the file system; see the module docstring).

    ``root`` (default ``runs/ppo_toy``) holds the numbered runs; ``examples/vlm_toy.py`` passes its own.
    """
    root = RUNS_ROOT if root is None else root
    if args.out_dir is not None:
        out = Path(args.out_dir)
        holds_run = (out / "metrics.jsonl").exists() or (out / "checkpoints").exists()
        if args.resume and not holds_run:
            raise ArgumentError(f"--resume: {out} holds no run to resume")
        if holds_run and not (args.resume or args.overwrite):
            raise ArgumentError(
                f"{out} already holds a run; pass --resume to continue it, --overwrite to replace it, or another --out-dir"
            )
        return out
    runs = sorted(p for p in root.glob("run[0-9][0-9][0-9]") if p.is_dir())
    if args.resume:
        if not runs:
            raise ArgumentError(f"--resume: no run under {root}; start one without --resume")
        return runs[-1]
    return root / f"run{int(runs[-1].name[3:]) + 1 if runs else 0:03d}"


def append_row(rows: list[dict], path: Path, row: dict) -> None:
    """Rank 0: one step's metrics, kept in ``rows`` and appended to the JSONL file ``path`` (created,
    with its directory, by the first row)."""
    rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def metrics_path(args: argparse.Namespace, out_dir: Path) -> Path:
    """The run's metrics file: ``--metrics-out``, else ``OUT_DIR/metrics.jsonl``."""
    return Path(args.metrics_out) if args.metrics_out else out_dir / "metrics.jsonl"


def _row(line: bytes) -> dict | None:
    """A metrics row (a JSON object with an int ``step``) of one line, None if the line is not one."""
    try:
        row = json.loads(line.decode("utf-8"))
    except ValueError:  # (json.JSONDecodeError and UnicodeDecodeError are ValueErrors)
        return None
    ok = isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool)
    return row if ok else None


def read_metrics(path: Path) -> tuple[list[dict], str | None]:
    """The rows of the metrics file ``path`` (none if it does not exist), and its last line when that is
    half-written (no newline, not a whole row: what a run killed during an append leaves), else None.

    Raises:
        ArgumentError: a line before the last that is not a metrics row (a JSON object with its ``step``),
            naming the file and the line number (the file is not changed).
    """
    if not path.is_file():
        return [], None
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ArgumentError(f"--resume: the metrics file {path} cannot be read ({err})") from None
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with its newline
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = _row(line)
        if row is None:
            raise ArgumentError(
                f"--resume: {path} line {number} is not a metrics row (a JSON object with its 'step'): "
                f"{line[:60].decode('utf-8', 'replace')!r}; repair or delete that line, or start over with --overwrite"
            )
        rows.append(row)
    partial = None
    if tail.strip():
        row = _row(tail)
        if row is None:
            partial = tail.decode("utf-8", "replace")
        else:
            rows.append(row)
    return rows, partial


def metrics_file(args, out_dir: Path, done: int) -> tuple[Path, list[dict]]:
    """Rank 0: the metrics file and its rows: on ``--resume`` exactly the rows of steps ``<= done``
    (rewritten so; the run appends after them; a half-written last line is dropped with a notice), else
    none (a replaced file is removed; the first row creates the file, so a run that fails before its
    first step leaves no metrics behind)."""
    path = metrics_path(args, out_dir)
    rows = []
    if args.resume and path.exists():
        rows, partial = read_metrics(path)
        if partial is not None:
            print(
                f"{path}: dropped its half-written last line ({len(partial)} characters, "
                f"{partial[:40]!r}...: a run stopped while appending it)",
                flush=True,
            )
        rows = [r for r in rows if r["step"] <= done]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.exists():
        path.unlink()
    return path, rows


def replace_run(out_dir: Path) -> None:
    """Rank 0, ``--overwrite``: remove the replaced run's metrics, settings, checkpoints and ``--log`` files from
    ``out_dir`` (a later ``--resume`` must not continue the old run's checkpoints)."""
    for sub in ("checkpoints", "tensorboard", "wandb", "mlruns"):
        if (out_dir / sub).is_dir():
            shutil.rmtree(out_dir / sub)
    for name in ("metrics.jsonl", SETTINGS_FILE):
        if (out_dir / name).is_file():
            (out_dir / name).unlink()


#: the run's settings (``toy.settings.run_settings``) as JSON, beside its checkpoints: read before torch is imported
SETTINGS_FILE = "settings.json"


def read_settings(out_dir: Path) -> dict | None:
    """The stored run-defining settings of the run in ``out_dir`` (None: a run saved before the file existed)."""
    path = out_dir / SETTINGS_FILE
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ArgumentError(f"--resume: {path} is not readable JSON ({err})") from None
    if not isinstance(stored, dict):
        raise ArgumentError(f"--resume: {path} holds a {type(stored).__name__}, not a JSON object")
    return stored


def write_settings(out_dir: Path, settings: dict) -> None:
    """Rank 0: ``settings`` to ``out_dir/settings.json``, atomically (a temporary file renamed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{SETTINGS_FILE}.tmp"
    tmp.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / SETTINGS_FILE)
