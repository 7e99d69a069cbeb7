"""Metrics sinks: where a training loop's metrics go besides its own files, one object per tool.

A sink has three methods: ``log(step, metrics)`` (a step's scalars), ``log_hparams(hparams)`` (the
run's settings, once) and ``close()``. Sinks compose as a plain list (:func:`log_metrics`,
:func:`log_hparams`, :func:`close_sinks` call each in turn); :func:`open_sinks` opens the named ones
on rank 0 and none elsewhere, every file under the run directory, nothing over the network:

* ``tensorboard``: :class:`TensorBoardSink`, event files in ``<run dir>/tensorboard``
  (``torch.utils.tensorboard``; the settings in TensorBoard's HParams tab);
* ``wandb``: :class:`WandbSink`, a Weights & Biases run in ``<run dir>/wandb`` in offline mode
  (``wandb sync`` uploads it later; the settings are the run's config);
* ``mlflow``: :class:`MlflowSink`, an MLflow run in the local file store ``<run dir>/mlruns``
  (``mlflow ui --backend-store-uri <run dir>/mlruns``; the settings are the run's params).

The libraries are optional (``pip install fnppo[log]``) and imported when a sink is opened. Only
finite numbers are logged (a metric that is ``None``, a string or NaN is left out of that step).
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import os
import struct
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from fnppo.core.errors import check_int, input_error

__all__ = [
    "MetricsSink",
    "TensorBoardSink",
    "WandbSink",
    "MlflowSink",
    "SINKS",
    "check_sinks",
    "open_sinks",
    "log_metrics",
    "log_hparams",
    "close_sinks",
]


class MetricsSink(Protocol):
    """What a training loop logs to: a step's scalars, the run's settings once, then close."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def log_hparams(self, hparams: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite real numbers of ``metrics`` (bools and 0-d tensors included), as floats."""
    out = {}
    for k, v in metrics.items():
        if hasattr(v, "item") and getattr(v, "numel", lambda: 0)() == 1:
            v = v.item()
        if isinstance(v, numbers.Real) and math.isfinite(float(v)):
            out[str(k)] = float(v)
    return out


_RUN_FILE = "fnppo-run.json"
"""Where a W&B or MLflow sink records its run id, in its own directory (read back on a resume)."""


def _recorded_run(directory: Path) -> str | None:
    """The run id a sink recorded in ``directory/fnppo-run.json`` (None if absent or unreadable)."""
    try:
        found = json.loads((directory / _RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def _record_run(directory: Path, run_id: str) -> None:
    """Write ``{"run_id": run_id}`` to ``directory/fnppo-run.json`` (whole or not at all)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{_RUN_FILE}.tmp"
    tmp.write_text(json.dumps({"run_id": run_id}))
    os.replace(tmp, directory / _RUN_FILE)


def _wandb_history(log: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """{step: {metric: value}} of a W&B run's transaction log ``run-<id>.wandb`` (offline or not).

    The file is LevelDB-log framed (a 7-byte header, then 32 KiB blocks of chunks ``crc32 u32,
    length u16, type u8``: 1 a whole record, 2/3/4 its first/middle/last part); each record a
    ``wandb.proto.wandb_internal_pb2.Record``, the history rows those with a ``history`` field
    (``_step`` their step; keys starting with ``_`` are W&B's own). A torn tail is ignored."""
    from wandb.proto import wandb_internal_pb2

    data = Path(log).read_bytes()
    rows: dict[int, dict[str, Any]] = {}
    pending, pos, block = b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is zero padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind not in (1, 4):
            continue
        try:
            rec = wandb_internal_pb2.Record.FromString(pending)
        except Exception:  # noqa: BLE001 - a torn last record (the run was killed mid-write)
            break
        pending = b""
        if rec.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            step = row.get("_step")
            if isinstance(step, int):
                rows[step] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows


def _plain(hparams: Mapping[str, Any]) -> dict[str, int | float | str | bool]:
    """Settings as the tools store them: numbers, strings and bools kept, anything else as its str."""
    return {str(k): v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()}


class TensorBoardSink:
    """TensorBoard event files in ``log_dir`` (``torch.utils.tensorboard.SummaryWriter``): each metric
    a scalar series ``add_scalar(name, value, step)``; the settings an HParams session.

    ``purge_step``: a resumed run's first step: TensorBoard drops the earlier run's events at this
    step and after (``SummaryWriter(purge_step=...)``), so that the steps a crashed run logged after
    its last checkpoint appear once, with the resumed run's values."""

    def __init__(self, log_dir: str | os.PathLike, *, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for k, v in _scalars(metrics).items():
            self.writer.add_scalar(k, v, global_step=step)

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        for summary in hparams_summary(_plain(hparams), {}):  # in this run's own event file
            self.writer.file_writer.add_summary(summary)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run in ``directory`` (its ``wandb/`` folder), offline by default: no network,
    ``wandb sync`` uploads it later. ``mode``: wandb's (``"offline"``, ``"online"``, ``"disabled"``).

    ``resume_step``: the process resumes a run from the checkpoint of this step. W&B cannot drop a
    run's steps offline (its rewind, ``resume_from``, is done by the server), so the sink opens a new
    run (same name) that starts with the earlier run's steps up to ``resume_step``, copied from that
    run's transaction log, and continues with this process's steps: each step once, with the resumed
    run's values. The earlier run's folder stays as it was (``wandb/latest-run`` is the new one); the
    new run's notes name it. The run id is recorded in ``wandb/fnppo-run.json``. (W&B's service
    process writes the log: right after :meth:`close` it may still be incomplete for a moment.)"""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        project: str = "fnppo",
        name: str | None = None,
        mode: str = "offline",
        resume_step: int | None = None,
    ) -> None:
        import wandb

        folder = Path(directory) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        earlier = _recorded_run(folder) if resume_step is not None else None
        logs = sorted(folder.glob(f"*-{earlier}/run-{earlier}.wandb")) if earlier else []
        copied = {s: row for s, row in _wandb_history(logs[-1]).items() if s <= resume_step} if logs else {}
        if earlier and not logs:
            warnings.warn(
                f"WandbSink: no transaction log of the earlier run {earlier} in {folder}: its steps up to "
                f"{resume_step} are not copied into the resumed run",
                stacklevel=2,
            )
        notes = (
            f"resumed at step {resume_step} from run {earlier} (its steps 1..{resume_step} copied)" if logs else None
        )
        self.run = wandb.init(
            project=project,
            name=name,
            notes=notes,
            dir=str(directory),
            mode=mode,
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )
        for step in sorted(copied):
            self.run.log(copied[step], step=step)
        _record_run(folder, self.run.id)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(_scalars(metrics), step=step)

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        self.run.config.update(_plain(hparams), allow_val_change=True)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run in the local file store ``store`` (a directory; ``mlflow.tracking.MlflowClient``,
    no global active run): each metric a series with its step, the settings as params.

    MLflow 3 keeps its file store behind ``MLFLOW_ALLOW_FILE_STORE``: set to ``true`` for this process
    unless already set. ``tracking_uri`` (e.g. ``sqlite:///run/mlflow.db``, a server) replaces the
    file store.

    ``resume_step``: the process resumes a run from the checkpoint of this step. MLflow cannot delete
    a metric's points, so the sink opens a new run (same name, tags ``fnppo.resumed_from`` and
    ``fnppo.resumed_at_step``) holding the earlier run's points up to ``resume_step`` (copied with
    their steps and timestamps) and then this process's steps, and deletes the earlier run (MLflow's
    soft delete: tagged ``fnppo.superseded_by``, hidden from the UI and ``search_runs``, back with
    ``mlflow runs restore --run-id``): the run a user opens has each step once, with the resumed run's
    values. The run id is recorded in ``<store>/fnppo-run.json``."""

    def __init__(
        self,
        store: str | os.PathLike,
        *,
        experiment: str = "fnppo",
        name: str | None = None,
        tracking_uri: str | None = None,
        resume_step: int | None = None,
    ) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        if tracking_uri is None:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            tracking_uri = Path(store).resolve().as_uri()
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        earlier = _recorded_run(Path(store)) if resume_step is not None else None
        if earlier is not None:
            try:
                earlier_run = self.client.get_run(earlier)
            except Exception:  # noqa: BLE001 - MlflowException: the recorded run is gone
                earlier = None
        if earlier is None:
            self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        else:
            tags = {"fnppo.resumed_from": earlier, "fnppo.resumed_at_step": str(resume_step)}
            self.run_id = self.client.create_run(exp_id, run_name=name, tags=tags).info.run_id
            points = [
                Metric(m.key, m.value, m.timestamp, m.step)
                for key in earlier_run.data.metrics
                for m in self.client.get_metric_history(earlier, key)
                if m.step <= resume_step
            ]
            for i in range(0, len(points), 1000):  # MLflow takes at most 1000 metrics per batch
                self.client.log_batch(self.run_id, metrics=points[i : i + 1000])
            self.client.set_tag(earlier, "fnppo.superseded_by", self.run_id)
            self.client.delete_run(earlier)
        _record_run(Path(store), self.run_id)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in _scalars(metrics).items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)) for k, v in _plain(hparams).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


SINKS = ("tensorboard", "wandb", "mlflow")
"""The names :func:`open_sinks` knows."""

#: the modules each sink imports when it opens (its package, and the parts of it the sink uses)
_MODULES = {
    "tensorboard": ("tensorboard", "torch.utils.tensorboard", "torch.utils.tensorboard.summary"),
    "wandb": ("wandb", "wandb.proto.wandb_internal_pb2"),
    "mlflow": ("mlflow", "mlflow.entities", "mlflow.tracking"),
}


def _wanted(fn: str, names: Any) -> list[str]:
    """The sink names of ``names`` (a str ``"tensorboard,wandb"`` or a list of str), deduplicated, in order."""
    if not isinstance(names, str) and not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)):
        raise input_error(fn, "names", "a str ('tensorboard,wandb') or a list of str", f"{names!r}")
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    unknown = [n for n in wanted if n not in SINKS]
    if unknown:
        raise input_error(fn, "names", f"a subset of {', '.join(SINKS)}", repr(unknown[0]))
    return list(dict.fromkeys(wanted))


def check_sinks(names: str | Sequence[str], *, fn: str = "check_sinks") -> list[str]:
    """The sinks ``names`` asks for (as :func:`open_sinks` takes them; deduplicated, in order), each
    one's package imported: what :func:`open_sinks` checks before it opens or creates anything. Call it
    before a run creates its files, so that a sink that cannot open refuses the run while nothing exists.

    Raises:
        InputError: names that are not a string or a list of strings, an unknown name, a sink whose
            package is not installed or fails to import (naming the sink, the module and the import's
            error).
    """
    wanted = _wanted(fn, names)
    for name in wanted:
        for module in _MODULES[name]:
            try:
                importlib.import_module(module)
            except Exception as err:  # noqa: BLE001 - an import can fail in any way (a broken dependency)
                raise input_error(
                    fn,
                    "names",
                    "sinks whose packages import (pip install 'fnppo[log]')",
                    f"{name!r}, whose module {module} fails to import ({type(err).__name__}: {err})",
                ) from None
    return wanted


def open_sinks(
    names: str | Sequence[str],
    run_dir: str | os.PathLike,
    *,
    rank: int = 0,
    run_name: str | None = None,
    resume_step: int | None = None,
) -> list[MetricsSink]:
    """The sinks ``names`` (``"tensorboard,wandb"`` or a list; any subset of :data:`SINKS`, empty for
    none) writing under ``run_dir``; on a rank other than 0 none (only rank 0 logs).

    ``resume_step``: for a run resumed from the checkpoint of this step, the step whose successors the
    earlier run may already have logged; each step then appears once, with the resumed run's values:
    TensorBoard purges its events after ``resume_step`` (:class:`TensorBoardSink`'s ``purge_step =
    resume_step + 1``; at ``resume_step=0`` every earlier event); W&B and MLflow open a new run holding
    the earlier run's steps up to ``resume_step`` and then the resumed process's (:class:`WandbSink`,
    :class:`MlflowSink`: MLflow soft-deletes the earlier run, W&B leaves its folder, ``wandb/latest-run``
    being the new one).

    Raises:
        InputError: names that are not a string or a list of strings, an unknown name, a ``rank`` or
            ``resume_step`` that is not an int >= 0; on rank 0, a sink whose package is missing or fails
            to import (:func:`check_sinks`). All before anything is opened or created.
    """
    fn = "open_sinks"
    _wanted(fn, names)
    check_int(fn, "rank", rank, low=0)
    check_int(fn, "resume_step", resume_step, low=0, allow_none=True)
    if rank != 0:
        return []
    wanted = check_sinks(names, fn=fn)
    root = Path(run_dir)
    opened: list[MetricsSink] = []
    for n in wanted:
        if n == "tensorboard":
            purge = None if resume_step is None else resume_step + 1
            opened.append(TensorBoardSink(root / "tensorboard", purge_step=purge))
        elif n == "wandb":
            mode = os.environ.get("WANDB_MODE", "offline")
            opened.append(WandbSink(root, name=run_name, mode=mode, resume_step=resume_step))
        else:
            opened.append(MlflowSink(root / "mlruns", name=run_name, resume_step=resume_step))
    return opened


def log_metrics(sinks: Sequence[MetricsSink], step: int, metrics: Mapping[str, Any]) -> None:
    """``sink.log(step, metrics)`` for each sink."""
    for s in sinks:
        s.log(step, metrics)


def log_hparams(sinks: Sequence[MetricsSink], hparams: Mapping[str, Any]) -> None:
    """``sink.log_hparams(hparams)`` for each sink."""
    for s in sinks:
        s.log_hparams(hparams)


def close_sinks(sinks: Sequence[MetricsSink]) -> None:
    """``sink.close()`` for each sink."""
    for s in sinks:
        s.close()
