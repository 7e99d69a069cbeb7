"""The main job's margin: the default CPU toy run for many seeds and thread counts.

Runs ``examples/ppo_toy.py`` with its defaults (only ``--seed`` and ``--algo`` change) once per
seed, ``OMP_NUM_THREADS`` value and algorithm, and records each run's final reward (mean of the last
5 steps), the first step at which the mean reward of the last 5 steps reaches 0.9 (read from the
run's ``metrics.jsonl``), its wall time and the 1-minute load average when it started (the machine
may be shared). RL trajectories depend on floating-point reduction order, so a default that passes
on one machine must pass with other seeds and thread counts too.

Every finished run is appended as one JSON line to ``--rows`` (default
``runs/toy_robustness.jsonl``) right away; a later call with the same file skips the runs already
recorded with the same flags (a long study can be stopped, resumed and inspected), and ``--report``
prints the summary and tables from the file without running anything. ``--jobs N`` runs N runs at a
time (rewards depend only on seed, thread count and flags, not on wall time; wall times do grow).

For each algorithm the summary gives the minimum and mean final reward, the slowest run to reach 0.9
and how many runs ended below 0.9; ``--markdown`` adds a compact table per algorithm, one row per
seed with each thread count's final reward and step at 0.9 side by side.

    python benchmarks/toy_robustness.py                                   # seeds 0..19 x OMP_NUM_THREADS 1, 2
    python benchmarks/toy_robustness.py --seeds 0-19 --algos grpo --jobs 2 --markdown
    python benchmarks/toy_robustness.py --seeds 0-19 --algos ppo --report --markdown
    python benchmarks/toy_robustness.py --seeds 0 1 --threads 1 -- --steps 120   # other ppo_toy.py flags
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FINAL = re.compile(r"final reward \(mean of last (\d+) steps\): ([0-9.]+)")
SPEED = re.compile(r"\(([0-9.]+) s/step\)")
TARGET = 0.9


def parse_seeds(words: list[str]) -> list[int]:
    """Seeds from words like ``3`` and ``0-19`` (inclusive ranges), in order, without repeats."""
    seeds: list[int] = []
    for word in words:
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", word)
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise argparse.ArgumentTypeError(f"--seeds: expected N or A-B with A <= B, received {word!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        seeds += [s for s in range(lo, hi + 1) if s not in seeds]
    return seeds


def run_one(seed: int, threads: int, extra: list[str], out_root: Path, algo: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    out_dir = out_root / f"{algo}-seed{seed}-omp{threads}"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "ppo_toy.py"),
        "--seed",
        str(seed),
        "--no-progress",
        "--no-plot",
        "--out-dir",
        str(out_dir),
        "--algo",
        algo,
        *extra,
    ]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    m, s = FINAL.search(out.stdout), SPEED.search(out.stdout)
    rewards = step_rewards(out_dir / "metrics.jsonl")
    if m is None:
        raise SystemExit(
            f"{algo} seed {seed}, {threads} threads: no final reward in the output\n"
            f"{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
        )
    return {
        "algo": algo,
        "seed": seed,
        "threads": threads,
        "extra": extra,
        "reward": float(m.group(2)),
        "reach": first_reaching(rewards),
        "rewards": [round(x, 5) for x in rewards],
        "wall_s": round(wall, 2),
        "s_per_step": float(s.group(1)) if s else None,
        "exit": out.returncode,
        "load": round(load, 2),
    }


def step_rewards(metrics: Path) -> list[float]:
    """The mean reward of each step in a run's ``metrics.jsonl`` (empty when there is none)."""
    if not metrics.is_file():
        return []
    return [json.loads(line)["reward"] for line in metrics.read_text().splitlines() if line.strip()]


def first_reaching(rewards: list[float], target: float = TARGET, window: int = 5) -> int | None:
    """The first step whose trailing ``window``-step mean reward is at least ``target`` (None: never)."""
    for i in range(len(rewards)):
        part = rewards[max(0, i - window + 1) : i + 1]
        if sum(part) / len(part) >= target:
            return i + 1
    return None


def run_and_record(calls: list, jobs: int, rows_path: Path, describe) -> list[dict]:
    """Run the thunks ``calls``, ``jobs`` at a time; append each row to ``rows_path`` (JSON lines) as it
    comes (an interrupted study keeps what it finished), print ``describe(row)``; the rows in the order
    they finished."""
    rows = []
    with ThreadPoolExecutor(jobs) as pool:
        for future in as_completed([pool.submit(call) for call in calls]):
            row = future.result()
            with open(rows_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(describe(row), flush=True)
            rows.append(row)
    return rows


def _describe(row: dict) -> str:
    return (
        f"{row['algo']} seed {row['seed']} OMP_NUM_THREADS={row['threads']}: final reward {row['reward']:.3f}, "
        f"5-step mean >= 0.9 from step {row['reach']}, wall {row['wall_s']:.1f} s, exit {row['exit']}, "
        f"load {row['load']:.1f}"
    )


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(algo: str, rows: list[dict]) -> str:
    """One line: min and mean final reward, the slowest run to reach 0.9, runs below 0.9, wall times."""
    rewards = [r["reward"] for r in rows]
    never = [r for r in rows if r["reach"] is None]
    slow = max(rows, key=lambda r: (r["reach"] is None, r["reach"] or 0))
    slowest = (
        "never (" if never else f"step {slow['reach']} ("
    ) + f"seed {slow['seed']}, OMP_NUM_THREADS={slow['threads']})"
    below = sum(x < TARGET for x in rewards)
    walls = sorted(r["wall_s"] for r in rows)
    return (
        f"{algo}: min {min(rewards):.3f}, mean {sum(rewards) / len(rewards):.3f}, slowest to 0.9: {slowest}, "
        f"below 0.9: {below} of {len(rows)} runs; wall {walls[0]:.0f}-{walls[-1]:.0f} s "
        f"(median {walls[len(walls) // 2]:.0f} s)"
    )


def markdown(algo: str, rows: list[dict], seeds: list[int], threads: list[int]) -> str:
    """One row per seed; each thread count's final reward and first step at 0.9 side by side."""
    by = {(r["seed"], r["threads"]): r for r in rows}
    head = "| seed |" + "".join(f" final, OMP {t} | >= 0.9 from step, OMP {t} |" for t in threads)
    lines = [f"`--algo {algo}`:", "", head, "|---|" + "---|---|" * len(threads)]
    for seed in seeds:
        cells = []
        for t in threads:
            r = by.get((seed, t))
            cells += (
                ["-", "-"] if r is None else [f"{r['reward']:.3f}", "never" if r["reach"] is None else str(r["reach"])]
            )
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    missing = len(seeds) * len(threads) - len(rows)
    note = [f"`-`: not measured yet ({missing} of {len(seeds) * len(threads)} runs)."] if missing else []
    return "\n".join([*lines, "", *note, summary(algo, rows)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="+", default=["0-19"], help="seeds and inclusive ranges A-B (default: 0-19)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="OMP_NUM_THREADS values (default: 1 2)")
    p.add_argument(
        "--algos",
        nargs="+",
        choices=["grpo", "ppo"],
        default=["grpo", "ppo"],
        help="--algo values of ppo_toy.py, in this order (default: grpo ppo)",
    )
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (default: 1)")
    p.add_argument(
        "--rows",
        type=Path,
        default=ROOT / "runs" / "toy_robustness.jsonl",
        help="JSONL file of finished runs: appended to, and runs already in it are skipped",
    )
    p.add_argument("--report", action="store_true", help="only summarize the runs already in --rows")
    p.add_argument("--markdown", action="store_true", help="print a compact markdown table per algorithm")
    p.add_argument("extra", nargs="*", help="more ppo_toy.py flags (after --)")
    args = p.parse_args()
    try:
        seeds = parse_seeds(args.seeds)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.jobs < 1:
        p.error(f"--jobs: expected a positive integer, received {args.jobs}")
    wanted = [(a, s, t) for a in args.algos for t in args.threads for s in seeds]
    done = {(r["algo"], r["seed"], r["threads"]): r for r in read_rows(args.rows) if r["extra"] == args.extra}
    todo = [] if args.report else [k for k in wanted if k not in done]
    if todo:
        print(
            f"{len(wanted) - len(todo)} of {len(wanted)} runs already in {args.rows}; running {len(todo)}, "
            f"{args.jobs} at a time",
            flush=True,
        )
    args.rows.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        calls = [functools.partial(run_one, s, t, args.extra, Path(tmp), a) for a, s, t in todo]
        for row in run_and_record(calls, args.jobs, args.rows, _describe):
            done[(row["algo"], row["seed"], row["threads"])] = row
    rows = {a: [done[k] for k in wanted if k in done and k[0] == a] for a in args.algos}
    for algo in args.algos:
        if not rows[algo]:
            continue
        print(("\n" + markdown(algo, rows[algo], seeds, args.threads)) if args.markdown else summary(algo, rows[algo]))
    missing = [k for k in wanted if k not in done]
    if missing:
        print(f"{len(missing)} of {len(wanted)} runs not recorded yet", file=sys.stderr)
    return 0 if not missing and all(r["exit"] == 0 for a in args.algos for r in rows[a]) else 1


if __name__ == "__main__":
    sys.exit(main())
