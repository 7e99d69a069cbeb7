"""examples/ppo_toy.py's command line (issue: every user mistake ends with one line and exit 2): the
validation itself, called directly (no training, no torch), then one subprocess test of the contract for a
refusal that comes from the library (``fnppo.InputError``), in one process and under torchrun, and one of
Ctrl-C followed by ``--resume`` alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ppo_toy.py"
sys.path.insert(0, str(ROOT / "examples"))

from toy import checks, cli, rundir, settings  # noqa: E402
from toy.errors import ArgumentError  # noqa: E402


def _validate(argv: list[str], world_size: int = 1):
    args = cli.parse_args(argv)
    checks.validate_args(args, world_size, cuda_available=False)
    return args


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-microbatches", "2", "--max-tokens-per-microbatch", "64"], "--num-microbatches 2 and --max-tokens"),
        (["--lora-rank", "64", "--hidden", "32"], "--lora-rank 64 exceeds --hidden 32"),
        (["--init-std", "0"], "--init-std must be a finite number > 0, got 0.0"),
        (["--init-std", "-0.1"], "--init-std must be a finite number > 0, got -0.1"),
        (["--no-whiten"], "--whiten/--no-whiten: only --algo ppo"),
        (["--whiten"], "--whiten/--no-whiten: only --algo ppo"),
        (["--gamma", "0.9", "--lam", "0.9"], "--gamma, --lam: only --algo ppo"),
        (["--policy-loss", "is", "--tis-cap", "2"], "--tis-cap: --policy-loss is takes no cap"),
        (["--staleness", "-1"], "--staleness must be >= 0, got -1"),
        (["--sampler-dtype", "bf16", "--dtype", "bf16"], "--sampler-dtype bf16: the trainer already runs in bf16"),
        (["--batch-invariant", "--staleness", "2"], "--batch-invariant compares the sampler's log-probs"),
        (["--sync", "delta", "--staleness", "2"], "--sync delta: the sampler runs the last weights streamed to it"),
        (
            ["--sync", "fp8", "--batch-invariant"],
            "--batch-invariant compares the sampler's log-probs with the trainer's: --sync fp8",
        ),
    ],
    ids=[
        "split",
        "lora-rank",
        "init-std-0",
        "init-std-neg",
        "no-whiten",
        "whiten",
        "gamma-lam",
        "tis-cap",
        "staleness",
        "sampler-dtype",
        "batch-invariant",
        "sync-staleness",
        "sync-fp8-batch-invariant",
    ],
)
def test_meaningless_or_contradictory_settings_are_refused_by_name(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArgumentError) as err:
        _validate(argv)
    assert str(err.value).startswith(message), str(err.value)
    assert not any(tmp_path.iterdir())  # nothing created


@pytest.mark.parametrize(
    "argv", [["--lora-rank", "8", "--hidden", "32"], ["--init-std", "0.05"], ["--algo", "ppo", "--no-whiten"]]
)
def test_the_meaningful_neighbours_are_accepted(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _validate(argv)


def _stored_run(tmp_path: Path, **changes) -> Path:
    """A run directory as a run with ``--save-every`` leaves it (settings.json, one complete checkpoint's manifest)."""
    base = cli.parse_args(
        ["--lr", "0.01", "--seed", "3", "--hidden", "32", "--lora-rank", "4", *changes.get("argv", [])]
    )
    out = tmp_path / "run"
    rundir.write_settings(out, settings.run_settings(base))
    (out / "checkpoints" / "step000002").mkdir(parents=True)
    (out / "checkpoints" / "step000002" / "manifest.json").write_text(json.dumps({"step": 4, "files": {}}))
    return out


def test_resume_alone_takes_the_stored_settings(tmp_path):
    out = _stored_run(tmp_path)
    args = _validate(["--resume", "--out-dir", str(out), "--steps", "50"])
    assert (args.lr, args.seed, args.hidden, args.lora_rank, args.steps) == (0.01, 3, 32, 4, 50)
    assert args.schedule_steps == 100  # the stored schedule, not the new --steps
    assert settings.run_settings(args) == json.loads((out / "settings.json").read_text())


def test_resume_refuses_a_changed_setting_by_name(tmp_path):
    out = _stored_run(tmp_path)
    _validate(["--resume", "--out-dir", str(out), "--lr", "0.01"])  # the same value given again: fine
    with pytest.raises(ArgumentError) as err:
        _validate(["--resume", "--out-dir", str(out), "--lr", "0.02", "--lora-rank", "8"])
    assert "--lr 0.01 (given: 0.02)" in str(err.value) and "--lora-rank 4 (given: 8)" in str(err.value), err.value


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_library_refusal_is_one_line_and_exit_2(nproc, tmp_path):
    """``--hidden 30`` passes the command line's own checks and is refused by ``fnppo.ModelConfig``
    (InputError): one line from rank 0, exit 2, no Python traceback from any rank (torchrun adds its own
    summary of the failed ranks, which the example cannot suppress)."""
    args = [str(EXAMPLE), "--hidden", "30", "--no-progress", "--out-dir", str(tmp_path / "r")]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        from fnppo.megatron.parallel import free_port

        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={free_port()}",
            *args,
        ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
    both = out.stdout + out.stderr
    line = "ppo_toy.py: error: ModelConfig: argument 'hidden_size' expected a multiple of num_attention_heads=4"
    assert out.returncode != 0 and both.count(line) == 1, both[-3000:]
    assert "Traceback" not in both.replace("torch.distributed.elastic", "") or nproc == 2, both[-3000:]
    assert 'ppo_toy.py", line' not in both and "InputError" not in both, both[-3000:]
    if nproc == 1:
        assert out.returncode == 2 and out.stderr.strip() == line + ", received 30", out.stderr
    assert not (tmp_path / "r").exists()


def test_ctrl_c_prints_how_to_resume_and_resume_alone_continues(tmp_path):
    """SIGINT after the first checkpoint: exit 130, no traceback, the resume command; that command (no
    run-defining flag repeated) continues from the checkpoint."""
    out_dir = tmp_path / "run"
    small = ["--prompts", "4", "--group-size", "4", "--lr", "0.004", "--no-progress", "--no-plot"]
    # Ctrl-C's default handler, also where this test runs as a background job (which inherits SIGINT ignored)
    launcher = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            launcher,
            str(EXAMPLE),
            *small,
            "--steps",
            "200",
            "--save-every",
            "1",
            "--out-dir",
            str(out_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=tmp_path,
    )
    deadline = time.time() + 240
    while rundir.newest_checkpoint(out_dir / "checkpoints") is None and time.time() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    hint = stderr.strip().splitlines()[-1]
    assert hint.startswith(
        f"ppo_toy.py: interrupted; resume with: python examples/ppo_toy.py --resume --out-dir {out_dir}"
    ), stderr
    assert not [p for p in (out_dir / "checkpoints").iterdir() if not (p / "manifest.json").is_file()]  # no debris
    done = json.loads((out_dir / "settings.json").read_text())
    assert done["lr"] == 0.004 and done["prompts"] == 4
    resumed = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--resume",
            "--out-dir",
            str(out_dir),
            "--exit-after",
            "1",
            "--no-progress",
            "--no-plot",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "stopped after 1 steps" in resumed.stdout, resumed.stdout


def test_a_second_run_in_the_same_directory_is_refused_while_the_first_holds_it(tmp_path):
    """The run directory's lock (``fnppo.checkpoint.lock_directory``, taken by rank 0 for the run's life):
    a second run there is one ArgumentError (exit 2) naming the holder; released, the directory is free."""
    from types import SimpleNamespace

    from toy.collectives import agreed_lock

    layout = SimpleNamespace(rank=0, world_size=1)
    first = agreed_lock(tmp_path, layout)
    with pytest.raises(ArgumentError, match=r"--out-dir: .*locked by process \d+"):
        agreed_lock(tmp_path, layout)
    first.release()
    agreed_lock(tmp_path, layout).release()
