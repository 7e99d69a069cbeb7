"""Megatron's pipeline schedule, driven by the steps: forward-step functions, the run, the finalizer.

:func:`run_schedule` runs Megatron's ``get_forward_backward_func`` over collated micro-batches;
:func:`policy_forward_step` and :func:`value_forward_step` are the ``forward_step_func`` of the
policy and the critic (forward, then on the last stage log-prob -> loss or value -> value loss);
:func:`fnppo_finalizer` installs fnppo's gradient finalizer for one schedule; :func:`global_sums`
and :func:`global_normalizer` are the sums over the whole mini-batch that a loss needs before the
schedule runs; :func:`run_forward_only` is the forward-only run (eval mode, no autograd).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import pipeline_parallel
from torch import nn

from fnppo.core.batching.sample import Microbatch
from fnppo.core.losses import Aggregation, LossConfig, loss_normalizer, tis_batch_stats
from fnppo.core.losses.m2po import m2_values, m2po_cutoff
from fnppo.megatron.grads import GradStats, finalize_grads
from fnppo.megatron.moe import router_step
from fnppo.megatron.numerics import running
from fnppo.megatron.parallel import ParallelLayout
from fnppo.megatron.routing import RoutingRecorder, routed
from fnppo.steps.checks import check_logits, check_values, per_chunk
from fnppo.steps.config import CriticConfig, StepConfig
from fnppo.steps.plan import ModelFacts, Plan
from fnppo.steps.protocols import ForwardFn

__all__ = [
    "MEGATRON_HOOKS",
    "fnppo_finalizer",
    "run_schedule",
    "routers",
    "global_normalizer",
    "global_sums",
    "token_logprobs",
    "policy_forward_step",
    "onpolicy_gaps",
    "onpolicy_max",
    "value_forward_step",
    "run_forward_only",
]

MEGATRON_HOOKS = ("finalize_model_grads_func", "no_sync_func", "grad_sync_func", "param_sync_func")
"""The fields of Megatron's model config that :func:`fnppo_finalizer` sets (and restores)."""


@contextlib.contextmanager
def fnppo_finalizer(model: ModelFacts) -> Iterator[dict[str, GradStats]]:
    """Point Megatron's config at fnppo's finalizer for one schedule; restore every field it set.

    Sets :data:`MEGATRON_HOOKS` on the model config that Megatron's schedule reads: fnppo's
    :func:`~fnppo.megatron.grads.finalize_grads` as ``finalize_model_grads_func``, the chunks' ``no_sync``
    as ``no_sync_func``, no grad/param sync hooks (fnppo does not overlap communication). On exit
    (also on error) the four fields get back the values they had, so a user's own schedule run
    afterwards sees its own settings.

    Yields:
        A dict that holds ``"stats"`` (:class:`~fnppo.megatron.grads.GradStats`) once the finalizer ran.
    """
    config = model.config
    saved = {name: getattr(config, name) for name in MEGATRON_HOOKS}
    record: dict[str, GradStats] = {}

    def finalize(chunks: list[nn.Module], num_tokens: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> None:
        record["stats"] = finalize_grads(
            chunks, num_tokens=num_tokens if config.calculate_per_token_loss else None, layout=model.layout
        )

    no_sync = [c.no_sync for c in model.chunks]
    installed = {
        "finalize_model_grads_func": finalize,
        "no_sync_func": no_sync[0] if len(no_sync) == 1 else no_sync,
        "grad_sync_func": None,
        "param_sync_func": None,
    }
    try:
        for name, value in installed.items():
            setattr(config, name, value)
        yield record
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def run_schedule(
    model: ModelFacts, mbs: Sequence[Microbatch], forward_step: Callable, *, forward_only: bool
) -> list[Any]:
    """Megatron's ``get_forward_backward_func`` over ``mbs``; under ``vpp``, without shape exchanges.

    With ``variable_seq_lengths`` (the model config's default) every pipeline send is preceded by
    a blocking exchange of the tensor's shape (``P2PCommunicator._communicate_shapes``, megatron-core
    0.16.1), waited on before the tensor's own send and receive are posted. Over gloo, whose sends
    complete only once the peer has posted the matching receive, that handshake deadlocks the
    interleaved schedule where a stage is still in its warm-up forwards while the next one has
    begun sending gradients back (``num_microbatches == pp`` at pp=2 and pp=4). With pp=2 (both
    neighbours are one rank, one group) a call that sends both ways has its two shapes received
    crosswise, which only equal shapes survive. The interleaved schedule therefore runs with
    ``variable_seq_lengths=False`` (restored afterwards) and the one shape ``[seq_length / cp
    (/ tp with sequence parallelism), micro_batch_size, hidden]`` that the callers give every
    micro-batch (:func:`~fnppo.steps.checks.check_interleaved`, the ``same_length`` padding of the split).

    The schedule runs in the context the model's numerics ask for (:func:`fnppo.megatron.numerics.running`:
    torch's deterministic algorithms with ``ModelConfig(deterministic=True)``, the batch-invariant
    kernels with ``ModelConfig(batch_invariant=...)``).
    """
    fb = pipeline_parallel.get_forward_backward_func()
    layout = model.layout
    interleaved = layout.vpp is not None
    # the schedule's seq_length is the whole sequence: it divides by cp itself (micro-batches hold this CP rank's share)
    seq_len = max(int(mb.input_ids.shape[-1]) for mb in mbs) * layout.cp
    data = [iter(mbs) for _ in model.chunks]
    config = model.config
    saved = config.variable_seq_lengths
    config.variable_seq_lengths = saved and not interleaved
    try:
        with running(config):  # determinism and the batch-invariant kernels: fnppo.megatron.numerics
            return fb(
                forward_step_func=forward_step,
                data_iterator=data if interleaved else data[0],
                model=list(model.chunks),
                num_microbatches=len(mbs),
                seq_length=seq_len,
                micro_batch_size=int(mbs[0].input_ids.shape[0]),
                forward_only=forward_only,
            )
    finally:
        config.variable_seq_lengths = saved


def routers(model: ModelFacts, mbs: Sequence[Microbatch]):
    """:func:`fnppo.megatron.moe.router_step` for MoE models (yields its state), else a block yielding None."""
    if not model.moe:
        return contextlib.nullcontext()
    return router_step(list(model.chunks), mbs, model.layout, model.device)


def global_normalizer(
    mbs: Sequence[Microbatch], agg: Aggregation, layout: ParallelLayout, device: torch.device
) -> torch.Tensor:
    """The loss denominator of the whole mini-batch: summed over micro-batches and DP ranks (fp64).

    ``agg``: the loss's :class:`~fnppo.core.losses.aggregate.Aggregation`
    (:func:`~fnppo.core.losses.aggregate.loss_normalizer`)."""
    local = torch.zeros((), dtype=torch.float64, device=device)
    for mb in mbs:
        norm = loss_normalizer(mb.loss_mask, agg, seq_ids=mb.seq_ids)
        local = local + norm.to(device=device, dtype=torch.float64)
    total = local.reshape(1).clone()
    if layout.dp > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=layout.dp_group)
    return total[0].float()


def global_m2_cutoff(
    mbs: Sequence[Microbatch], loss_cfg: LossConfig, layout: ParallelLayout, device: torch.device
) -> torch.Tensor | None:
    """M2PO's cutoff of the whole mini-batch (:mod:`fnppo.core.losses.m2po`): the squared log-ratios of every
    valid token of every micro-batch, gathered over the DP ranks (padded to the longest with NaN),
    then :func:`~fnppo.core.losses.m2po.m2po_cutoff`; None without ``correction.m2_threshold``."""
    corr = loss_cfg.correction
    if corr is None or corr.m2_threshold is None:
        return None
    clamp = loss_cfg.log_ratio_clamp
    vals = torch.cat([m2_values(mb.old_logprobs, mb.rollout_logprobs, mb.loss_mask, clamp) for mb in mbs]).to(device)
    if layout.dp > 1:
        n = torch.tensor([vals.numel()], dtype=torch.int64, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=layout.dp_group)
        padded = torch.full((int(n[0]),), math.nan, dtype=torch.float64, device=device)
        padded[: vals.numel()] = vals
        parts = [torch.empty_like(padded) for _ in range(layout.dp)]
        dist.all_gather(parts, padded, group=layout.dp_group)
        vals = torch.cat(parts)
        vals = vals[~torch.isnan(vals)]
    return m2po_cutoff(vals, corr.m2_threshold)


def global_sums(
    mbs: Sequence[Microbatch], loss_cfg: LossConfig, layout: ParallelLayout, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss normalizer and, with ``correction.batch_normalize``, the mean TIS weight of the mini-batch.

    Both are summed over micro-batches and DP ranks before the schedule, in one all-reduce (fp64):
    ``tis_mean = sum(w) / count`` over the kept units (:func:`~fnppo.core.losses.rollout_weights.tis_batch_stats`).
    """
    if loss_cfg.correction is None or not loss_cfg.correction.batch_normalize:
        return global_normalizer(mbs, loss_cfg.agg, layout, device), None
    local = torch.zeros(3, dtype=torch.float64, device=device)
    for mb in mbs:
        pair = tis_batch_stats(mb.old_logprobs, mb.rollout_logprobs, mb.loss_mask, loss_cfg, seq_ids=mb.seq_ids)
        norm = loss_normalizer(mb.loss_mask, loss_cfg.agg, seq_ids=mb.seq_ids).reshape(1)
        local = local + torch.cat([norm, pair.reshape(2)]).to(device=device, dtype=torch.float64)
    if layout.dp > 1:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=layout.dp_group)
    count = local[2]
    return local[0].float(), local[1] / torch.where(count > 0, count, torch.ones_like(count))


def token_logprobs(
    fn: str,
    out: torch.Tensor,
    weight: torch.Tensor | None,
    mb: Microbatch,
    config: StepConfig,
    plan: Plan,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``mb``'s labels from the logits (``config.fns.logprob``), or, with
    ``weight`` (the fused path, ``config.fns.head``), from the hidden states ``[seq, batch, hidden]``
    and the output-weight shard; over the model's real vocabulary (a padded vocabulary's extra
    columns are left out)."""
    layout = plan.model.layout
    tp_group = layout.tp_group if layout.tp > 1 else None
    kwargs = dict(
        tp_group=tp_group,
        temperature=config.temperature,
        with_entropy=with_entropy,
        vocab_size=plan.model.real_vocab_size,
    )
    if weight is None:
        check_logits(fn, out, plan.model.vocab_size, layout)
        return config.fns.logprob(out, mb.labels, **kwargs)
    return config.fns.head(out.transpose(0, 1), weight, mb.labels, **kwargs)


def policy_forward_step(
    config: StepConfig,
    plan: Plan,
    *,
    normalizer: torch.Tensor | None,
    loss_scale: float,
    tis_mean: torch.Tensor | None = None,
    m2_cutoff: torch.Tensor | None = None,
) -> Callable[[Iterator[Microbatch], nn.Module], Any]:
    """Megatron's ``forward_step_func`` of the policy: forward, then (last stage) logprob -> loss, scaled.

    With a head stage (``config.fns.head``, the fused path) the forward returns ``(hidden, weight)``
    and the head replaces the log-prob stage."""
    fns = config.fns
    loss_cfg = config.loss
    extra = {k: v for k, v in (("tis_mean", tis_mean), ("m2_cutoff", m2_cutoff)) if v is not None}

    def forward_step(data_iterator: Iterator[Microbatch], model: nn.Module):
        mb = next(data_iterator)
        with routed(model, mb):  # routing replay when the micro-batch carries routed experts
            out, weight = fns.forward(model, mb) if fns.head is not None else (fns.forward(model, mb), None)

        def loss_func(logits: torch.Tensor):
            # the entropy is always computed: it is reported as a metric whatever its coefficient
            lp, ent = token_logprobs("train_step", logits, weight, mb, config, plan, True)
            old = mb.rollout_logprobs if loss_cfg.bypass_old_logprobs else mb.old_logprobs  # bypass mode
            # partial rollouts: each token's age, only when the samples carry them (Staleness.prepare)
            ages = {} if mb.staleness is None else {"staleness": mb.staleness}
            loss, metrics = fns.loss(
                lp,
                old,
                mb.advantages,
                mb.loss_mask,
                loss_cfg,
                entropy=ent,
                ref_logprobs=mb.ref_logprobs,
                rollout_logprobs=mb.rollout_logprobs,
                normalizer=normalizer,
                seq_ids=mb.seq_ids,
                **extra,
                **ages,
            )
            return loss * loss_scale, {"metrics": metrics, "onpolicy": onpolicy_gaps(lp, old, mb.loss_mask)}

        return out, loss_func

    return forward_step


def onpolicy_gaps(logprobs: torch.Tensor, old: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """``[max |logprobs - old|, max |exp(logprobs - old) - 1|]`` over the tokens of ``mask`` (fp32,
    detached; 0 without tokens or without ``old``; a NaN is reported as inf). On-policy, before any
    update, both are exactly 0 in batch-invariant mode (``ModelConfig(batch_invariant=True)``) when
    ``old`` came from ``compute_logprobs`` (or an engine matching its numerics)."""
    if old is None:
        return torch.zeros(2, dtype=torch.float32, device=logprobs.device)
    keep = mask != 0
    diff = logprobs.detach().float() - old.detach().float()
    gaps = torch.stack([diff.abs(), torch.expm1(diff).abs()])
    gaps = torch.where(keep, torch.nan_to_num(gaps, nan=float("inf")), torch.zeros_like(gaps))
    return gaps.flatten(1).amax(dim=1) if keep.numel() else torch.zeros(2, device=logprobs.device)


def onpolicy_max(store: Sequence[Any], layout: ParallelLayout, dp_group: Any, device: torch.device) -> torch.Tensor:
    """The largest :func:`onpolicy_gaps` over a schedule's micro-batches, data-parallel ranks
    (``dp_group``, may include CP) and pipeline stages (only the last has them), on every rank."""
    local = torch.zeros(2, dtype=torch.float32, device=device)
    for s in store:
        if isinstance(s, dict) and "onpolicy" in s:
            local = torch.maximum(local, s["onpolicy"].to(device))
    if dp_group is not None:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=dp_group)
    if layout.pp > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=layout.pp_group)
    return local


def value_forward_step(
    config: CriticConfig, *, normalizer: torch.Tensor, loss_scale: float
) -> Callable[[Iterator[Microbatch], nn.Module], Any]:
    """Megatron's ``forward_step_func`` of the critic: ``forward_values``, then (last stage) the value loss, scaled."""
    fns, loss_cfg = config.fns, config.loss

    def forward_step(data_iterator: Iterator[Microbatch], model: nn.Module):
        mb = next(data_iterator)
        out = fns.forward(model, mb)

        def loss_func(values: torch.Tensor):
            check_values("critic_step", values, mb)
            old = mb.values if mb.values is not None else values.detach()  # unused without clipping
            loss, metrics = fns.loss(
                values,
                old,
                mb.returns,
                mb.loss_mask,
                loss_cfg.clip_range,
                loss_agg_mode=loss_cfg.agg.mode,
                loss_scale_factor=loss_cfg.agg.scale,
                normalizer=normalizer,
                seq_ids=mb.seq_ids,
            )
            return loss * loss_scale, {"metrics": metrics}

        return out, loss_func

    return forward_step


def run_forward_only(
    model: ModelFacts,
    microbatches: Sequence[Microbatch],
    output_fn: Callable[[torch.Tensor, Microbatch], Any],
    *,
    params: Any,
    forward: ForwardFn,
    recorder: RoutingRecorder | None,
) -> list[Any] | None:
    """The schedule forward-only (eval mode, no autograd) on micro-batches the caller built right
    (one shape and a valid count under ``vpp``): ``output_fn`` of each micro-batch's output on the
    last pipeline stage, in micro-batch order; None on the other stages."""
    chunks = model.chunks
    by_chunk = {id(c): p for c, p in zip(chunks, per_chunk(params, len(chunks)))}

    def forward_step(data_iterator: Iterator[Microbatch], chunk: nn.Module):
        mb = next(data_iterator)
        with routed(chunk, mb, recorder):
            out = forward(chunk, mb, params=by_chunk.get(id(chunk)))

        def loss_func(logits: torch.Tensor):
            return logits.new_zeros((), dtype=torch.float32), {"out": output_fn(logits, mb)}

        return out, loss_func

    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        with torch.no_grad():
            store = run_schedule(model, microbatches, forward_step, forward_only=True)
    finally:
        for c, m in zip(chunks, modes):
            c.train(m)
    if not model.layout.is_last_stage:
        return None
    return [s["out"] for s in store]
