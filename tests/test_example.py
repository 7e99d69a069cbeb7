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
SMALL = ["--prompts", "4", "--group-size", "4", "--no-progress", "--no-plot", "--target-reward", "0"]


def _call(args: list[str], nproc: int = 1, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, str(EXAMPLE), *args]
    else:
        from fnppo.parallel import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}", str(EXAMPLE), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=cwd)


def _run(args: list[str], nproc: int = 1, cwd: Path | None = None) -> str:
    out = _call(args, nproc, cwd)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    assert "Warning" not in out.stderr, out.stderr[-3000:]  # quiet by default
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
    assert "step000002 (checkpoint of step 2)" in out
    straight = _rows(tmp_path / "straight" / "metrics.jsonl")
    resumed = _rows(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert straight == resumed  # every metric of every step, bit for bit


_CHECK = re.compile(r"first-step loss=(\S+) grad_norm=(\S+)")


def _first_step(args: list[str], nproc: int) -> tuple[float, float]:
    out = _run(["--steps", "1", "--layout-check", *SMALL, "--out-dir", "/tmp/fnppo-layout-check", "--overwrite", *args], nproc)
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


# ---------------------------------------------------------------------------------------------
# the command line: errors, run directories, resume rules
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,message",
    [
        (["--steps", "-1"], "--steps must be >= 1, got -1"),
        (["--device", "cuda"], "--device cuda: this torch has no CUDA device"),
        (["--tp", "3"], "--tp 3 x --pp 1 = 3 does not divide the 1 processes"),
        (["--prompts", "0"], "--prompts must be >= 1, got 0"),
        (["--resume", "--overwrite"], "--overwrite and --resume exclude each other"),
    ],
    ids=["negative-steps", "cuda-without-cuda", "tp-does-not-divide", "zero-prompts", "resume-and-overwrite"],
)
def test_invalid_arguments_print_one_line_and_exit_2(args, message, tmp_path):
    if "cuda" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    out = _call([*args, "--out-dir", str(tmp_path / "run")])
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert out.stderr.strip() == f"ppo_toy.py: error: {message}" or out.stderr.strip().startswith(f"ppo_toy.py: error: {message}")
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_invalid_layout_under_torchrun_is_one_line_from_rank_0(tmp_path):
    out = _call(["--tp", "3", "--out-dir", str(tmp_path / "run")], nproc=2)
    assert out.returncode != 0
    both = out.stdout + out.stderr
    assert both.count("ppo_toy.py: error: --tp 3 x --pp 1 = 3 does not divide the 2 processes") == 1, both[-3000:]
    assert 'ppo_toy.py", line' not in both  # no per-rank Python traceback


def test_help_is_fast_to_reach_and_states_the_exit_codes():
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['ppo_toy.py', '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules and 'megatron' not in sys.modules, 'heavy imports before --help'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "exit status: 0 when the run finished" in out.stdout and "2 for invalid arguments" in out.stdout


def test_run_directories_are_new_per_run_and_never_overwritten(tmp_path):
    args = ["--steps", "1", *SMALL]
    _run(args, cwd=tmp_path)
    _run(args, cwd=tmp_path)
    runs = sorted(p.name for p in (tmp_path / "runs" / "ppo_toy").iterdir())
    assert runs == ["run000", "run001"]
    out = _call([*args, "--out-dir", str(tmp_path / "runs" / "ppo_toy" / "run000")], cwd=tmp_path)
    assert out.returncode == 2 and "already holds a run; pass --resume to continue it, --overwrite to replace it" in out.stderr
    _run([*args, "--out-dir", str(tmp_path / "runs" / "ppo_toy" / "run000"), "--overwrite"], cwd=tmp_path)
    assert len(_rows(tmp_path / "runs" / "ppo_toy" / "run000" / "metrics.jsonl")) == 1


def test_resume_refuses_missing_checkpoints_and_changed_settings(tmp_path):
    run = str(tmp_path / "run")
    out = _call(["--resume", *SMALL, "--out-dir", run])
    assert out.returncode == 2 and "holds no run to resume" in out.stderr
    out = _call(["--resume", *SMALL], cwd=tmp_path)
    assert out.returncode == 2 and "no run under runs/ppo_toy; start one without --resume" in out.stderr
    _run(["--steps", "2", "--save-every", "1", *SMALL, "--out-dir", run])
    out = _call(["--steps", "2", "--resume", "--lr", "0.01", *SMALL, "--out-dir", run])
    assert out.returncode == 2 and "--lr 0.003 (now 0.01)" in out.stderr, out.stderr
    out = _call(["--steps", "4", "--resume", *SMALL, "--out-dir", run])
    assert out.returncode == 2 and "--schedule-steps 2 (now 4)" in out.stderr and "pass --schedule-steps 2" in out.stderr, out.stderr


def test_resume_appends_and_extends_on_the_stored_schedule(tmp_path):
    run = tmp_path / "run"
    _run(["--steps", "2", "--save-every", "2", *SMALL, "--out-dir", str(run)])
    out = _run(["--steps", "3", "--schedule-steps", "2", "--resume", *SMALL, "--out-dir", str(run)])
    assert "(checkpoint of step 2)" in out
    rows = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["lr"] == pytest.approx(0.003 * 0.1)  # the stored schedule ended at 10% of --lr


def test_plot_is_written_with_the_verdict(tmp_path):
    pytest.importorskip("matplotlib")
    out = _run(["--steps", "2", *[a for a in SMALL if a != "--no-plot"], "--out-dir", str(tmp_path / "run")])
    assert (tmp_path / "run" / "ppo_toy.png").stat().st_size > 10_000
    assert "-> PASS: reached the target 0" in out


def test_moe_first_step_agrees_between_one_process_and_ep2():
    """--moe: experts split over 2 ranks (EP=2, DP=2 for the dense layers) vs one process."""
    ref_loss, ref_norm = _first_step(["--moe"], 1)
    loss, norm = _first_step(["--moe", "--ep", "2"], 2)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), (loss, ref_loss)
    assert abs(norm - ref_norm) <= 1e-4 * abs(ref_norm), (norm, ref_norm)
