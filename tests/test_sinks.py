"""Tests for fnppo.sinks: what each sink writes is read back with that tool's own reader.

TensorBoard's ``EventAccumulator`` (scalars and the HParams plugin's session), MLflow's
``MlflowClient`` on the file store (metric histories with their steps, params), and the offline
Weights & Biases run's transaction log (``run-<id>.wandb``: LevelDB-log framed records, each a
``wandb.proto.wandb_internal_pb2.Record``: history rows and config updates). The example's
``--log`` is tested in tests/test_example_logging.py.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from fnppo.sinks import check_sinks, close_sinks, log_hparams, log_metrics, open_sinks
from tests.messages import raises_message

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

ROWS = {1: {"loss": 0.5, "reward": 0.25}, 2: {"loss": 0.375, "reward": 0.5}, 3: {"loss": 0.25, "reward": 0.875}}
HPARAMS = {"lr": 0.003, "algo": "grpo", "tp": 2, "flag": True, "schedule_steps": None}


def tensorboard_data(log_dir: Path) -> tuple[dict, dict]:
    """({tag: [(step, value)]}, {hparam: value}) from the event files, by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    hparams = {}
    for content in acc.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for k, v in data.session_start_info.hparams.items():
                hparams[k] = getattr(v, v.WhichOneof("kind"))
    return scalars, hparams


def mlflow_data(store: Path) -> tuple[dict, dict, str]:
    """({metric: [(step, value)]}, params, status) of the one run in the file store, by MLflow's client."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("fnppo").experiment_id])
    history = {
        k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)) for k in run.data.metrics
    }
    return history, dict(run.data.params), run.info.status


def wandb_records(path: Path) -> list:
    """The records of a wandb transaction log (LevelDB log framing: a 7-byte header, 32 KiB blocks of
    chunks ``crc32 u32, length u16, type u8`` (1 full, 2 first, 3 middle, 4 last); each record a
    ``wandb_internal_pb2.Record``)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is zero padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def wandb_data(root: Path, run_id: str = "*") -> tuple[dict, dict, bool]:
    """({metric: [(step, value)]}, config, finished) of the one offline run (``run_id``) under ``root/wandb``.

    W&B's service process writes the log: right after ``run.finish()`` returns it may still be empty
    (seen with wandb 0.31), so this waits (up to 30 s) for the run's exit record."""
    (log,) = root.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(log)):
        time.sleep(0.05)
    history: dict = {}
    config: dict = {}
    finished = False
    for rec in wandb_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            for k, v in row.items():
                if not k.startswith("_"):
                    history.setdefault(k, []).append((row["_step"], v))
        elif kind == "config":
            for item in rec.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "exit":
            finished = True
    return history, config, finished


def _expected() -> dict:
    return {k: [(s, row[k]) for s, row in ROWS.items()] for k in ("loss", "reward")}


def test_each_sink_writes_what_its_reader_reads_back(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by default
    sinks = open_sinks("tensorboard, wandb,mlflow", tmp_path, run_name="run007")
    log_hparams(sinks, HPARAMS)
    for step, row in ROWS.items():
        log_metrics(sinks, step, {**row, "note": "text", "nan": float("nan")})  # only finite numbers logged
    close_sinks(sinks)

    scalars, hp = tensorboard_data(tmp_path / "tensorboard")
    assert scalars == _expected()
    assert hp == {"lr": 0.003, "algo": "grpo", "tp": 2.0, "flag": True, "schedule_steps": "None"}

    history, params, status = mlflow_data(tmp_path / "mlruns")
    assert history == _expected()
    assert params == {"lr": "0.003", "algo": "grpo", "tp": "2", "flag": "True", "schedule_steps": "None"}
    assert status == "FINISHED"

    history, config, finished = wandb_data(tmp_path)
    assert history == _expected()
    assert {k: config[k] for k in HPARAMS} == {**HPARAMS, "schedule_steps": "None"}
    assert finished


def test_only_rank_zero_logs_and_unknown_names_are_refused(tmp_path):
    assert open_sinks("tensorboard,mlflow", tmp_path, rank=1) == []
    assert not any(tmp_path.iterdir())  # nothing opened, nothing written
    with raises_message("open_sinks", "names", "a subset of tensorboard, wandb, mlflow", "'neptune'"):
        open_sinks("tensorboard,neptune", tmp_path)
    assert not any(tmp_path.iterdir())
    assert open_sinks("", tmp_path) == []


def test_a_resumed_tensorboard_run_has_each_step_once(tmp_path):
    """A run logs steps 1..4 and dies; resumed from its step-2 checkpoint it logs steps 3..5 again
    (other values): TensorBoard's own reader shows each step once, steps 3 and 4 with the resumed
    run's values (``open_sinks(resume_step=2)`` purges the earlier run's events after step 2)."""
    first = open_sinks(["tensorboard"], tmp_path)
    for step in range(1, 5):
        log_metrics(first, step, {"loss": float(step)})
    close_sinks(first)
    resumed = open_sinks(["tensorboard"], tmp_path, resume_step=2)
    for step in range(3, 6):
        log_metrics(resumed, step, {"loss": 10.0 * step})
    close_sinks(resumed)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = {"loss": [(e.step, e.value) for e in acc.Scalars("loss")]}
    assert scalars["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)], scalars["loss"]


def _crash_and_resume(name: str, root: Path) -> None:
    """A run logs steps 1..4 and dies after its step-2 checkpoint; resumed from it, steps 3..5 again
    with other values."""
    first = open_sinks(name, root, run_name="r")
    for step in range(1, 5):
        log_metrics(first, step, {"loss": float(step)})
    close_sinks(first)
    if "wandb" in name:  # a resumed process starts after the earlier one's log is written
        wandb_data(root)
    resumed = open_sinks(name, root, run_name="r", resume_step=2)
    log_hparams(resumed, {"lr": 0.5})
    for step in range(3, 6):
        log_metrics(resumed, step, {"loss": 10.0 * step})
    close_sinks(resumed)


RESUMED = [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]


def test_a_resumed_mlflow_run_has_each_step_once(tmp_path):
    """MLflow's client sees one run (the earlier one is soft-deleted, tagged with its successor) whose
    history has each step once: steps 1..2 copied from the earlier run, 3..5 the resumed run's."""
    _crash_and_resume("mlflow", tmp_path)
    history, params, status = mlflow_data(tmp_path / "mlruns")
    assert history == {"loss": RESUMED}, history
    assert params == {"lr": "0.5"} and status == "FINISHED"
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("fnppo").experiment_id
    (old,) = client.search_runs([exp], run_view_type=ViewType.DELETED_ONLY)
    (new,) = client.search_runs([exp])
    assert sorted((m.step, m.value) for m in client.get_metric_history(old.info.run_id, "loss")) == [
        (s, float(s)) for s in range(1, 5)
    ]  # the earlier run is kept, only hidden
    assert old.data.tags["fnppo.superseded_by"] == new.info.run_id
    assert new.data.tags["fnppo.resumed_from"] == old.info.run_id and new.info.run_name == "r"


def test_a_resumed_wandb_run_has_each_step_once(tmp_path, monkeypatch):
    """The resumed process's offline W&B run (``wandb/latest-run``) has each step once: 1..2 copied from
    the earlier run's transaction log, 3..5 its own; the earlier run's log is left as it was."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    _crash_and_resume("wandb", tmp_path)
    new_id = json.loads((tmp_path / "wandb" / "fnppo-run.json").read_text())["run_id"]
    assert (tmp_path / "wandb" / "latest-run").resolve().name.endswith(new_id)
    history, config, finished = wandb_data(tmp_path, new_id)
    assert history == {"loss": RESUMED}, history
    assert config["lr"] == 0.5 and finished
    (old_dir,) = [d for d in (tmp_path / "wandb").glob("offline-run-*") if not d.name.endswith(new_id)]
    old_history, _, _ = wandb_data(tmp_path, old_dir.name.rsplit("-", 1)[1])
    assert old_history == {"loss": [(s, float(s)) for s in range(1, 5)]}


def test_a_resume_without_a_recorded_run_opens_a_fresh_one(tmp_path, monkeypatch):
    """Resuming where no sink recorded a run (logging newly turned on) logs the resumed steps only."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    resumed = open_sinks(["mlflow", "wandb"], tmp_path, resume_step=2)
    log_metrics(resumed, 3, {"loss": 3.0})
    close_sinks(resumed)
    assert mlflow_data(tmp_path / "mlruns")[0] == {"loss": [(3, 3.0)]}
    assert wandb_data(tmp_path)[0] == {"loss": [(3, 3.0)]}


def test_a_run_resumed_twice_has_each_step_once(tmp_path, monkeypatch):
    """Resumed at step 2 (logs 3..5, dies), then at step 4: the second resume copies from the first
    resumed run (the recorded run id moves to each new run), so steps 1..2, 3..4, 5..6 come from
    the three processes in turn."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    _crash_and_resume("mlflow,wandb", tmp_path)
    wandb_data(tmp_path, json.loads((tmp_path / "wandb" / "fnppo-run.json").read_text())["run_id"])
    again = open_sinks("mlflow,wandb", tmp_path, run_name="r", resume_step=4)
    for step in (5, 6):
        log_metrics(again, step, {"loss": 100.0 * step})
    close_sinks(again)
    want = {"loss": [*RESUMED[:4], (5, 500.0), (6, 600.0)]}
    assert mlflow_data(tmp_path / "mlruns")[0] == want
    new_id = json.loads((tmp_path / "wandb" / "fnppo-run.json").read_text())["run_id"]
    assert wandb_data(tmp_path, new_id)[0] == want


def test_a_resume_from_step_0_purges_every_earlier_tensorboard_event(tmp_path):
    """``resume_step=0`` (a checkpoint saved before the first step) is a resume like any other: the
    earlier run's events from step 1 on are purged (TensorBoard's ``purge_step`` 1), not kept beside
    the resumed run's (``resume_step=None`` is a fresh run and purges nothing)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = open_sinks(["tensorboard"], tmp_path)
    for step in range(1, 4):
        log_metrics(first, step, {"loss": float(step)})
    close_sinks(first)
    resumed = open_sinks(["tensorboard"], tmp_path, resume_step=0)
    for step in range(1, 3):
        log_metrics(resumed, step, {"loss": 10.0 * step})
    close_sinks(resumed)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 10.0), (2, 20.0)]


class _Broken:
    """A module that fails while it is imported (as a package whose dependency is broken does)."""

    def __init__(self, monkeypatch, tmp_path, name: str, error: str) -> None:
        pkg = tmp_path / "broken" / name
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f"raise {error}\n")
        monkeypatch.syspath_prepend(str(tmp_path / "broken"))
        for mod in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            monkeypatch.delitem(sys.modules, mod)


@pytest.mark.parametrize(
    "name, error, received",
    [
        ("wandb", "ImportError('simulated: protobuf is missing')", "ImportError: simulated: protobuf is missing"),
        ("mlflow", "RuntimeError('simulated: an incompatible pydantic')", "RuntimeError: simulated: an incompatible"),
    ],
)
def test_a_sink_whose_package_fails_to_import_is_refused_before_anything_is_created(
    tmp_path, monkeypatch, name, error, received
):
    """A sink package that is installed but fails to import: ``check_sinks`` and ``open_sinks`` refuse it
    by name (the sink, the module, the import's error) before any sink is opened, so the TensorBoard
    sink listed before it leaves no directory behind."""
    _Broken(monkeypatch, tmp_path, name, error)
    run = tmp_path / "run"
    expected = "sinks whose packages import (pip install 'fnppo[log]')"
    with raises_message("check_sinks", "names", expected, f"'{name}', whose module {name} fails to import ({received}"):
        check_sinks(f"tensorboard,{name}")
    with raises_message("open_sinks", "names", expected, f"'{name}', whose module {name} fails to import"):
        open_sinks(["tensorboard", name], run)
    assert not run.exists()
    assert open_sinks(["tensorboard", name], run, rank=1) == []  # other ranks import nothing
    assert check_sinks("tensorboard, tensorboard") == ["tensorboard"]
