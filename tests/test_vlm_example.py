"""examples/vlm_toy.py: a few steps run end to end, every micro-batch image mix occurs, errors exit 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vlm_toy.py"
FAST = ["--steps", "3", "--prompts", "16", "--group-size", "2", "--num-microbatches", "8", "--no-progress", "--target-reward", "0"]


def _call(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env, timeout=600, cwd=cwd)


def test_a_few_steps_run_every_image_mix_and_write_the_run_directory(tmp_path):
    out = _call([*FAST, "--out-dir", str(tmp_path / "run")])
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    assert "Warning" not in out.stderr, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["skipped"] == 0.0 for r in rows)
    # 16 micro-batches per step (2 mini-batches x 8, one block of prompts each): 4 without images, 4 with only images, 8 mixed
    assert all((r["mb_no_image"], r["mb_all_images"], r["mb_mixed"]) == (4, 4, 8) for r in rows), rows
    m = re.search(r"image-count mix of the (\d+) micro-batches train_step ran: no image (\d+), all images (\d+), mixed (\d+)", out.stdout)
    assert m and tuple(map(int, m.groups())) == (48, 12, 12, 24), out.stdout
    assert "-> PASS: reached the target 0" in out.stdout
    if not any("matplotlib" in line for line in out.stdout.splitlines() if line.startswith("plot: skipped")):
        assert (tmp_path / "run" / "vlm_toy.png").stat().st_size > 10_000
    # a second run into the same directory is refused (exit 2, one line), as in the text toy
    again = _call([*FAST, "--out-dir", str(tmp_path / "run")])
    assert again.returncode == 2 and again.stderr.strip().startswith("vlm_toy.py: error:") and "already holds a run" in again.stderr


@pytest.mark.parametrize(
    "args,message",
    [(["--prompts", "24"], "--prompts 24 must be divisible by 16"), (["--tp", "3"], "--tp 3 x --pp 1 = 3 does not divide the 1 processes")],
    ids=["prompts-not-in-blocks", "tp-does-not-divide"],
)
def test_invalid_arguments_print_one_line_and_exit_2(args, message, tmp_path):
    out = _call([*args, "--out-dir", str(tmp_path / "run")])
    assert out.returncode == 2 and out.stderr.strip().startswith(f"vlm_toy.py: error: {message}"), out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1


def test_make_prompts_is_half_images_and_the_answer_is_the_square_count():
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import vlm_toy

    prompts = vlm_toy.make_prompts(0, 0, 64)
    with_image = [p for p in prompts if p[1] is not None]
    assert len(with_image) == 32
    for ids, img, answer in prompts:
        if img is None:
            assert ids == [vlm_toy.BOS, vlm_toy.ASK] and answer == vlm_toy.NONE
            continue
        assert ids == [vlm_toy.BOS, vlm_toy.IMG, vlm_toy.ASK] and img.shape == (3, 8, 8)
        # squares sit in distinct cells of the 2x2 grid: the count of non-empty cells is the answer
        cells = img.abs().sum(0).unfold(0, 4, 4).unfold(1, 4, 4).sum((-1, -2))
        assert answer == vlm_toy.COUNT0 + int((cells > 0).sum())
    assert vlm_toy.make_prompts(0, 0, 64)[5][2] == prompts[5][2]  # a function of (seed, step)
    assert torch.equal(torch.stack([p[1] for p in with_image]), torch.stack([p[1] for p in vlm_toy.make_prompts(0, 0, 64) if p[1] is not None]))
