"""docs/errors.md: every row of its tables names at least one test, and every test it names exists.

Test ids are checked against pytest's own collection (``--collect-only``), so a parametrized id
such as ``test_bad_input[ppo_loss-empty]`` or ``test_faults.py::...[other_shape]`` must be a real
test case, not only a function name.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"
REF = re.compile(r"`(tests/test_\w+\.py)::(test_\w+)(\[[^\]`]*\])?`")


def _rows() -> list[str]:
    """The body rows of every table (header and separator rows left out)."""
    rows, body = [], False
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            body = False
        elif re.match(r"^\|[-| ]+\|$", line):  # the separator under a header row
            body = True
        elif body:
            rows.append(line)
    return rows


def _collected(files: list[str]) -> set[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:warnings", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return {line.strip() for line in out.stdout.splitlines() if "::" in line}


def test_every_row_names_a_test():
    rows = _rows()
    assert len(rows) > 80, len(rows)  # the tables were found
    without = [row[:120] for row in rows if not REF.search(row.rsplit("|", 2)[-2])]
    assert not without, f"rows of {DOC.name} without a test in their last column: {without}"


def test_every_named_test_exists():
    refs = {(f, name, param or "") for f, name, param in REF.findall(DOC.read_text())}
    assert refs
    ids = _collected(sorted({f for f, _, _ in refs}))
    missing = []
    for f, name, param in sorted(refs):
        node = f"{f}::{name}"
        if param:
            # an exact case, or (for ids shared by a fixture-parametrized test) a case containing it
            found = node + param in ids or any(i.startswith(node + "[") and param[1:-1] in i for i in ids)
        else:
            found = node in ids or any(i.startswith(node + "[") for i in ids)
        if not found:
            missing.append(node + param)
    assert not missing, f"tests named in {DOC.name} that pytest does not collect: {missing}"
