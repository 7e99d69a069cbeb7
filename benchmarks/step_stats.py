"""Summaries of ``benchmarks/step.py --json`` lines: per run and across runs.

    python3 benchmarks/step_stats.py step.jsonl [more.jsonl ...] [--model qwen2.5-0.5b] [--markdown]

For every run (one JSON line) and path: the median step time, its quartiles and range; the host's
speed probe (a fixed pure-Python loop timed just before each step, ``host_probe_s``) as median,
range and its correlation with the step times (high when the host binds the step and its speed
varies); and for every path other than A the per-round ratio A's step time / the path's (the paths'
steps of one round run back to back), as quartiles, with the ratio of the summed times. Across runs
of one model: the median and range of the per-round medians. Runs without per-step data are
skipped; lines of older runs without the probe report it as absent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); one value gives it three times."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def correlation(xs: list[float], ys: list[float]) -> float | None:
    """Pearson's r, or None for fewer than 3 pairs or no spread."""
    if len(xs) < 3 or len(xs) != len(ys):
        return None
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:  # a constant series
        return None


def paths_of(run: dict) -> list[str]:
    return [p for p in "ABCD" if isinstance(run.get(p), dict) and run[p].get("step_s")]


def run_summary(run: dict) -> dict:
    """Per-path statistics of one run (see the module docstring)."""
    out: dict = {"model": run.get("model"), "rotate": run.get("rotate"), "paths": {}}
    a = run["A"]["step_s"] if "A" in paths_of(run) else None
    for p in paths_of(run):
        s = run[p]["step_s"]
        q1, med, q3 = quartiles(s)
        row = {
            "steps": len(s),
            "median_ms": 1e3 * med,
            "q1_ms": 1e3 * q1,
            "q3_ms": 1e3 * q3,
            "min_ms": 1e3 * min(s),
            "max_ms": 1e3 * max(s),
        }
        probe = run[p].get("host_probe_s")
        if probe:
            row.update(
                probe_median_ms=1e3 * statistics.median(probe),
                probe_min_ms=1e3 * min(probe),
                probe_max_ms=1e3 * max(probe),
                probe_step_r=correlation(s, probe),
            )
        if a is not None and p != "A":
            ratios = [x / y for x, y in zip(a, s)]
            r1, rm, r3 = quartiles(ratios)
            row.update(ratio_q1=r1, ratio_median=rm, ratio_q3=r3, ratio_of_sums=sum(a[: len(s)]) / sum(s[: len(a)]))
        out["paths"][p] = row
    return out


def across(runs: list[dict]) -> dict:
    """Per model and path: the per-round median ratios of its runs, their median and range."""
    by: dict = {}
    for r in runs:
        for p, row in r["paths"].items():
            if "ratio_median" in row:
                by.setdefault(r["model"], {}).setdefault(p, []).append(row["ratio_median"])
    return {
        m: {p: {"runs": len(v), "median": statistics.median(v), "min": min(v), "max": max(v)} for p, v in d.items()}
        for m, d in by.items()
    }


def fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown(runs: list[dict], summary: dict) -> str:
    lines = [
        "| run | model | rounds | A median step ms (range) | host probe ms (range), r with A's steps | C / A per round: q1, median, q3 | D / A per round: q1, median, q3 |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs, 1):
        P = r["paths"]
        A = P.get("A", {})
        probe = (
            "not recorded"
            if "probe_median_ms" not in A
            else (
                f"{A['probe_median_ms']:.1f} ({A['probe_min_ms']:.1f}–{A['probe_max_ms']:.1f}), {fmt(A.get('probe_step_r'), '.2f')}"
            )
        )
        cells = [
            str(i),
            str(r["model"]),
            str(A.get("steps", "–")),
            f"{fmt(A.get('median_ms'), '.1f')} ({fmt(A.get('min_ms'), '.0f')}–{fmt(A.get('max_ms'), '.0f')})",
            probe,
        ]
        for p in "CD":
            row = P.get(p)
            cells.append(
                "–"
                if not row or "ratio_median" not in row
                else f"{row['ratio_q1']:.3f}, **{row['ratio_median']:.3f}**, {row['ratio_q3']:.3f}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for m, d in summary.items():
        for p, v in sorted(d.items()):
            lines.append(
                f"{m}: {p} / A per-round medians over {v['runs']} runs: median {v['median']:.3f}, range {v['min']:.3f}–{v['max']:.3f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--model", help="only runs of this model")
    ap.add_argument("--markdown", action="store_true", help="print a table instead of JSON")
    args = ap.parse_args(argv)
    runs = []
    for f in args.files:
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            run = json.loads(line)
            if not paths_of(run) or (args.model and run.get("model") != args.model):
                continue
            runs.append(run_summary(run))
    summary = across(runs)
    if args.markdown:
        print(markdown(runs, summary))
    else:
        print(json.dumps({"runs": runs, "across_runs": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
