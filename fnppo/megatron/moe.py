"""Mixture-of-Experts routers inside the training step: exact router-loss scaling and router metrics.

Megatron attaches each MoE layer's auxiliary (load-balancing) loss and z-loss to the router's
output with ``MoEAuxLossAutoScaler``: the backward pass adds ``scale * d(aux)/d(theta)`` where
``scale`` is one global number that Megatron's schedule sets after every forward
(``grad_scale_func(1) / num_microbatches``). fnppo defines the router losses of a step as the
**token-weighted mean over the step's micro-batches** (all data-parallel ranks):

.. math::

    L_\\text{router} = \\sum_{\\text{layers } l} \\sum_{m} \\frac{T_m}{T} \\left(A_{l,m} + Z_{l,m}\\right),
    \\qquad T = \\sum_m T_m

where ``T_m`` is the number of tokens the routers see in micro-batch ``m`` (padding included),
``A_{l,m}`` Megatron's switch load-balancing loss of layer ``l`` on micro-batch ``m``
(``aux_loss`` or ``seq_aux_loss``, coefficient included) and ``Z_{l,m}`` its z-loss (ST-MoE,
arXiv:2202.08906: ``coeff * mean_t logsumexp(logits_t)^2``). The z-loss part is therefore the
exact token mean over the whole step, whatever the micro-batch split and layout. The balance loss
is a statistic of a set of tokens (a product of two means); it is that of each micro-batch, so it
is the same in every TP/EP/PP/DP layout that forms the same micro-batches (e.g. one process with
``num_microbatches=4`` and four DP ranks with one micro-batch each), and with one micro-batch it
is the global-batch loss of Switch Transformer (arXiv:2101.03961).

How it is made exact (:func:`router_step`): each router attaches ``T_m * A_{l,m}`` (Megatron's
own ``calculate_per_token_loss`` weighting, switched on for the routers during the step only) and
the schedule's global scale is made ``dp / T`` through ``config.grad_scale_func`` (``dp`` cancels
the data-parallel mean of DDP); ``grad_scale_func`` multiplies the policy loss too, so the policy
loss is multiplied by ``T`` instead of ``num_microbatches * dp`` and its gradient is unchanged.

Metrics (:func:`router_step` ``.metrics``, in ``train_step``'s metrics; ``l`` is the global
0-based layer index):

* ``moe_aux_loss`` / ``moe_z_loss``: the step's balance loss and z-loss (without coefficients,
  as defined above), averaged over MoE layers; ``moe_aux_loss_l{l}`` / ``moe_z_loss_l{l}`` per layer;
* ``moe_load_l{l}_e{e}``: the fraction of the layer's tokens routed to expert ``e`` (they sum to
  ``topk``); ``moe_tokens_l{l}_e{e}``: the number of tokens routed to expert ``e`` per update;
* ``moe_imbalance_l{l}`` (derived, :func:`router_derived_metrics`): ``max_e load / mean_e load``
  (1 is perfect balance), and ``moe_imbalance`` its maximum over layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import (
    compute_routing_scores_for_aux_loss,
    get_moe_layer_wise_logging_tracker,
)
from megatron.core.transformer.moe.router import TopKRouter
from torch import nn

from fnppo.core.errors import input_error
from fnppo.core.metrics import merge_metrics, pair_metric
from fnppo.megatron.routing import clear_routing
from fnppo.megatron.unwrap import unwrap_model

__all__ = [
    "routers",
    "is_moe",
    "router_step",
    "RouterStep",
    "router_derived_metrics",
]


def routers(model_chunks: Sequence[nn.Module]) -> list[nn.Module]:
    """Megatron's MoE routers (``TopKRouter``) of this rank's model chunks, in module order."""
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def is_moe(model_chunks: Sequence[nn.Module]) -> bool:
    """Whether the model has MoE layers (its config sets ``num_moe_experts``)."""
    return bool(getattr(unwrap_model(model_chunks[0]).config, "num_moe_experts", None))


@dataclass
class RouterStep:
    """What :func:`router_step` yields: the policy-loss multiplier to use, then the metrics."""

    loss_scale: float
    total_tokens: float
    records: list[dict[str, torch.Tensor]] = field(default_factory=list)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def _total_tokens(microbatches: Sequence[Any], layout: Any, device: torch.device) -> float:
    """Tokens the routers see in the step: every micro-batch position, summed over DP ranks."""
    local = sum(int(mb.input_ids.numel()) for mb in microbatches)
    t = torch.tensor([float(local)], dtype=torch.float64, device=device)
    if layout.dp > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=layout.dp_group)
    return float(t[0])


def _check_allgather(config: Any, microbatches: Sequence[Any], layout: Any, device: torch.device) -> None:
    """Megatron's allgather dispatcher gathers equal-sized token blocks over expert parallelism:
    every micro-batch must have the same number of tokens on every EP rank."""
    if config.moe_token_dispatcher_type != "allgather" or layout.ep == 1:
        return
    sizes = torch.tensor([float(mb.input_ids.numel()) for mb in microbatches], dtype=torch.float64, device=device)
    high, low = sizes.clone(), sizes.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=layout.ep_group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=layout.ep_group)
    if not torch.equal(high, low):
        raise input_error(
            "train_step",
            "batch",
            "micro-batches of equal token counts on every expert-parallel rank with moe_dispatcher='allgather' "
            "(or use 'alltoall')",
            f"token counts per micro-batch {[int(x) for x in sizes.tolist()]} on this rank, "
            f"max {[int(x) for x in high.tolist()]} over the EP group",
        )


def sequence_shards(config: Any) -> int:
    """Under sequence parallelism each of the ``tp`` ranks routes its slice of the micro-batch's
    sequence: ``tp``; else 1. (Context parallelism is already in the micro-batches fnppo forms: each
    CP rank's micro-batch holds its own tokens.)"""
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def _token_shard_group(router: nn.Module) -> Any:
    """The process group whose ranks route the other tokens of the router's micro-batch (sequence
    parallelism: TP x CP; else CP), or None."""
    cfg = router.config
    if sequence_shards(cfg) == 1 and cfg.context_parallel_size == 1:
        return None
    return router.tp_cp_group if sequence_shards(cfg) > 1 else router.cp_group


def _all_gather_rows(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t`` of every rank of ``group`` concatenated along dim 0 (equal row counts; no autograd)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


@torch.no_grad()
def _router_record(
    router: nn.Module, hidden: torch.Tensor, routing_map: torch.Tensor, weight: float
) -> dict[str, torch.Tensor]:
    """Metric pairs of one router on one micro-batch (recomputes its logits without autograd)."""
    cfg = router.config
    layer = router.layer_number - 1
    logits = router.gating(hidden).reshape(-1, cfg.num_moe_experts).float()
    routing_map = routing_map.reshape(logits.shape[0], -1)
    group = _token_shard_group(router)
    if group is not None:  # each rank routes its shard of the micro-batch: record the whole micro-batch
        logits, routing_map = (_all_gather_rows(t, group) for t in (logits, routing_map))
    n = logits.shape[0]
    counts = routing_map.sum(dim=0).double()
    k, e_num = router.topk, cfg.num_moe_experts
    aux_map, scores = compute_routing_scores_for_aux_loss(logits, k, router.score_function)
    # switch loss: E * sum_e f_e P_e, f_e = tokens_e / (n k), P_e = mean_t score_te
    # sums over n, not mean(): Megatron's batch-invariant mode routes aten::mean.dim to a Triton
    # kernel without float64 support
    aux = e_num * ((aux_map.sum(0).double() / (n * k)) * (scores.double().sum(0) / max(n, 1))).sum()
    z = torch.logsumexp(logits.double(), dim=-1).square().sum() / max(n, 1)
    tn = torch.full((), float(n), dtype=torch.float64, device=logits.device)
    out = {
        "moe_aux_loss": pair_metric(aux * n, tn),
        f"moe_aux_loss_l{layer}": pair_metric(aux * n, tn),
        "moe_z_loss": pair_metric(z * n, tn),
        f"moe_z_loss_l{layer}": pair_metric(z * n, tn),
    }
    # every expert's pairs in two [E, 2] tensors on the router's device (no per-expert kernels or syncs)
    load = torch.stack([counts, tn.expand(e_num)], dim=1).float()
    tokens = torch.stack([counts, torch.full_like(counts, weight)], dim=1).float()
    for e in range(e_num):
        out[f"moe_load_l{layer}_e{e}"] = load[e]
        out[f"moe_tokens_l{layer}_e{e}"] = tokens[e]
    return out


def _reduce(records: Sequence[dict[str, torch.Tensor]], layout: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Sum pairs over micro-batches, then DP ranks (fp64), then gather the stages' layers."""
    merged = merge_metrics(records)  # on the routers' device: one transfer to the host below
    if merged:
        keys = sorted(merged)
        flat = torch.stack([merged[k].to(device=device, dtype=torch.float64) for k in keys])
        if layout.dp > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=layout.dp_group)
        flat = flat.float().cpu()
        merged = {k: flat[i] for i, k in enumerate(keys)}
    if layout.pp > 1:
        gathered: list[Any] = [None] * layout.pp
        dist.all_gather_object(gathered, merged, group=layout.pp_group)
        merged = merge_metrics(gathered)  # layer keys are disjoint; the layer means add up
    return merged


def _drop_megatron_loss_tracker() -> None:
    """Empty Megatron's process-wide MoE loss tracker (its router losses for logging).

    fnppo reports the router losses itself (:func:`_router_record`). Megatron sizes each tracker
    entry by the layer count of the first model that logs to it and only zeroes it between steps,
    so a second MoE model with more layers in the same process (another policy, a critic, a test)
    would index past it; dropping the entries before and after every step avoids that.
    """
    get_moe_layer_wise_logging_tracker().clear()


@contextlib.contextmanager
def router_step(
    model_chunks: Sequence[nn.Module], microbatches: Sequence[Any], layout: Any, device: torch.device
) -> Iterator[RouterStep]:
    """Exact router-loss scaling and router metrics for one schedule run (see the module docstring).

    Raises:
        InputError: ``moe_dispatcher="allgather"`` under expert parallelism with micro-batches of
            different token counts on the EP ranks (Megatron's allgather dispatcher needs equal ones).

    Yields a :class:`RouterStep`; multiply each micro-batch's policy loss by its ``loss_scale``
    (instead of ``num_microbatches * dp``). After the block ``.metrics`` holds the reduced pairs
    (identical on every rank). Restores every router and config field it set.
    """
    config = unwrap_model(model_chunks[0]).config
    _check_allgather(config, microbatches, layout, device)
    total = _total_tokens(microbatches, layout, device)
    # Under sequence parallelism a router sees 1/tp of its micro-batch's tokens and weights its
    # losses by the tokens it sees: the global scale carries the missing factor.
    shards = sequence_shards(config)
    factor = shards * len(microbatches) * layout.dp / total  # grad_scale_func(1) / num_mb = shards * dp / T
    state = RouterStep(loss_scale=total / shards, total_tokens=total)
    weight = 1.0 / (len(microbatches) * layout.dp)
    rs = routers(model_chunks)
    saved_flags = [r.calculate_per_token_loss for r in rs]
    saved_scale = config.grad_scale_func

    def scale(x: torch.Tensor) -> torch.Tensor:
        return (x if saved_scale is None else saved_scale(x)) * factor

    def hook(module: nn.Module, args: tuple, output: tuple) -> None:
        if module.training and torch.is_grad_enabled():
            state.records.append(_router_record(module, args[0], output[1], weight))

    handles = [r.register_forward_hook(hook) for r in rs]
    _drop_megatron_loss_tracker()
    try:
        for r in rs:
            r.calculate_per_token_loss = True
        config.grad_scale_func = scale
        yield state
    finally:
        config.grad_scale_func = saved_scale
        for r, flag in zip(rs, saved_flags):
            r.calculate_per_token_loss = flag
        for h in handles:
            h.remove()
        _drop_megatron_loss_tracker()
        clear_routing(model_chunks)  # replay targets kept for recomputation in the backward
    state.metrics = _reduce(state.records, layout, device)


def router_derived_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """``moe_imbalance_l{l}`` = max / mean of the layer's expert loads, and their maximum."""
    loads: dict[str, list[float]] = {}
    for key, value in metrics.items():
        if key.startswith("moe_load_l"):
            layer = key[len("moe_load_l") :].split("_e")[0]
            loads.setdefault(layer, []).append(value)
    out = {}
    for layer, values in loads.items():
        mean = sum(values) / len(values)
        out[f"moe_imbalance_l{layer}"] = max(values) / mean if mean > 0 else 0.0
    if out:
        out["moe_imbalance"] = max(out.values())
    return out
