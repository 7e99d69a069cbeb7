"""The toy's on-policy distillation study: a smaller student reaches its teacher's reward in fewer steps
than RL alone, from the same initial weights (docs/distillation.md regenerates its table and plot from it).

1. The teacher: the toy's default run (``examples/ppo_toy.py``, hidden 64, 2 layers, 100 steps),
   saved (``--save-every``); trained here unless ``--teacher`` names an existing run.
2. For each seed, three students of ``--student-hidden`` (default 32) and 2 layers, the same initial
   weights (``layout_invariant_init`` from the seed) and the same prompts and sampling uniforms:
   ``rl`` (GRPO alone), ``rl+distill`` (GRPO + reverse KL to the teacher, ``--distill-from``) and
   ``distill`` (the reverse-KL term alone, ``--distill-only``).
3. Per run: the first step at which the mean reward of the last 5 steps reaches ``--level`` (0.9), the
   level the teacher holds (the lowest mean of 5 steps over its last 20: its own sampling noise) and
   the teacher's final reward (the mean of its last 5 steps); the final reward (mean of the last 5).

A run whose ``metrics.jsonl`` already holds ``--steps`` rows is read, not rerun. Prints the markdown
table; ``--plot PATH`` draws the reward curves; ``$OUT/distill_toy.json`` holds every number when
``OUT`` is set::

    OMP_NUM_THREADS=1 python benchmarks/distill_toy.py --runs runs/distill --plot docs/images/distillation.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "examples" / "ppo_toy.py"
WINDOW = 5
HELD = 20  # the teacher's held level: the lowest trailing mean over its last HELD steps
MODES = {
    "rl": [],
    "rl+distill": ["--distill-from", "{teacher}"],
    "distill": ["--distill-from", "{teacher}", "--distill-only"],
}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="runs/distill", help="where the runs go (default: %(default)s)")
    p.add_argument(
        "--teacher", default=None, help="an existing teacher toy run (default: RUNS/teacher, trained if missing)"
    )
    p.add_argument("--teacher-steps", type=int, default=100)
    p.add_argument("--student-hidden", type=int, default=32)
    p.add_argument("--steps", type=int, default=100, help="student steps (default: %(default)s)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--plot", default=None, help="write the reward curves to this PNG")
    p.add_argument(
        "--level", type=float, default=0.9, help="a second reward level to report the steps to (default: %(default)s)"
    )
    return p.parse_args(argv)


def rows_of(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def toy(args: list[str]) -> None:
    """One toy run in its own process (its output to the terminal); it must exit 0."""
    cmd = [sys.executable, str(TOY), "--no-progress", "--no-plot", "--target-reward", "0", *args]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def trailing(values: list[float], window: int = WINDOW) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def first_reach(rewards: list[float], threshold: float) -> int | None:
    """The first step (1-based) whose trailing mean of ``WINDOW`` rewards (full windows only) is >= ``threshold``."""
    smooth = trailing(rewards)
    for i, v in enumerate(smooth):
        if i + 1 >= WINDOW and v >= threshold:
            return i + 1
    return None


def main(argv=None) -> int:
    args = parse(argv)
    runs = Path(args.runs)
    teacher = Path(args.teacher) if args.teacher else runs / "teacher"
    if len(rows_of(teacher)) < args.teacher_steps and args.teacher is None:
        toy(
            [
                "--steps",
                str(args.teacher_steps),
                "--save-every",
                str(args.teacher_steps),
                "--out-dir",
                str(teacher),
                "--overwrite",
            ]
        )
    t_rewards = [r["reward"] for r in rows_of(teacher)]
    target = sum(t_rewards[-WINDOW:]) / WINDOW
    held = min(trailing(t_rewards)[-HELD:])  # the level the teacher itself holds at the end of its run
    results: dict[str, dict[int, dict]] = {m: {} for m in MODES}
    for seed in args.seeds:
        for mode, extra in MODES.items():
            run = runs / f"{mode}-seed{seed}"
            if len(rows_of(run)) < args.steps:
                flags = [a.format(teacher=teacher) for a in extra]
                toy(
                    ["--seed", str(seed), "--hidden", str(args.student_hidden), "--steps", str(args.steps)]
                    + ["--out-dir", str(run), "--overwrite", *flags]
                )
            rewards = [r["reward"] for r in rows_of(run)][: args.steps]
            results[mode][seed] = {
                "rewards": rewards,
                "reach": first_reach(rewards, target),
                "reach_held": first_reach(rewards, held),
                "reach_level": first_reach(rewards, args.level),
                "final": sum(rewards[-WINDOW:]) / WINDOW,
            }
    table(results, target, held, args)
    # the same initial weights and the same sampling uniforms: every mode's first step samples the same responses
    same = all(len({results[m][s]["rewards"][0] for m in MODES}) == 1 for s in args.seeds)
    print(f"first-step rewards equal across the three students of each seed (same start): {same}")
    if args.plot:
        plot(results, target, held, args, Path(args.plot))
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "distill_toy.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"teacher_final_reward": target, "teacher_held_level": held, "args": vars(args), "runs": results}
        path.write_text(json.dumps(data, indent=1))
        print(f"wrote {path}")
    return 0


def table(results: dict, target: float, held: float, args) -> None:
    seeds = args.seeds
    print(
        f"\nteacher: final reward {target:.3f}, held level {held:.3f} (the lowest mean of {WINDOW} steps over its "
        f"last {HELD}); students of hidden {args.student_hidden}, {args.steps} steps\n"
    )
    head = ", ".join(f"seed {s}" for s in seeds)

    def steps(per, key):
        return ", ".join("-" if per[s][key] is None else str(per[s][key]) for s in seeds)

    print(
        f"| student | steps to {args.level:g} ({head}) | to the teacher's held {held:.3f} | to its final {target:.3f} "
        f"| final reward ({head}) | mean |"
    )
    print("|---|---|---|---|---|---|")
    for mode, per in results.items():
        final = ", ".join(f"{per[s]['final']:.3f}" for s in seeds)
        mean = sum(per[s]["final"] for s in seeds) / len(seeds)
        reach = f"{steps(per, 'reach_level')} | {steps(per, 'reach_held')} | {steps(per, 'reach')}"
        print(f"| {mode} | {reach} | {final} | {mean:.3f} |")
    print(f"\n(-: not within {args.steps} steps; a step's reward is the mean of its last {WINDOW} steps)")


def plot(results: dict, target: float, held: float, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = {"rl": "tab:blue", "rl+distill": "tab:orange", "distill": "tab:green"}
    for mode, per in results.items():
        for i, seed in enumerate(args.seeds):
            curve = trailing(per[seed]["rewards"])
            ax.plot(
                range(1, len(curve) + 1), curve, color=colors[mode], alpha=0.8, lw=1.3, label=mode if i == 0 else None
            )
    ax.axhline(target, color="black", ls="--", lw=1, label=f"teacher's final {target:.3f}")
    ax.axhline(held, color="black", ls=":", lw=1, label=f"teacher's held level {held:.3f}")
    ax.set_xlabel("training step")
    ax.set_ylabel(f"reward (mean of the last {WINDOW} steps)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(
        f"toy: student hidden {args.student_hidden} from a hidden-64 teacher; seeds {', '.join(map(str, args.seeds))}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
