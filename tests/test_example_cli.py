"""examples/ppo_toy.py's command line (issue: every user mistake ends with one line and exit 2): the
validation itself, called directly (no training, no torch), then one subprocess test of the contract for a
refusal that comes from the library (``fnppo.InputError``), in one process and under torchrun, and one of
Ctrl-C followed by ``--resume`` alone."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.scripts import run_script

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
    if nproc == 1:  # as python would run it, forked from the preloaded server (tests/scripts.py)
        out = run_script(EXAMPLE, args[1:], cwd=tmp_path, timeout=300)
    else:  # torchrun itself: its summary of the failed ranks is part of what a user sees
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
        f"ppo_toy.py: interrupted; resume with: python {EXAMPLE} --resume --out-dir {out_dir} --steps 200 "
    ), stderr
    assert " --save-every 1 " in hint and "--lr" not in hint, hint  # (--lr is stored with the run)
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


# ---------------------------------------------------------------------------------------------
# --staleness chooses the default policy loss
# ---------------------------------------------------------------------------------------------
def test_the_default_policy_loss_follows_the_staleness(tmp_path, monkeypatch):
    """Without --policy-loss: on-policy PPO at --staleness 0, and at K > 0 decoupled PPO with the
    log-linear proximal policy of that K in bypass mode (docs/async.md's recommendation; plain ppo
    reaches 0.58 at K = 4 there); an explicit --policy-loss is kept (the staleness study compares them).
    --tis-cap with the stale default is refused naming the default."""
    from toy.model import policy_loss_config

    import fnppo

    monkeypatch.chdir(tmp_path)
    assert _validate([]).policy_loss == "ppo"
    args = _validate(["--staleness", "4"])
    assert args.policy_loss == "decoupled" and "policy_loss" not in args.given_flags
    loss = policy_loss_config(args)
    assert loss.bypass_old_logprobs is True
    assert loss.policy == fnppo.losses.loglinear_decoupled(staleness=4)
    assert _validate(["--staleness", "4", "--policy-loss", "ppo"]).policy_loss == "ppo"
    with pytest.raises(ArgumentError) as err:
        _validate(["--staleness", "2", "--tis-cap", "2"])
    assert str(err.value).startswith("--tis-cap: --policy-loss decoupled takes no cap") and (
        "it is the default with --staleness 2" in str(err.value)
    ), err.value
    text = cli.build_parser().format_help()
    assert "--staleness K > 0 decoupled" in " ".join(text.split()), text
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# --resume and the metrics file a killed run left
# ---------------------------------------------------------------------------------------------
ROWS = "".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in (1, 2))


@pytest.mark.parametrize(
    "tail, rows",
    [
        ('{"step": 3, "rew', [1, 2]),  # killed during the append: dropped
        ('{"step": 3, "reward": 0.3}', [1, 2, 3]),  # a whole row without its newline: kept
        ("", [1, 2]),
    ],
    ids=["half-written", "whole-without-newline", "none"],
)
def test_resume_drops_a_half_written_last_metrics_line_with_a_notice(tmp_path, capsys, tail, rows):
    out = _stored_run(tmp_path)
    (out / "metrics.jsonl").write_text(ROWS + tail)
    args = _validate(["--resume", "--out-dir", str(out)])  # accepted: validation reads the file
    assert (out / "metrics.jsonl").read_text() == ROWS + tail  # and changes nothing
    read, partial = rundir.read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in read] == rows and (partial == tail if tail and len(rows) == 2 else partial is None)
    path, kept = rundir.metrics_file(args, out, 3)
    assert [r["step"] for r in kept] == rows
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in kept)  # the half line is gone
    notice = capsys.readouterr().out
    if partial is None:
        assert notice == ""
    else:
        assert notice.count("\n") == 1 and f"{path}: dropped its half-written last line" in notice, notice


@pytest.mark.parametrize(
    "line",
    [b'{"step": 2, "rew', b"[2, 0.5]", b'{"reward": 0.5}', b'{"step": "2"}', b'{"step": true}', b'{"step": 2, "\xff"}'],
    ids=["truncated", "array", "no-step", "str-step", "bool-step", "not-utf8"],
)
def test_resume_refuses_a_corrupt_metrics_line_before_the_last_by_name(tmp_path, line):
    """A corrupt line that is not the last (a kill leaves only the last one half-written) is refused by
    name, file and line number, before anything changes (exit 2 in the example)."""
    out = _stored_run(tmp_path)
    data = ROWS.encode().replace(b"\n", b"\n" + line + b"\n", 1) + b'{"step": 3}\n'
    (out / "metrics.jsonl").write_bytes(data)
    with pytest.raises(ArgumentError) as err:
        _validate(["--resume", "--out-dir", str(out)])
    path = out / "metrics.jsonl"
    assert str(err.value).startswith(
        f"--resume: {path} line 2 is not a metrics row (a JSON object with its 'step'): "
    ), err.value
    assert path.read_bytes() == data


# ---------------------------------------------------------------------------------------------
# what the run path refuses after torch is imported: one line, exit 2, nothing left behind
# ---------------------------------------------------------------------------------------------
def _example(code: str, args: list[str], cwd: Path):
    from tests.scripts import run_script

    launcher = f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r})\n{code}\nimport ppo_toy\nsys.exit(ppo_toy.main(sys.argv[1:]))\n"
    return run_script(None, args, code=launcher, cwd=cwd, timeout=600)


SMALL = ["--prompts", "4", "--group-size", "4", "--no-progress", "--no-plot", "--target-reward", "0"]


def test_a_sink_whose_package_fails_to_import_refuses_the_run_before_it_locks_or_creates_anything(tmp_path):
    """wandb installed but broken (it raises at import, which --log's own check, ``find_spec``, cannot
    see): refused by name on the run path before the directory lock is taken, exit 2, one line, the run
    directory never created."""
    broken = tmp_path / "broken" / "wandb"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('simulated: wandb needs a newer protobuf')\n")
    code = (  # (Megatron's imports load parts of wandb: forgotten, so that `import wandb` finds the broken one)
        f"sys.path.insert(0, {str(tmp_path / 'broken')!r})\n"
        "for name in [m for m in sys.modules if m == 'wandb' or m.startswith('wandb.')]:\n"
        "    del sys.modules[name]"
    )
    out = _example(code, [*SMALL, "--steps", "1", "--log-to", "tensorboard,wandb", "--out-dir", "run"], tmp_path)
    err = out.stderr.strip()
    assert out.returncode == 2, (out.returncode, err[-3000:])
    assert err.startswith(
        "ppo_toy.py: error: --log-to tensorboard,wandb: check_sinks: argument 'names' expected sinks whose packages "
        "import (pip install 'fnppo[log]'), received 'wandb', whose module wandb fails to import (ImportError: "
        "simulated: wandb needs a newer protobuf)"
    ), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_exit_2(tmp_path):
    """The file-size limit (``ulimit -f``: 2048 bytes, met by the first checkpoint's common.pt) during
    the run: the save's CheckpointError, naming the limit, is one line and exit 2, no traceback, and the
    checkpoint leaves nothing behind."""
    code = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))"
    out = _example(code, [*SMALL, "--steps", "1", "--save-every", "1", "--out-dir", "run"], tmp_path)
    err = out.stderr.strip()
    assert out.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert err.startswith("ppo_toy.py: error: save_checkpoint: argument 'directory' expected "), err
    assert "File too large: common.pt reached the file-size limit (RLIMIT_FSIZE, `ulimit -f`): 2048 bytes" in err
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []


def test_a_damaged_hugging_face_weights_file_is_one_line_and_exit_2(tmp_path):
    """--hf-checkpoint whose config.json is whole and model.safetensors truncated (both pass the command
    line's own checks): fnppo's CheckpointError, one line and exit 2, nothing created."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    out = _example("", [*SMALL, "--steps", "1", "--hf-checkpoint", "hf", "--out-dir", "run"], tmp_path)
    err = out.stderr.strip()
    assert out.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert err.startswith(
        "ppo_toy.py: error: --hf-checkpoint hf: fnppo.io.hf.load_hf_weights: argument 'path' expected a readable "
        "safetensors file (model.safetensors), received 'hf/model.safetensors', which is not a whole safetensors file"
    ), err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# the resume command printed after Ctrl-C, followed literally
# ---------------------------------------------------------------------------------------------
CTRL_C_AFTER_FIRST_SAVE = """
import fnppo.checkpoint
_save = fnppo.checkpoint.save_checkpoint

def save_then_ctrl_c(*args, **kwargs):  # Ctrl-C right after the first checkpoint is whole
    _save(*args, **kwargs)
    raise KeyboardInterrupt

fnppo.checkpoint.save_checkpoint = save_then_ctrl_c
"""


def test_the_printed_resume_command_followed_literally_continues_the_run(tmp_path):
    """A run with flags its settings do not store (--steps, --save-every, --log-to, --metrics-out,
    --target-reward, ...) is stopped by Ctrl-C after its step-2 checkpoint, and its metrics file is left
    with a half-written row (a kill during the append). The printed command, run as printed, continues
    the same run: it finishes --steps 4, writes the step-4 checkpoint (--save-every 2), appends to the
    --metrics-out file (the half row dropped with a notice: steps 1-4 once each) and logs every step to
    TensorBoard (--log-to)."""
    pytest.importorskip("tensorboard")
    from tests.scripts import run_script
    from tests.test_sinks import tensorboard_data

    flags = ["--steps", "4", "--save-every", "2", "--log-to", "tensorboard", "--metrics-out", "m/metrics.jsonl"]
    first = _example(CTRL_C_AFTER_FIRST_SAVE, [*SMALL, "--lr", "0.004", *flags, "--out-dir", "run"], tmp_path)
    assert first.returncode == 130, first.stderr[-3000:]
    line = first.stderr.strip().splitlines()[-1]
    assert line.startswith("ppo_toy.py: interrupted; resume with: python ") and line.endswith(
        "(from step000002, optimizer step 4)"
    ), line
    command = shlex.split(line.split("resume with: ", 1)[1].rsplit(" (from ", 1)[0])
    assert command[0] == "python" and "--lr" not in command  # stored with the run: not repeated
    with open(tmp_path / "m" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward": 0.2')  # the row a kill during its append leaves
    resumed = run_script(Path(command[1]), command[2:], cwd=tmp_path, timeout=600)  # `python script args`
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from run/checkpoints/step000002" in resumed.stdout, resumed.stdout
    assert "m/metrics.jsonl: dropped its half-written last line" in resumed.stdout, resumed.stdout
    rows = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step000002", "step000004"]
    scalars, _ = tensorboard_data(tmp_path / "run" / "tensorboard")
    assert [s for s, _ in scalars["reward"]] == [1, 2, 3, 4], scalars["reward"]
