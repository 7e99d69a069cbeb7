"""The main job's margin: the default CPU toy run for several seeds and thread counts.

Runs ``examples/ppo_toy.py`` with its defaults (only ``--seed`` changes) once per seed and per
``OMP_NUM_THREADS`` value, one run at a time, and prints each final reward (mean of the last 5
steps) and wall time, then the minimum and mean. RL trajectories depend on floating-point reduction
order, so a default that passes on one machine must pass with other seeds and thread counts too.

    python benchmarks/toy_robustness.py                       # seeds 0..4 x OMP_NUM_THREADS 1, 2
    python benchmarks/toy_robustness.py --seeds 0 1 --threads 1 --markdown
"""

from __future__ import annotations

import argparse
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


def run_one(seed: int, threads: int, extra: list[str], out_root: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "examples" / "ppo_toy.py"), "--seed", str(seed), "--no-progress",
           "--out-dir", str(out_root / f"seed{seed}-omp{threads}"), *extra]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    m, s = FINAL.search(out.stdout), SPEED.search(out.stdout)
    if m is None:
        raise SystemExit(f"seed {seed}, {threads} threads: no final reward in the output\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return {"seed": seed, "threads": threads, "reward": float(m.group(2)), "wall_s": wall,
            "s_per_step": float(s.group(1)) if s else float("nan"), "exit": out.returncode}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("extra", nargs="*", help="more ppo_toy.py flags (after --)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for threads in args.threads:
            for seed in args.seeds:
                row = run_one(seed, threads, args.extra, Path(tmp))
                rows.append(row)
                print(f"seed {row['seed']} OMP_NUM_THREADS={row['threads']}: final reward {row['reward']:.3f}, "
                      f"wall {row['wall_s']:.1f} s ({row['s_per_step']:.3f} s/step), exit {row['exit']}", flush=True)
    rewards = [r["reward"] for r in rows]
    print(f"min {min(rewards):.3f}, mean {sum(rewards) / len(rewards):.3f}, max wall {max(r['wall_s'] for r in rows):.1f} s over {len(rows)} runs")
    if args.markdown:
        print("\n| seed | OMP_NUM_THREADS | final reward | wall time (s) | s/step |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['seed']} | {r['threads']} | {r['reward']:.3f} | {r['wall_s']:.1f} | {r['s_per_step']:.3f} |")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
