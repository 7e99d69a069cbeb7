"""The main job's margin: the default CPU toy run for several seeds and thread counts.

Runs ``examples/ppo_toy.py`` with its defaults (only ``--seed`` changes) once per seed and per
``OMP_NUM_THREADS`` value, one run at a time, and prints each final reward (mean of the last 5
steps) and wall time, then the minimum and mean. RL trajectories depend on floating-point reduction
order, so a default that passes on one machine must pass with other seeds and thread counts too.

``--algos grpo ppo`` runs every seed and thread count with each ``--algo`` in turn (GRPO, then PPO
with a critic, back to back, so both see about the same machine load) and adds the wall-time ratio
PPO / GRPO of each pair. Every row records the 1-minute load average when its run started (the
machine may be shared) and the first step at which the mean reward of the last 5 steps reaches 0.9
(read from the run's ``metrics.jsonl``).

    python benchmarks/toy_robustness.py                       # seeds 0..4 x OMP_NUM_THREADS 1, 2
    python benchmarks/toy_robustness.py --seeds 0 1 --threads 1 --markdown
    python benchmarks/toy_robustness.py --algos grpo ppo --seeds 0 1 2 --threads 2 1 --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FINAL = re.compile(r"final reward \(mean of last (\d+) steps\): ([0-9.]+)")
SPEED = re.compile(r"\(([0-9.]+) s/step\)")


def run_one(seed: int, threads: int, extra: list[str], out_root: Path, algo: str | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    chosen = [] if algo is None else ["--algo", algo]
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "ppo_toy.py"),
        "--seed",
        str(seed),
        "--no-progress",
        "--out-dir",
        str(out_root / f"{algo or 'default'}-seed{seed}-omp{threads}"),
        *chosen,
        *extra,
    ]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    m, s = FINAL.search(out.stdout), SPEED.search(out.stdout)
    reach = first_reaching(out_root / f"{algo or 'default'}-seed{seed}-omp{threads}" / "metrics.jsonl")
    if m is None:
        raise SystemExit(
            f"seed {seed}, {threads} threads: no final reward in the output\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
        )
    return {
        "seed": seed,
        "threads": threads,
        "algo": algo or "default",
        "reward": float(m.group(2)),
        "wall_s": wall,
        "s_per_step": float(s.group(1)) if s else float("nan"),
        "exit": out.returncode,
        "load": load,
        "reach": reach,
    }


def first_reaching(metrics: Path, target: float = 0.9, window: int = 5) -> int | None:
    """The first step whose trailing ``window``-step mean reward is at least ``target`` (None: never)."""
    if not metrics.is_file():
        return None
    rewards = [json.loads(line)["reward"] for line in metrics.read_text().splitlines() if line.strip()]
    for i in range(len(rewards)):
        part = rewards[max(0, i - window + 1) : i + 1]
        if sum(part) / len(part) >= target:
            return i + 1
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--algos",
        nargs="+",
        choices=["grpo", "ppo"],
        default=None,
        help="run each seed and thread count with each --algo of ppo_toy.py, in this order (default: its default)",
    )
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("extra", nargs="*", help="more ppo_toy.py flags (after --)")
    args = p.parse_args()
    rows = []
    algos = args.algos or [None]
    with tempfile.TemporaryDirectory() as tmp:
        for threads in args.threads:
            for seed in args.seeds:
                for algo in algos:
                    row = run_one(seed, threads, args.extra, Path(tmp), algo)
                    rows.append(row)
                    print(
                        f"{row['algo']} seed {row['seed']} OMP_NUM_THREADS={row['threads']}: final reward {row['reward']:.3f}, "
                        f"wall {row['wall_s']:.1f} s ({row['s_per_step']:.3f} s/step), exit {row['exit']}, "
                        f"load {row['load']:.1f}, 5-step mean >= 0.9 from step {row['reach']}",
                        flush=True,
                    )
    ratio = {}
    if args.algos and {"grpo", "ppo"} <= set(args.algos):
        wall = {(r["algo"], r["seed"], r["threads"]): r["wall_s"] for r in rows}
        ratio = {(s, t): wall[("ppo", s, t)] / wall[("grpo", s, t)] for _, s, t in wall}
        speed = {(r["algo"], r["seed"], r["threads"]): r["s_per_step"] for r in rows}
        step_ratio = [speed[("ppo", s, t)] / speed[("grpo", s, t)] for s, t in ratio]
    for algo in algos:
        part = [r for r in rows if r["algo"] == (algo or "default")]
        rewards = [r["reward"] for r in part]
        print(
            f"{algo or 'default'}: min {min(rewards):.3f}, mean {sum(rewards) / len(rewards):.3f}, "
            f"max wall {max(r['wall_s'] for r in part):.1f} s over {len(part)} runs"
        )
    if ratio:
        print(
            f"wall time ppo / grpo: min {min(ratio.values()):.2f}, max {max(ratio.values()):.2f} over {len(ratio)} pairs "
            f"(s/step: min {min(step_ratio):.2f}, max {max(step_ratio):.2f})"
        )
    if args.markdown:
        print(
            "\n| algo | seed | OMP_NUM_THREADS | final reward | >= 0.9 from step | wall time (s) | s/step | load at start |"
            + (" wall ppo / grpo |" if ratio else "")
            + "\n|---|---|---|---|---|---|---|---|"
            + ("---|" if ratio else "")
        )
        for r in rows:
            extra = (
                f" {ratio[(r['seed'], r['threads'])]:.2f} |"
                if ratio and r["algo"] == "ppo"
                else (" |" if ratio else "")
            )
            print(
                f"| {r['algo']} | {r['seed']} | {r['threads']} | {r['reward']:.3f} | {r['reach']} | {r['wall_s']:.1f} | {r['s_per_step']:.3f} | "
                f"{r['load']:.1f} |{extra}"
            )
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
