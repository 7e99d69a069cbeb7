"""Stale rollouts: the main job trained from rollouts sampled by the policy K updates old, per policy loss.

Runs ``examples/ppo_toy.py --staleness K --policy-loss L`` for every K, loss, seed and
``OMP_NUM_THREADS`` value of the grid (other flags after ``--``, e.g. ``-- --sampler-dtype bf16`` for a
sampler with other numerics than the fp32 trainer), ``--jobs N`` runs at a time, and records per run
(one JSON line to ``--rows``, appended as soon as the run ends; a later call skips the runs already
there, ``--report`` only reads the file):

* the final reward (mean of the last 5 steps),
* the first step at which the mean reward of the last 5 steps reaches 0.9 (``-``: never),
* the mean over steps of the KL between the behaviour policy (the sampler's log-probs) and the current
  one (the trainer's recompute before the update), per token, k3 estimator
  (``offpolicy/kl_behaviour_k3`` of the run's ``metrics.jsonl``; an on-policy run does not record it).

It writes a markdown table (one row per loss and K: mean and minimum final reward over the runs,
steps to 0.9, mean KL, runs below 0.9) to ``--markdown`` and a plot (mean reward per step, one panel
per loss, one line per K) to ``--plot``.

    python benchmarks/staleness.py --staleness 0 2 --losses ppo tis --seeds 0 --threads 1 --steps 30   # a tiny grid
    python benchmarks/staleness.py --jobs 8                                # the full grid: K 0 1 2 4 8 x 5 losses x 5 seeds x 1, 2 threads
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from toy.losses import POLICY_LOSSES  # noqa: E402
from toy_robustness import first_reaching, parse_seeds, read_rows, run_and_record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.9
FINAL_WINDOW = 5


def run_one(k: int, loss: str, seed: int, threads: int, steps: int, extra: list[str], out_root: Path) -> dict:
    """One run of the grid; its row (the metrics read back from the run's ``metrics.jsonl``)."""
    out_dir = out_root / f"{loss}-k{k}-seed{seed}-omp{threads}"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "ppo_toy.py"),
        *("--staleness", str(k), "--policy-loss", loss, "--seed", str(seed), "--steps", str(steps)),
        *("--no-progress", "--no-plot", "--target-reward", "0", "--overwrite", "--out-dir", str(out_dir)),
        *extra,
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward"] for r in rows]
    kls = [r["offpolicy/kl_behaviour_k3"] for r in rows if "offpolicy/kl_behaviour_k3" in r]  # (none: on-policy)
    return {
        "staleness": k,
        "loss": loss,
        "seed": seed,
        "threads": threads,
        "steps": steps,
        "extra": extra,
        "final": sum(rewards[-FINAL_WINDOW:]) / len(rewards[-FINAL_WINDOW:]),
        "reach": first_reaching(rewards, TARGET, FINAL_WINDOW),
        "kl": sum(kls) / len(kls) if kls else None,
        "rewards": [round(x, 5) for x in rewards],
        "wall_s": round(time.perf_counter() - start, 1),
    }


def table(rows: list[dict], ks: list[int], losses: list[str]) -> str:
    """Markdown: one row per (loss, K) over its runs (seeds x threads)."""
    lines = [
        "| loss | K | runs | final reward, mean (min) | steps to 0.9, mean (max) | KL(behaviour, current) per token | below 0.9 |",
        "|---|---|---|---|---|---|---|",
    ]
    for loss in losses:
        for k in ks:
            group = [r for r in rows if r["loss"] == loss and r["staleness"] == k]
            if not group:
                continue
            finals = [r["final"] for r in group]
            reached = [r["reach"] for r in group if r["reach"] is not None]
            never = len(group) - len(reached)
            steps = (
                "-"
                if not reached
                else f"{sum(reached) / len(reached):.0f} ({max(reached)})" + (f", {never} never" if never else "")
            )
            kls = [r["kl"] for r in group if r["kl"] is not None]
            kl = f"{sum(kls) / len(kls):.2e}" if kls else "on-policy"
            below = sum(f < TARGET for f in finals)
            lines.append(
                f"| {loss} | {k} | {len(group)} | {sum(finals) / len(finals):.3f} ({min(finals):.3f}) | {steps} "
                f"| {kl} | {below} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], ks: list[int], losses: list[str], path: Path) -> None:
    """One panel per loss: the mean reward per step over the runs, one line per K."""
    import matplotlib  # (optional: the [examples] extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = [loss for loss in losses if any(r["loss"] == loss for r in rows)]  # those with runs
    cols = min(4, len(losses))
    nrows = -(-len(losses) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.4 * nrows), squeeze=False, sharey=True)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(losses) :]:
        ax.set_visible(False)
    for ax, loss in zip(flat, losses):
        for k in ks:
            curves = [r["rewards"] for r in rows if r["loss"] == loss and r["staleness"] == k]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            mean = [sum(c[i] for c in curves) / len(curves) for i in range(n)]
            ax.plot(range(1, n + 1), mean, label=f"K={k}")
        ax.axhline(TARGET, color="tab:gray", ls="--", lw=0.8)
        ax.set_title(loss, fontsize=9)
        ax.set_xlabel("training step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("mean reward over runs")
    flat[0].legend(fontsize=8, loc="lower right")
    fig.suptitle("count-on toy trained from rollouts K updates old", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="values of K")
    p.add_argument("--losses", nargs="+", choices=list(POLICY_LOSSES), default=list(POLICY_LOSSES))
    p.add_argument("--seeds", nargs="+", default=["0-4"], help="seeds: N or A-B (default: 0-4)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="OMP_NUM_THREADS values")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--rows", type=Path, default=ROOT / "runs" / "staleness" / "rows.jsonl")
    p.add_argument("--markdown", type=Path, default=ROOT / "runs" / "staleness" / "staleness.md")
    p.add_argument("--plot", type=Path, default=ROOT / "runs" / "staleness" / "staleness.png")
    p.add_argument("--report", action="store_true", help="only read --rows, write the table and the plot")
    p.add_argument("extra", nargs="*", help="more ppo_toy.py flags (after --)")
    args = p.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds)
    except argparse.ArgumentTypeError as err:
        p.error(str(err))
    if args.jobs < 1 or args.steps < 1 or min(args.staleness) < 0 or min(args.threads) < 1:
        p.error("--jobs, --steps and --threads must be >= 1, --staleness >= 0")
    done = [r for r in read_rows(args.rows) if r["steps"] == args.steps and r["extra"] == args.extra]
    have = {(r["staleness"], r["loss"], r["seed"], r["threads"]) for r in done}
    todo = [
        (k, loss, seed, t)
        for loss in args.losses
        for k in args.staleness
        for seed in seeds
        for t in args.threads
        if (k, loss, seed, t) not in have
    ]
    if not args.report and todo:
        args.rows.parent.mkdir(parents=True, exist_ok=True)
        print(f"{len(todo)} runs, {args.jobs} at a time ({len(have)} already in {args.rows})", flush=True)
        calls = [
            functools.partial(run_one, k, loss, s, t, args.steps, args.extra, args.rows.parent / "runs")
            for k, loss, s, t in todo
        ]
        done += run_and_record(
            calls,
            args.jobs,
            args.rows,
            lambda row: (
                f"{row['loss']} K={row['staleness']} seed {row['seed']} omp {row['threads']}: final "
                f"{row['final']:.3f}, 0.9 at {row['reach']}, KL {row['kl']} ({row['wall_s']:.0f} s)"
            ),
        )
    rows = [r for r in done if r["staleness"] in args.staleness and r["loss"] in args.losses and r["seed"] in seeds]
    rows = [r for r in rows if r["threads"] in args.threads]
    text = table(rows, args.staleness, args.losses)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(text)
    print(text, end="")
    print(f"table: {args.markdown}")
    try:
        plot(rows, args.staleness, args.losses, args.plot)
        print(f"plot: {args.plot}")
    except ImportError:
        print("plot: skipped (matplotlib is not installed; pip install 'fnppo[examples]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
