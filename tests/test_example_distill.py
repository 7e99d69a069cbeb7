"""examples/ppo_toy.py --distill-from: a teacher run trains one step and saves, a smaller student
distills from it for one step (its loss is the GRPO loss plus the reverse-KL term, reported as
``distill_loss``); the flags' refusals (one line, exit 2, before torch is imported)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.scripts import run_script

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ppo_toy.py"
sys.path.insert(0, str(ROOT / "examples"))

from toy import checks, cli  # noqa: E402
from toy.errors import ArgumentError  # noqa: E402

SMALL = ["--prompts", "4", "--group-size", "4", "--no-progress", "--no-plot", "--target-reward", "0", "--steps", "1"]


def _run(args: list[str], cwd: Path):
    out = run_script(EXAMPLE, args, cwd=cwd, timeout=600)
    assert out.returncode == 0, f"{args}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A wider toy run of one step that saved its checkpoint."""
    d = tmp_path_factory.mktemp("teacher")
    _run([*SMALL, "--hidden", "96", "--save-every", "1", "--out-dir", str(d / "run")], d)
    return d / "run"


def test_a_student_distills_from_a_teacher_run(teacher, tmp_path):
    out = _run([*SMALL, "--hidden", "32", "--distill-from", str(teacher), "--out-dir", str(tmp_path / "s")], tmp_path)
    rows = _rows(tmp_path / "s" / "metrics.jsonl")
    assert len(rows) == 1 and all(r["distill_loss"] > 0 for r in rows)
    assert all(abs(r["loss"] - (r["pg_loss"] + 0.001 * r["kl_loss"] + r["distill_loss"])) < 1e-4 for r in rows)
    assert f"distilled from {teacher} (coef 1); teacher's final reward" in out
    alone = _run(
        [*SMALL, "--hidden", "32", "--distill-from", str(teacher / "checkpoints" / "step000001"), "--distill-only"]
        + ["--distill-coef", "0.5", "--out-dir", str(tmp_path / "a")],
        tmp_path,
    )
    rows = _rows(tmp_path / "a" / "metrics.jsonl")
    assert all("pg_loss" not in r and abs(r["loss"] - 0.5 * r["distill_loss"]) < 1e-5 for r in rows), rows
    assert "(coef 0.5, alone)" in alone


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--distill-coef", "0.5"], "--distill-coef: needs --distill-from"),
        (["--distill-only"], "--distill-only: needs --distill-from"),
        (["--distill-from", "{missing}"], "is not a directory"),
        (["--distill-from", "{empty}"], "holds no complete checkpoint"),
        (["--distill-from", "{teacher}", "--distill-coef", "-1"], "--distill-coef must be a finite number >= 0"),
        (["--distill-from", "{teacher}", "--distill-coef", "nan"], "--distill-coef must be a finite number >= 0"),
        (["--distill-from", "{teacher}", "--distill-only", "--kl-coef", "0.1"], "--kl-coef: --distill-only trains"),
        (["--distill-from", "{teacher}", "--lora-rank", "4"], "--distill-from: the student is the toy's own model"),
    ],
    ids=["coef-alone", "only-alone", "missing", "empty", "negative", "nan", "kl", "lora"],
)
def test_distillation_flags_are_refused_by_name(argv, message, teacher, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    paths = {"missing": str(tmp_path / "nowhere"), "empty": str(tmp_path / "empty"), "teacher": str(teacher)}
    argv = [a.format(**paths) for a in argv]
    with pytest.raises(ArgumentError) as err:
        checks.validate_args(cli.parse_args(argv), 1, cuda_available=False)
    assert message in str(err.value), str(err.value)
