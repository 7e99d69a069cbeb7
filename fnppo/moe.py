"""Mixture-of-Experts: router metrics, routing replay, stacked experts.
Implementation: :mod:`fnppo.megatron.moe`, :mod:`fnppo.megatron.routing`, :mod:`fnppo.megatron.stacked_experts`."""

from __future__ import annotations

from fnppo.megatron.moe import is_moe as is_moe
from fnppo.megatron.moe import router_derived_metrics as router_derived_metrics
from fnppo.megatron.moe import routers as routers
from fnppo.megatron.routing import RoutingRecorder as RoutingRecorder
from fnppo.megatron.routing import moe_layer_indices as moe_layer_indices
from fnppo.megatron.routing import routed as routed
from fnppo.megatron.routing import routing_spec as routing_spec
from fnppo.megatron.stacked_experts import StackedExperts as StackedExperts

__all__ = [
    "routers",
    "is_moe",
    "router_derived_metrics",
    "RoutingRecorder",
    "routed",
    "routing_spec",
    "moe_layer_indices",
    "StackedExperts",
]
