"""docs/errors.md: every row of its tables names at least one test, and every test it names exists.

Test ids are checked against pytest's own collection (this session's, or for files it did not collect
``--collect-only`` in a fork of the process that imported torch and fnppo once: ``tests/scripts.py``), so a parametrized id
such as ``test_bad_input[ppo_loss-empty]`` or ``test_faults.py::...[other_shape]`` must be a real
test case, not only a function name.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.scripts import run_script

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
    """pytest's ``--collect-only`` ids of ``files`` (in a fork of the preloaded server: tests/scripts.py)."""
    code = "import sys, pytest\nsys.exit(pytest.main(sys.argv[1:]))"
    out = run_script(
        None, ["--collect-only", "-q", "-p", "no:warnings", "-p", "no:cacheprovider", *files], cwd=ROOT, code=code
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return {line.strip() for line in out.stdout.splitlines() if "::" in line}


def test_every_row_names_a_test():
    rows = _rows()
    assert len(rows) > 80, len(rows)  # the tables were found
    without = [row[:120] for row in rows if not REF.search(row.rsplit("|", 2)[-2])]
    assert not without, f"rows of {DOC.name} without a test in their last column: {without}"


def test_every_named_test_exists(request):
    refs = {(f, name, param or "") for f, name, param in REF.findall(DOC.read_text())}
    assert refs
    files = sorted({f for f, _, _ in refs})
    # this session's own collection where it holds a file (a whole-suite run: every file), pytest's
    # --collect-only of the others
    ids = {item.nodeid for item in request.session.items if item.nodeid.split("::")[0] in files}
    rest = sorted(set(files) - {i.split("::")[0] for i in ids})
    ids |= _collected(rest) if rest else set()
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
