"""Metrics sinks: TensorBoard, Weights & Biases (offline), MLflow (local file store), composed as a list.
Implementation: :mod:`fnppo.io.sinks`."""

from __future__ import annotations

from fnppo.io.sinks import SINKS as SINKS
from fnppo.io.sinks import MetricsSink as MetricsSink
from fnppo.io.sinks import MlflowSink as MlflowSink
from fnppo.io.sinks import TensorBoardSink as TensorBoardSink
from fnppo.io.sinks import WandbSink as WandbSink
from fnppo.io.sinks import check_sinks as check_sinks
from fnppo.io.sinks import close_sinks as close_sinks
from fnppo.io.sinks import log_hparams as log_hparams
from fnppo.io.sinks import log_metrics as log_metrics
from fnppo.io.sinks import open_sinks as open_sinks

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
