"""Metric pairs ``(weighted_sum, weight)``: merge over micro-batches, finalize to floats.
Implementation: :mod:`fnppo.core.metrics`."""

from __future__ import annotations

from fnppo.core.metrics import finalize_metrics as finalize_metrics
from fnppo.core.metrics import merge_metrics as merge_metrics
from fnppo.core.metrics import pair_metric as pair_metric
from fnppo.core.metrics import reduce_metrics as reduce_metrics
from fnppo.core.metrics import weighted_metric as weighted_metric

__all__ = [
    "weighted_metric",
    "pair_metric",
    "merge_metrics",
    "reduce_metrics",
    "finalize_metrics",
]
