"""The main job (examples/ppo_toy.py): resume is bit-identical, and layouts agree on the first step."""

from __future__ import annotations

import functools
import importlib.util
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
        from fnppo.megatron.parallel import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}", str(EXAMPLE), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=cwd)


def _run(args: list[str], nproc: int = 1, cwd: Path | None = None) -> str:
    out = _call(args, nproc, cwd)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    assert "Warning" not in out.stderr, out.stderr[-3000:]  # quiet by default
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
    """A preempted run resumed from its checkpoint equals the uninterrupted run, bit for bit. With
    --kl-target the KL coefficient moves every step; the controller's state is in the checkpoint, so
    the resumed steps train with the coefficient the uninterrupted run had (not a fresh --kl-coef)."""
    import torch

    steps = ["--steps", "4", "--kl-target", "0.0001", "--kl-horizon", "20", *SMALL]
    _run([*steps, "--out-dir", str(tmp_path / "straight"), "--save-every", "2"])
    # a preempted run: stops after 2 steps (checkpoint at step 2), then resumes to the end
    _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "2", "--exit-after", "3"])
    assert (tmp_path / "resumed" / "checkpoints" / "step000002" / "manifest.json").is_file()
    out = _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "2", "--resume"])
    assert "step000002 (checkpoint of step 2)" in out
    straight = _rows(tmp_path / "straight" / "metrics.jsonl")
    resumed = _rows(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    coefs = [r["kl_coef"] for r in straight]
    assert coefs[0] == 0.001 and len(set(coefs)) == 4  # adaptive: a new coefficient every step
    assert straight == resumed  # every metric of every step, bit for bit, kl_coef included
    # and the final state: every weight, optimizer tensor (Adam moments and steps), RNG state, extra
    final = [torch.load(d / "checkpoints" / "step000004" / "rank00000.pt", weights_only=False) for d in
             (tmp_path / "straight", tmp_path / "resumed")]
    assert final[0]["step"] == final[1]["step"] > 0
    assert final[0]["model"] and final[0]["optimizer"]["state_dict"] and final[0]["rng"]["torch"].numel()
    for f in final:  # the example neither seeds nor uses Python's and NumPy's generators: their state is
        del f["rng"]["python"], f["rng"]["numpy"]  # per process (test_faults.py checks their restoration)
    diff = _bit_diff(*final)
    assert diff == [], f"the resumed run's final state differs from the uninterrupted run's at {diff[:10]}"


def test_ppo_with_a_critic_resumes_bit_identically(tmp_path):
    """--algo ppo: the critic's weights and optimizer are in the checkpoint with the actor's (one
    manifest), so a resumed run gives every metric of the critic and the actor bit for bit."""
    import torch

    steps = ["--steps", "4", "--algo", "ppo", *SMALL]
    _run([*[a for a in steps if a != "--no-plot"], "--out-dir", str(tmp_path / "straight"), "--save-every", "2"])
    _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "2", "--exit-after", "3"])
    out = _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "2", "--resume"])
    assert "step000002 (checkpoint of step 2)" in out
    straight = _rows(tmp_path / "straight" / "metrics.jsonl")
    resumed = _rows(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert all(r["critic_updates"] == 2.0 and "vf_explained_var" in r for r in straight)
    assert straight == resumed  # the critic's metrics too, bit for bit
    final = [torch.load(d / "checkpoints" / "step000004" / "rank00000.pt", weights_only=False) for d in
             (tmp_path / "straight", tmp_path / "resumed")]
    assert sorted(final[0]["states"]) == ["critic", "policy"] and final[0]["states"]["critic"]["optimizer"]["state_dict"]
    for f in final:
        del f["rng"]["python"], f["rng"]["numpy"]
    diff = _bit_diff(*final)
    assert diff == [], f"the resumed run's final state differs from the uninterrupted run's at {diff[:10]}"
    assert (tmp_path / "straight" / "ppo_toy.png").stat().st_size > 10_000  # six panels with the critic's
    # a PPO checkpoint is not resumed as GRPO
    out = _call(["--steps", "4", *SMALL, "--out-dir", str(tmp_path / "resumed"), "--resume"])
    assert out.returncode == 2 and "--resume: the checkpoint was written with --algo ppo (now grpo)" in out.stderr, out.stderr


_CHECK = re.compile(r"first-step loss=(\S+) grad_norm=(\S+)")


def _first_step(args: list[str], nproc: int) -> tuple[float, float]:
    if nproc == 1:
        return _first_step_one_process(tuple(args))
    return _first_step_run(tuple(args), nproc)


@functools.cache
def _first_step_one_process(args: tuple[str, ...]) -> tuple[float, float]:
    """The one-process reference, run once per argument list for all the layouts compared with it."""
    return _first_step_run(args, 1)


def _first_step_run(args: tuple[str, ...], nproc: int) -> tuple[float, float]:
    out = _run(["--steps", "1", "--layout-check", *SMALL, "--out-dir", f"/tmp/fnppo-layout-check-{os.getpid()}", "--overwrite", *args], nproc)
    m = _CHECK.search(out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


# DP=2 against one process: tests/test_readme.py::test_quoted_layout_check_values_match_the_code runs both
# with the default settings and holds each to README's quoted values (1e-6).
@pytest.mark.parametrize("layout,nproc", [(["--tp", "2"], 2), (["--pp", "2"], 2)], ids=["tp2", "pp2"])
def test_first_step_agrees_across_layouts(layout, nproc):
    ref_loss, ref_norm = _first_step([], 1)
    loss, norm = _first_step(layout, nproc)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), (loss, ref_loss)
    assert abs(norm - ref_norm) <= 1e-4 * abs(ref_norm), (norm, ref_norm)


def test_ppo_first_step_agrees_between_one_process_and_pp2():
    """--algo ppo under torchrun --pp 2: the actor's and the critic's first step equal one process's."""
    ref = _first_step_ppo([], 1)
    got = _first_step_ppo(["--pp", "2"], 2)
    for name, r, g in zip(("loss", "grad_norm", "critic vf_loss", "critic grad_norm"), ref, got, strict=True):
        assert abs(g - r) <= 1e-4 * abs(r), (name, g, r)


_CHECK_PPO = re.compile(r"first-step loss=(\S+) grad_norm=(\S+) critic vf_loss=(\S+) critic grad_norm=(\S+)")


def _first_step_ppo(args: list[str], nproc: int) -> tuple[float, ...]:
    out = _run(["--steps", "1", "--layout-check", "--algo", "ppo", *SMALL, "--out-dir", "/tmp/fnppo-layout-check-ppo", "--overwrite",
                *args], nproc)
    m = _CHECK_PPO.search(out)
    assert m, out
    return tuple(float(v) for v in m.groups())


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


def test_ppo_critic_starts_from_a_value_checkpoint(tmp_path):
    """--critic-checkpoint: the critic is the checkpoint's value model, head included. Its score head
    is 0 * h + 3, so every value it predicts before its first update is 3.0 (a fresh head: about 0),
    and its trunk (another width than the actor's) trains."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
    )
    model = transformers.Qwen2ForTokenClassification(cfg)
    with torch.no_grad():
        model.score.weight.zero_()
        model.score.bias.fill_(3.0)
    model.save_pretrained(tmp_path / "critic")
    common = ["--algo", "ppo", "--steps", "1", "--minibatches", "1", "--critic-lr", "1e-9", *SMALL]
    _run(["--critic-checkpoint", str(tmp_path / "critic"), *common, "--out-dir", str(tmp_path / "run")])
    _run([*common, "--out-dir", str(tmp_path / "fresh")])
    (row,), (fresh,) = _rows(tmp_path / "run" / "metrics.jsonl"), _rows(tmp_path / "fresh" / "metrics.jsonl")
    assert abs(row["vpred_mean"] - 3.0) <= 1e-5 and abs(fresh["vpred_mean"] - 3.0) > 1.0, (row["vpred_mean"], fresh["vpred_mean"])
    assert row["critic_grad_norm"] > 0 and row["skipped"] == 0.0, row


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
        (["--kl-horizon", "100"], "--kl-horizon needs --kl-target"),
        (["--algo", "ppo", "--advantage", "rloo"], "--advantage chooses the group advantage of --algo grpo"),
        (["--critic-checkpoint", "/nonexistent"], "--critic-checkpoint needs --algo ppo (a critic) and runs without --moe"),
        (["--algo", "ppo", "--lam", "1.5"], "--algo ppo needs 0 <= --gamma <= 1, 0 <= --lam <= 1"),
    ],
    ids=["negative-steps", "cuda-without-cuda", "tp-does-not-divide", "zero-prompts", "resume-and-overwrite",
         "kl-horizon-without-target", "ppo-with-group-advantage", "critic-checkpoint-without-ppo", "ppo-lambda-out-of-range"],
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
    out = _run([a for a in args if a != "--no-plot"], cwd=tmp_path)  # the first run also draws its plot
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "runs" / "ppo_toy" / "run000" / "ppo_toy.png").stat().st_size > 10_000
    assert "-> PASS: reached the target 0" in out
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
    _run(["--steps", "2", "--save-every", "2", *SMALL, "--out-dir", run])
    out = _call(["--steps", "2", "--resume", "--lr", "0.01", *SMALL, "--out-dir", run])
    assert out.returncode == 2 and "--lr 0.003 (now 0.01)" in out.stderr, out.stderr
    out = _call(["--steps", "4", "--resume", *SMALL, "--out-dir", run])
    assert out.returncode == 2 and "--schedule-steps 2 (now 4)" in out.stderr and "pass --schedule-steps 2" in out.stderr, out.stderr
    # with the stored schedule the run goes on past its --steps and appends to its metrics
    out = _run(["--steps", "3", "--schedule-steps", "2", "--resume", *SMALL, "--out-dir", run])
    assert "(checkpoint of step 2)" in out
    rows = _rows(Path(run) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["lr"] == pytest.approx(0.003 * 0.1)  # the stored schedule ended at 10% of --lr


def test_moe_first_step_agrees_between_one_process_and_ep2():
    """--moe: experts split over 2 ranks (EP=2, DP=2 for the dense layers) vs one process."""
    ref_loss, ref_norm = _first_step(["--moe"], 1)
    loss, norm = _first_step(["--moe", "--ep", "2"], 2)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), (loss, ref_loss)
    assert abs(norm - ref_norm) <= 1e-4 * abs(ref_norm), (norm, ref_norm)
