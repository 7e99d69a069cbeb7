"""Regenerate the figures README.md quotes, by running the commands written beside them.

* ``figures:toy``: the default CPU toy run (``examples/ppo_toy.py``): s/step and final reward;
* ``figures:layout-check``: ``--no-progress --steps 1 --layout-check`` on 1 process and under
  ``torchrun --nproc-per-node 2`` (DP=2), quoted to 7 significant digits with the commands as a reader
  runs them (``.venv/bin/python``, ``.venv/bin/torchrun``; ``tests/test_readme.py`` compares them with
  the code at 1e-6 relative);
* ``figures:tests`` (with ``--tests``, or ``--tests-from LOG`` to read a log of README's test
  command such as CI's output): the number of tests and the suite's wall time.

Without ``--write`` it prints the new blocks; with it, it replaces them in README.md.

    .venv/bin/python benchmarks/readme_figures.py                 # print
    .venv/bin/python benchmarks/readme_figures.py --write --tests # update README.md (runs the whole suite)

CI (``.ci/run``) does not run it: it runs README's main and test commands.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "examples" / "ppo_toy.py"
CHECK_ARGS = ["--no-progress", "--steps", "1", "--layout-check", "--target-reward", "0"]
READER = {1: ".venv/bin/python", 2: ".venv/bin/torchrun --nproc-per-node 2"}  # the commands as README quotes them


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layout_check_block(tmp: Path) -> str:
    one = _run([sys.executable, str(TOY), *CHECK_ARGS, "--no-plot", "--out-dir", str(tmp / "lc1")])
    two = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={free_port()}",
            str(TOY),
            *CHECK_ARGS,
            "--no-plot",
            "--out-dir",
            str(tmp / "lc2"),
        ]
    )
    cmds = [f"$ {READER[n]} examples/ppo_toy.py {' '.join(CHECK_ARGS)}" for n in (1, 2)]
    width = max(len(c) for c in cmds) + 1
    lines = []
    for cmd, out in zip(cmds, (one, two), strict=True):
        m = re.search(r"first-step loss=(\S+) grad_norm=(\S+)", out)
        lines.append(f"{cmd:<{width}}# loss={float(m.group(1)):.6e} grad_norm={float(m.group(2)):.6e}")
    return "```\n" + "\n".join(lines) + "\n```"


def toy_block(tmp: Path) -> str:
    out = _run([sys.executable, str(TOY), "--no-progress", "--out-dir", str(tmp / "toy")])
    speed = re.search(r"steps: (\d+), wall time ([0-9.]+) s \(([0-9.]+) s/step\)", out)
    final = re.search(r"final reward \(mean of last \d+ steps\): ([0-9.]+)", out)
    return (
        "| where | command | wall time per step | final reward |\n|---|---|---|---|\n"
        f"| CPU, 2 cores, fp32 | `.venv/bin/python examples/ppo_toy.py` | {float(speed.group(3)):.2f} s "
        f"({speed.group(1)} steps, {float(speed.group(2)):.0f} s) | {final.group(1)} |"
    )


def tests_figure(log: Path | None) -> str:
    """Test count and wall time: from a log of README's test command (e.g. the CI output), or by running it."""
    if log is not None:
        text = log.read_text()
    else:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-n", "2"], capture_output=True, text=True, env=_env(), cwd=ROOT
        )
        text = out.stdout if out.returncode == 0 else ""
    m = re.search(r"(\d+) passed(?:, (\d+) skipped)?.* in ([0-9.]+)s", text)
    if m is None or " failed" in m.group(0):
        raise SystemExit(f"no passing pytest summary line in the test output:\n{text[-4000:]}")
    return f"{m.group(1)} tests, about {float(m.group(3)) / 60:.0f} minutes on 2 cores"


def replace(text: str, name: str, body: str, inline: bool = False) -> str:
    sep = "" if inline else "\n"
    pattern = re.compile(rf"(<!-- figures:{name} -->){sep}.*?{sep}(<!-- /figures:{name} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"README.md has no figures:{name} block")
    return pattern.sub(lambda m: m.group(1) + sep + body + sep + m.group(2), text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="update README.md in place")
    p.add_argument("--tests", action="store_true", help="also run the whole test suite for its count and time")
    p.add_argument(
        "--tests-from",
        type=Path,
        default=None,
        help="read the count and time from this log of the test command instead",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        blocks = {"layout-check": layout_check_block(Path(tmp)), "toy": toy_block(Path(tmp))}
    if args.tests or args.tests_from:
        blocks["tests"] = tests_figure(args.tests_from)
    readme = (ROOT / "README.md").read_text()
    for name, body in blocks.items():
        print(f"--- figures:{name}\n{body}")
        readme = replace(readme, name, body, inline=name == "tests")
    if args.write:
        (ROOT / "README.md").write_text(readme)
        print("README.md updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
