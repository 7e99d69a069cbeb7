"""examples/ppo_toy.py ``--log tensorboard,wandb,mlflow`` and its progress report in CI logs.

One run on two ranks (DP=2), its stdout a pipe as in CI: every sink, read back with its tool's own
reader (tests/test_sinks.py), holds each metric of every step exactly as ``metrics.jsonl`` has it,
and the run's settings; rank 1 opened none (one TensorBoard event file, one wandb run, one MLflow
run); the progress report is a line every ``--progress-every`` steps and at the last, no redrawn bar.
"""

from __future__ import annotations

import json

import pytest

from tests.test_example import SMALL, _call
from tests.test_sinks import mlflow_data, tensorboard_data, wandb_data

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

STEPS = 3


def test_log_sinks_hold_the_metrics_file_and_progress_prints_lines(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_dir = tmp_path / "run"
    # torchrun reads --log as its own --log-dir: --log-to is the spelling it passes on
    args = [*SMALL, "--steps", str(STEPS), "--out-dir", str(run_dir), "--log-to", "tensorboard,wandb,mlflow"]
    args = [a for a in args if a != "--no-progress"] + ["--progress-every", "2"]
    out = _call(args, nproc=2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    expected = {k: [(r["step"], float(r[k])) for r in rows] for k in ("reward", "loss", "grad_norm", "kl_loss")}

    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0 only
    scalars, hparams = tensorboard_data(run_dir / "tensorboard")
    assert {k: [(s, pytest.approx(v, rel=1e-6)) for s, v in scalars[k]] for k in expected} == expected  # float32
    assert hparams["lr"] == pytest.approx(3e-3) and hparams["steps"] == STEPS and hparams["world_size"] == 2

    history, params, status = mlflow_data(run_dir / "mlruns")  # exactly one run
    assert {k: history[k] for k in expected} == expected and status == "FINISHED"
    assert params["steps"] == str(STEPS) and params["log"] == "tensorboard,wandb,mlflow" and params["dp"] == "2"

    history, config, finished = wandb_data(run_dir)  # exactly one offline run
    assert {k: history[k] for k in expected} == expected and finished
    assert config["steps"] == STEPS and config["prompts"] == 4 and config["world_size"] == 2

    progress = [line for line in out.stdout.splitlines() if line.startswith("ppo ")]
    assert [line.split()[1] for line in progress] == ["2/3", "3/3"], out.stdout
    assert all("reward=" in line and "s/step)" in line for line in progress)
    assert "\r" not in out.stdout + out.stderr  # no bar redrawn


def test_unknown_or_missing_sink_is_refused_before_anything_runs(tmp_path):
    out = _call([*SMALL, "--out-dir", str(tmp_path / "r"), "--log", "tensorboard,neptune"])
    assert out.returncode == 2 and "--log neptune: expected any of tensorboard,wandb,mlflow" in out.stderr
    out = _call([*SMALL, "--out-dir", str(tmp_path / "r"), "--progress-every", "0"])
    assert out.returncode == 2 and "--progress-every must be >= 1, got 0" in out.stderr
    assert not (tmp_path / "r").exists()
