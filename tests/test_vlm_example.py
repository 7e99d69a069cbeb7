"""examples/vlm_toy.py: a few steps run end to end, every micro-batch image mix occurs, a preempted run resumes
bit for bit, errors exit 2 before anything is imported or created."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.scripts import run_script

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vlm_toy.py"
FAST = [
    "--steps",
    "3",
    "--prompts",
    "16",
    "--group-size",
    "2",
    "--num-microbatches",
    "8",
    "--no-progress",
    "--target-reward",
    "0",
]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    """``python examples/vlm_toy.py *args`` from the repository root, forked from the preloaded server."""
    return run_script(EXAMPLE, args, cwd=ROOT, timeout=600)


def _call(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env, timeout=600, cwd=cwd
    )


# The example run with one draw per step from each generator a checkpoint restores (Python's, NumPy's,
# torch's) added to its metrics rows: a resume that failed to restore one of them shows in the rows.
DRAWING = """
import random, sys
import numpy as np
import torch
sys.path.insert(0, {examples!r})
import vlm_toy

rollout = vlm_toy.rollout

def drawing(*args, **kwargs):
    samples, rewards = rollout(*args, **kwargs)
    draws = {{"draw_python": random.random(), "draw_numpy": float(np.random.random()),
             "draw_torch": float(torch.rand(()))}}
    return samples, {{**rewards, **draws}}

vlm_toy.rollout = drawing
sys.exit(vlm_toy.main(sys.argv[1:]))
"""


def _drawing_run(args: list[str]) -> str:
    code = DRAWING.format(examples=str(ROOT / "examples"))
    out = run_script(None, args, code=code, cwd=ROOT, timeout=600)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out.stdout


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _leaves(x, path: str = "") -> dict[str, object]:
    """Every leaf of a loaded checkpoint file by path; tensors and NumPy arrays as (dtype, shape, bytes)."""
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor):
        t = x.detach().contiguous()
        return {path: (str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())}
    if isinstance(x, np.ndarray):
        return {path: (str(x.dtype), x.shape, x.tobytes())}
    if isinstance(x, dict):
        return {k: v for key in x for k, v in _leaves(x[key], f"{path}.{key}").items()}
    if isinstance(x, (list, tuple)):
        return {k: v for i, item in enumerate(x) for k, v in _leaves(item, f"{path}[{i}]").items()}
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return _leaves(vars(x), path)
    return {path: x}


def test_a_preempted_run_resumes_bit_identically(tmp_path):
    """--save-every / --exit-after / --resume: a run stopped after 3 steps (checkpoint at step 2) and
    resumed gives the uninterrupted run's metrics rows and final checkpoint, bit for bit: the model,
    the optimizer, the reference parameters and every RNG state (each drawn from once per step)."""

    small = [
        "--steps",
        "4",
        "--prompts",
        "16",
        "--group-size",
        "2",
        "--num-microbatches",
        "2",
        "--hidden",
        "32",
        "--no-progress",
        "--no-plot",
        "--target-reward",
        "0",
        "--save-every",
        "2",
    ]
    _drawing_run([*small, "--out-dir", str(tmp_path / "straight")])
    out = _drawing_run([*small, "--out-dir", str(tmp_path / "resumed"), "--exit-after", "3"])
    assert "stopped after 3 steps (--exit-after)" in out
    assert [r["step"] for r in _rows(tmp_path / "resumed" / "metrics.jsonl")] == [1, 2, 3]
    out = _drawing_run([*small, "--out-dir", str(tmp_path / "resumed"), "--resume"])
    assert "step000002 (checkpoint of step 2)" in out
    straight, resumed = _rows(tmp_path / "straight" / "metrics.jsonl"), _rows(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert len({r["draw_numpy"] for r in straight}) == 4 and all(r["mb_images"] > 0 for r in straight)
    assert straight == resumed  # every metric and draw of every step, bit for bit (the rows hold no wall times)
    from fnppo.checkpoint import read_checkpoint

    final = [
        _leaves({k: v for k, v in read_checkpoint(d / "checkpoints" / "step000004").items() if k != "manifest"})
        for d in (tmp_path / "straight", tmp_path / "resumed")
    ]
    assert any(".objects.fnppo.rng" in k for k in final[0]) and any(
        ".common.fnppo.extra.settings" in k for k in final[0]
    )
    keys = final[0].keys() | final[1].keys()
    diff = sorted(k for k in keys if final[0].get(k, "missing") != final[1].get(k, "missing"))
    assert diff == [], f"the resumed run's final checkpoint differs from the uninterrupted run's at {diff[:10]}"


def test_resume_refuses_what_it_cannot_continue(tmp_path):
    """Exit 2 with one line, the run left as it was: another run-defining flag, a damaged checkpoint,
    no complete checkpoint."""
    run = tmp_path / "run"
    small = [
        "--steps",
        "2",
        "--prompts",
        "16",
        "--group-size",
        "2",
        "--num-microbatches",
        "2",
        "--hidden",
        "32",
        "--no-progress",
        "--no-plot",
        "--target-reward",
        "0",
    ]
    out = _run([*small, "--out-dir", str(run), "--save-every", "1", "--exit-after", "1"])
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = (run / "metrics.jsonl").read_text()
    out = _run([*small, "--out-dir", str(run), "--resume", "--lr", "0.01"])
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-3000:]
    assert "--resume: the checkpoint was written with --lr 0.003 (now 0.01)" in out.stderr
    (run / "checkpoints" / "step000001" / "__0_0.distcp").write_bytes(b"damaged")
    out = _run([*small, "--out-dir", str(run), "--resume"])
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-3000:]
    assert out.stderr.startswith("vlm_toy.py: error: --resume: ") and "__0_0.distcp" in out.stderr, out.stderr
    (run / "checkpoints" / "step000001" / "manifest.json").unlink()  # an incomplete checkpoint: reported, skipped
    out = _run([*small, "--out-dir", str(run), "--resume"])
    want = f"vlm_toy.py: error: --resume: {run} has no complete checkpoint (write some with --save-every N)"
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[-1] == want, out.stderr[-3000:]
    assert lines[:-1] == [f"skipping incomplete checkpoint {run}/checkpoints/step000001: no readable manifest.json"], (
        lines
    )
    assert (run / "metrics.jsonl").read_text() == metrics  # the refused resumes left the run as it was


def test_a_few_steps_run_every_image_mix_and_write_the_run_directory(tmp_path):
    out = _run([*FAST, "--out-dir", str(tmp_path / "run")])
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    assert "Warning" not in out.stderr, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["skipped"] == 0.0 for r in rows)
    # 16 micro-batches per step (2 mini-batches x 8, one block of prompts each): 4 without images, 4 with only images, 8 mixed
    assert all((r["mb_no_image"], r["mb_all_images"], r["mb_mixed"]) == (4, 4, 8) for r in rows), rows
    m = re.search(
        r"image-count mix of the (\d+) micro-batches train_step ran: no image (\d+), all images (\d+), mixed (\d+)",
        out.stdout,
    )
    assert m and tuple(map(int, m.groups())) == (48, 12, 12, 24), out.stdout
    assert "-> PASS: reached the target 0" in out.stdout
    if not any("matplotlib" in line for line in out.stdout.splitlines() if line.startswith("plot: skipped")):
        assert (tmp_path / "run" / "vlm_toy.png").stat().st_size > 10_000
    # a second run into the same directory is refused (exit 2, one line), as in the text toy
    again = _run([*FAST, "--out-dir", str(tmp_path / "run")])
    assert (
        again.returncode == 2
        and again.stderr.strip().startswith("vlm_toy.py: error:")
        and "already holds a run" in again.stderr
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompts", "24"], "--prompts 24 must be divisible by 16"),
        (["--tp", "3"], "--tp 3 x --pp 1 = 3 does not divide the 1 processes"),
        (["--steps", "-5"], "--steps must be >= 1, got -5"),
        (["--save-every", "-1"], "--save-every must be >= 0, got -1"),
        (["--exit-after", "0"], "--exit-after must be >= 1, got 0"),
        (["--lr", "nan"], "need --lr > 0"),
        (["--resume", "--overwrite"], "--overwrite and --resume exclude each other"),
        (["--resume"], "--resume: {run} holds no run to resume"),
    ],
    ids=[
        "prompts-not-in-blocks",
        "tp-does-not-divide",
        "negative-steps",
        "negative-save-every",
        "zero-exit-after",
        "nan-lr",
        "resume-and-overwrite",
        "nothing-to-resume",
    ],
)
def test_invalid_arguments_print_one_line_and_exit_2(args, message, tmp_path):
    out = _call([*args, "--out-dir", str(tmp_path / "run")], cwd=tmp_path)
    message = message.format(run=tmp_path / "run")
    assert out.returncode == 2 and out.stderr.strip().startswith(f"vlm_toy.py: error: {message}"), out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_invalid_values_are_refused_before_torch_is_imported():
    """The values are checked before torch (seconds of imports) is: main() returns 2 with torch never imported."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import vlm_toy; rc = vlm_toy.main(['--save-every', '-1']); "
        "print(rc, 'torch' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "examples")], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr[-2000:]
    assert out.stderr.strip() == "vlm_toy.py: error: --save-every must be >= 0, got -1"
    assert time.perf_counter() - start < 10


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
    assert torch.equal(
        torch.stack([p[1] for p in with_image]),
        torch.stack([p[1] for p in vlm_toy.make_prompts(0, 0, 64) if p[1] is not None]),
    )
