"""The main job (examples/ppo_toy.py): resume is bit-identical, and layouts agree on the first step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ppo_toy.py"
SMALL = ["--prompts", "4", "--group-size", "4", "--no-progress", "--no-plot"]


def _run(args: list[str], nproc: int = 1) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, str(EXAMPLE), *args]
    else:
        from fnppo.parallel import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}", str(EXAMPLE), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out.stdout


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_resume_continues_bit_identically(tmp_path):
    steps = ["--steps", "4", *SMALL]
    _run([*steps, "--out-dir", str(tmp_path / "straight")])
    # a preempted run: stops after 2 steps (checkpoint at step 2), then resumes to the end
    _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "2", "--exit-after", "3"])
    assert (tmp_path / "resumed" / "checkpoints" / "step000002" / "manifest.json").is_file()
    out = _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "2", "--resume"])
    assert "resumed from" in out and "at step" in out
    straight = _rows(tmp_path / "straight" / "metrics.jsonl")
    resumed = _rows(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert straight == resumed  # every metric of every step, bit for bit


_CHECK = re.compile(r"first-step loss=(\S+) grad_norm=(\S+)")


def _first_step(args: list[str], nproc: int) -> tuple[float, float]:
    out = _run(["--steps", "1", "--layout-check", *SMALL, "--out-dir", "/tmp/fnppo-layout-check", *args], nproc)
    m = _CHECK.search(out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


@pytest.mark.parametrize("layout,nproc", [(["--tp", "2"], 2), (["--pp", "2"], 2), ([], 2)], ids=["tp2", "pp2", "dp2"])
def test_first_step_agrees_across_layouts(layout, nproc):
    ref_loss, ref_norm = _first_step([], 1)
    loss, norm = _first_step(layout, nproc)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), (loss, ref_loss)
    assert abs(norm - ref_norm) <= 1e-4 * abs(ref_norm), (norm, ref_norm)


def test_starts_from_a_hugging_face_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    _run(["--hf-checkpoint", str(tmp_path / "ckpt"), "--steps", "2", *SMALL, "--out-dir", str(tmp_path / "run")])
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["skipped"] == 0.0 for r in rows)
