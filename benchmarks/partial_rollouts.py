"""Partial rollouts: the main job trained from responses continued across weight updates, against the
per-sample-version run, with the recommended loss for stale rollouts.

For every K and seed, two runs of ``examples/ppo_toy.py --staleness K --policy-loss decoupled`` (decoupled
PPO with the log-linear proximal policy, bypass mode):

* ``per-sample``: every token of a response sampled by the weights K updates old (one version per
  sample; the loss's one ``K``);
* ``partial`` (``--partial-rollouts``): each response's first token sampled by the weights K updates
  old, each later token by the same or a newer version (``toy.partial``), the samples carrying each
  token's version and the loss each token's own age (``Staleness.prepare``).

Each run is recorded (one JSON line to ``--rows``, appended as soon as it ends; a later call skips the
runs already there, ``--report`` only reads the file): the final reward (mean of the last 5 steps), the
first step at which the 5-step mean reaches 0.9, the mean behaviour/current KL per token (k3) and the
mean token age over the run (``offpolicy/token_staleness_mean``; K for the per-sample run after its first
K steps). The markdown table (``--markdown``) has one row per K: both modes' mean and minimum final
reward, their difference and whether it is within ``--target`` (0.02), the mean step at which the
5-step mean reached 0.9, the mean token age and the mean KL.

    python benchmarks/partial_rollouts.py --staleness 2 4 --seeds 0-2 --jobs 2     # the table of docs/async.md
    python benchmarks/partial_rollouts.py --staleness 2 --seeds 0 --steps 10       # a tiny grid
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from staleness import run_one  # noqa: E402
from toy_robustness import parse_seeds, read_rows, run_and_record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOSS = "decoupled"
MODES = {"per-sample": [], "partial": ["--partial-rollouts"]}
TARGET = 0.02


def run_mode(mode: str, k: int, seed: int, threads: int, steps: int, out_root: Path) -> dict:
    """One run (:func:`staleness.run_one` with the mode's flags) and its mean token age over the run."""
    row = run_one(k, LOSS, seed, threads, steps, MODES[mode], out_root / mode)
    out_dir = out_root / mode / f"{LOSS}-k{k}-seed{seed}-omp{threads}"
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ages = [m["offpolicy/token_staleness_mean"] for m in metrics if "offpolicy/token_staleness_mean" in m]
    ages = ages or [m["offpolicy/staleness"] for m in metrics if "offpolicy/staleness" in m]
    return {**row, "mode": mode, "token_age": sum(ages) / len(ages) if ages else 0.0}


def _summary(runs: list[dict]) -> dict[str, str]:
    """The cells of one mode over its runs: final reward mean (min), steps to 0.9, token age, KL."""
    finals = [r["final"] for r in runs]
    reached = [r["reach"] for r in runs if r["reach"] is not None]
    never = len(runs) - len(reached)
    kls = [r["kl"] for r in runs if r["kl"] is not None]
    return {
        "final": f"{sum(finals) / len(finals):.3f} ({min(finals):.3f})",
        "reach": (f"{sum(reached) / len(reached):.0f}" if reached else "-") + (f" ({never} never)" if never else ""),
        "age": f"{sum(r['token_age'] for r in runs) / len(runs):.2f}",
        "kl": f"{sum(kls) / len(kls):.2e}" if kls else "-",
    }


def table(rows: list[dict], ks: list[int], target: float) -> str:
    """Markdown: one row per K, both modes side by side over the seeds both have."""
    lines = [
        "| K | seeds | per-sample final reward, mean (min) | partial final reward, mean (min) | partial - per-sample "
        f"| within {target:g} | steps to 0.9, mean: per-sample, partial | mean token age: per-sample, partial "
        "| KL(behaviour, current): per-sample, partial |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in ks:
        runs = {m: [r for r in rows if r["staleness"] == k and r["mode"] == m] for m in MODES}
        seeds = sorted({r["seed"] for r in runs["per-sample"]} & {r["seed"] for r in runs["partial"]})
        if not seeds:
            continue
        runs = {m: [r for r in group if r["seed"] in seeds] for m, group in runs.items()}
        mean = {m: sum(r["final"] for r in group) / len(group) for m, group in runs.items()}
        a, b = _summary(runs["per-sample"]), _summary(runs["partial"])
        diff = mean["partial"] - mean["per-sample"]
        lines.append(
            f"| {k} | {', '.join(map(str, seeds))} | {a['final']} | {b['final']} | {diff:+.3f} "
            f"| {'yes' if abs(diff) <= target else 'no'} | {a['reach']}, {b['reach']} | {a['age']}, {b['age']} "
            f"| {a['kl']}, {b['kl']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--staleness", type=int, nargs="+", default=[2, 4], help="values of K (>= 1)")
    p.add_argument("--seeds", nargs="+", default=["0-2"], help="seeds: N or A-B (default: 0-2)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--target", type=float, default=TARGET, help="the largest |partial - per-sample| mean final reward")
    p.add_argument("--rows", type=Path, default=ROOT / "runs" / "partial_rollouts" / "rows.jsonl")
    p.add_argument("--markdown", type=Path, default=ROOT / "runs" / "partial_rollouts" / "partial_rollouts.md")
    p.add_argument("--report", action="store_true", help="only read --rows and write the table")
    args = p.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds)
    except argparse.ArgumentTypeError as err:
        p.error(str(err))
    if args.jobs < 1 or args.steps < 1 or args.threads < 1 or min(args.staleness) < 1:
        p.error("--jobs, --steps, --threads and --staleness must be >= 1")
    done = [r for r in read_rows(args.rows) if r["steps"] == args.steps and r["threads"] == args.threads]
    have = {(r["mode"], r["staleness"], r["seed"]) for r in done}
    todo = [(m, k, s) for k in args.staleness for s in seeds for m in MODES if (m, k, s) not in have]
    if not args.report and todo:
        args.rows.parent.mkdir(parents=True, exist_ok=True)
        print(f"{len(todo)} runs, {args.jobs} at a time ({len(have)} already in {args.rows})", flush=True)
        calls = [
            functools.partial(run_mode, m, k, s, args.threads, args.steps, args.rows.parent / "runs")
            for m, k, s in todo
        ]
        done += run_and_record(
            calls,
            args.jobs,
            args.rows,
            lambda row: (
                f"{row['mode']} K={row['staleness']} seed {row['seed']}: final {row['final']:.3f}, 0.9 at "
                f"{row['reach']}, token age {row['token_age']:.2f} ({row['wall_s']:.0f} s)"
            ),
        )
    rows = [r for r in done if r["staleness"] in args.staleness and r["seed"] in seeds]
    text = table(rows, args.staleness, args.target)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(text)
    print(text, end="")
    print(f"table: {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
