"""README.md cannot go stale: every Python block runs as written, and quoted layout-check values match.

* Each ```python block runs in a fresh process on the CPU as ``python block.py`` would, and also
  as under ``torchrun --nproc-per-node 2`` when an HTML comment ``<!-- readme-test: also under
  torchrun ... -->`` stands right before it (how: ``tests/test_docs.py``), and then a block that
  prints a dict of metrics (the compose block) prints the same on one and two ranks.
* The first-step loss and grad norm quoted in the ``figures:layout-check`` block equal what
  ``examples/ppo_toy.py --layout-check`` prints now, on 1 process and on 2 (DP=2), to 1e-6 relative.
* README stays short (at most 1,500 words; the details live in docs/), and its main and test commands
  are the ones ``.ci/run`` reads between their markers.

The guides' code, links and commands are checked by ``tests/test_docs.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.scripts import run_script
from tests.test_docs import _run_file

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"(<!-- readme-test: ([^>]*)-->\n)?```python\n(.*?)```", re.S)
BLOCKS = [(m.group(3), (m.group(2) or "").strip()) for m in BLOCK.finditer(README)]
NOT_RUN = "# not run:"


def _block_id(i: int) -> str:
    return f"block{i}-" + re.sub(r"\W+", "_", BLOCKS[i][0].splitlines()[0])[:30]


def test_readme_has_a_compose_example_that_runs():
    assert len(BLOCKS) >= 1, "README.md lost its compose example"
    assert not any(b.startswith(NOT_RUN) for b, _ in BLOCKS)  # blocks that cannot run live in the guides
    assert any("torchrun --nproc-per-node 2" in m for _, m in BLOCKS)


def test_readme_is_short():
    words = len(README.split())  # as wc -w counts
    assert words <= 1500, f"README.md has {words} words; move details into docs/"


MAIN = (
    'python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e ".[test,examples,log]" && '
    ".venv/bin/python examples/ppo_toy.py"
)
TESTS = ".venv/bin/python -m pytest -q -n 2"


@pytest.mark.parametrize("marker,command", [("main-command", MAIN), ("test-command", TESTS)])
def test_ci_reads_the_main_and_test_commands_between_their_markers(marker, command):
    m = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)\n```\n<!-- /{marker} -->", README, re.S)
    assert m, f"README.md lost its {marker} markers (.ci/run reads them)"
    assert m.group(1) == command


@pytest.mark.parametrize("i", [i for i, (b, _) in enumerate(BLOCKS) if not b.startswith(NOT_RUN)], ids=_block_id)
def test_python_block_runs_as_written(i, tmp_path):
    """Each block prints what it computed, quietly; a block marked for torchrun also runs on two
    ranks, and when it prints a dict of metrics last (the compose block), both runs print the same."""
    code, marker = BLOCKS[i]
    path = tmp_path / "block.py"
    path.write_text(code)
    out = _run_file(path, 1)
    assert out.stdout.strip(), "a README example should print what it computed"
    assert "Warning" not in out.stderr, out.stderr[-3000:]  # fnppo is quiet by default
    if "torchrun --nproc-per-node 2" not in marker:
        return
    out2 = _run_file(path, 2)
    assert out2.stdout.strip()
    one, two = out.stdout.strip().splitlines()[-1], out2.stdout.strip().splitlines()[-1]
    if one.startswith("{"):
        a, b = ast.literal_eval(one), ast.literal_eval(two)
        assert a.keys() == b.keys()
        for k in a:
            assert abs(a[k] - b[k]) <= 2e-5 * max(1.0, abs(a[k])), (k, a[k], b[k])


def test_the_compose_block_runs_on_two_ranks_and_prints_its_metrics():
    marked = [b for b, m in BLOCKS if "torchrun --nproc-per-node 2" in m]
    assert marked, "README's compose block lost its torchrun marker"
    assert any("print({" in b for b in marked), marked  # its metrics, compared across the two runs


LAYOUT_CHECK = re.compile(r"<!-- figures:layout-check -->\n```\n(.*?)```", re.S)
LINE = re.compile(r"^\$ (.*?)\s+# loss=(\S+) grad_norm=(\S+)$", re.M)
PRINTED = re.compile(r"first-step loss=(\S+) grad_norm=(\S+)")


@pytest.mark.parametrize("which", [0, 1], ids=["1proc", "dp2"])
def test_quoted_layout_check_values_match_the_code(which, tmp_path):
    block = LAYOUT_CHECK.search(README)
    assert block, "README.md lost its figures:layout-check block"
    lines = LINE.findall(block.group(1))
    assert len(lines) == 2, lines
    cmd, loss, norm = lines[which]
    args = cmd.split()
    assert args[0] in (".venv/bin/python", ".venv/bin/torchrun"), args  # README's main command never activates .venv
    quoted = args[args.index("examples/ppo_toy.py") :]
    assert quoted == [
        "examples/ppo_toy.py",
        "--no-progress",
        "--steps",
        "1",
        "--layout-check",
        "--target-reward",
        "0",
    ], args
    run_args = [
        "--no-progress",
        "--no-plot",
        "--out-dir",
        str(tmp_path / "run"),
        "--steps",
        "1",
        "--layout-check",
        "--target-reward",
        "0",
    ]
    nproc = 2 if args[0].endswith("torchrun") else 1
    out = run_script(ROOT / "examples/ppo_toy.py", run_args, nproc=nproc, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    m = PRINTED.search(out.stdout)
    assert m, out.stdout
    for quoted, printed in ((loss, m.group(1)), (norm, m.group(2))):
        assert abs(float(quoted) - float(printed)) <= 1e-6 * abs(float(printed)), (
            f"README quotes {quoted}, the code prints {printed}: run benchmarks/readme_figures.py --write"
        )
