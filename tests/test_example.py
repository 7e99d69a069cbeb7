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


def _bit_diff(a, b, path: str = "") -> list[str]:
    """Paths where two nested structures differ; tensors compared byte for byte (dtype and shape too)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                                b.detach().contiguous().reshape(-1).view(torch.uint8)))
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):  # (the order may differ: a loaded optimizer state inserts 'step' first)
            return [f"{path}{{keys}}"]
        return [d for k in a for d in _bit_diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}[len]"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _bit_diff(x, y, f"{path}[{i}]")]
    if type(a).__module__ == "numpy" or type(b).__module__ == "numpy":  # NumPy's RNG state
        import numpy as np

        return [] if type(a) is type(b) and np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b) else [path]
    if hasattr(a, "__dict__") and type(a) is type(b) and not isinstance(a, type):
        return _bit_diff(vars(a), vars(b), path)
    return [] if a == b else [path]


def test_resume_continues_bit_identically(tmp_path):
    import torch

    steps = ["--steps", "4", *SMALL]
    _run([*steps, "--out-dir", str(tmp_path / "straight"), "--save-every", "2"])
    # a preempted run: stops after 2 steps (checkpoint at step 2), then resumes to the end
    _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "2", "--exit-after", "3"])
    assert (tmp_path / "resumed" / "checkpoints" / "step000002" / "manifest.json").is_file()
    out = _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "2", "--resume"])
    assert "resumed from" in out and "at step" in out
    straight = _rows(tmp_path / "straight" / "metrics.jsonl")
    resumed = _rows(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert straight == resumed  # every metric of every step, bit for bit
    # and the final state: every weight, optimizer tensor (Adam moments and steps), RNG state, extra
    final = [torch.load(d / "checkpoints" / "step000004" / "rank00000.pt", weights_only=False) for d in
             (tmp_path / "straight", tmp_path / "resumed")]
    assert final[0]["step"] == final[1]["step"] > 0
    assert final[0]["model"] and final[0]["optimizer"]["state_dict"] and final[0]["rng"]["torch"].numel()
    for f in final:  # the example neither seeds nor uses Python's and NumPy's generators: their state is
        del f["rng"]["python"], f["rng"]["numpy"]  # per process (test_faults.py checks their restoration)
    diff = _bit_diff(*final)
    assert diff == [], f"the resumed run's final state differs from the uninterrupted run's at {diff[:10]}"


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
