"""The forward-only calls: log-probs, values, a plain forward-only run, and the data-parallel share.

:func:`compute_logprobs` and :func:`compute_values` are the forward-only counterparts of
:func:`~fnppo.steps.train.train_step` and :func:`~fnppo.steps.train.critic_step`: the same entry
checks (agreed over every rank), the same :class:`~fnppo.steps.plan.Plan` worked out once, the same
split and collate, Megatron's schedule with ``forward_only=True`` in eval mode and without
autograd, the results restored to sample order and broadcast from the last pipeline stage.
:func:`forward_only` runs the schedule over micro-batches the caller collated;
:func:`shard_for_data_parallel` cuts a global batch into this rank's share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fnppo.core.batching.sample import Microbatch, Sample
from fnppo.core.batching.split import SPLIT_MODES, Split
from fnppo.core.errors import input_error
from fnppo.megatron.forward import forward_logits
from fnppo.megatron.parallel import ParallelLayout, agree_on_refusal, current_layout
from fnppo.megatron.routing import RoutingRecorder
from fnppo.megatron.unwrap import check_head
from fnppo.steps.checks import check_forward_only_microbatches, check_values, checked_plan, per_chunk, routing_recorder
from fnppo.steps.config import CriticConfig, StepConfig
from fnppo.steps.plan import Plan, microbatches, model_facts, shape_microbatches, unpacker, without_routes
from fnppo.steps.protocols import ForwardFn, StepFns
from fnppo.steps.schedule import run_forward_only, token_logprobs

__all__ = ["shard_for_data_parallel", "forward_only", "compute_logprobs", "compute_values"]


def shard_for_data_parallel(samples: Sequence[Any], layout: ParallelLayout | None = None) -> list[Any]:
    """This data-parallel rank's contiguous share of a global list of samples.

    ``len(samples)`` must be divisible by the DP size; TP and PP ranks of one DP rank get the same
    share (which is what :func:`~fnppo.steps.train.train_step` requires).

    Args:
        samples: the global batch (the same list on every rank).
        layout: the parallel layout (default: :func:`~fnppo.megatron.parallel.current_layout`).

    Returns:
        ``samples[dp_rank * n / dp : (dp_rank + 1) * n / dp]``.

    Raises:
        InputError: a length not divisible by the DP size.
    """
    layout = layout or current_layout()
    if len(samples) % layout.dp:
        raise input_error(
            "shard_for_data_parallel", "samples", f"a length divisible by dp={layout.dp}", str(len(samples))
        )
    per = len(samples) // layout.dp
    return list(samples[layout.dp_rank * per : (layout.dp_rank + 1) * per])


def forward_only(
    model_chunks: Sequence[nn.Module],
    microbatches: Sequence[Microbatch],
    output_fn: Callable[[torch.Tensor, Microbatch], Any],
    *,
    params: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]] | None = None,
    forward: ForwardFn = forward_logits,
    recorder: RoutingRecorder | None = None,
) -> list[Any] | None:
    """Run Megatron's schedule forward-only (eval mode, no autograd) over collated micro-batches.

    ``output_fn(logits, microbatch)`` is applied on the last pipeline stage to what ``forward``
    returns for each micro-batch: the vocab-parallel logits (or a value model's ``[batch, seq]``
    values with ``forward=forward_values``). Use it for sampling and evaluation.
    Micro-batches that carry ``routed_experts`` are run with those experts forced
    (:mod:`fnppo.megatron.routing`); with ``recorder`` (a :class:`fnppo.megatron.routing.RoutingRecorder`) the routers'
    choices are recorded into it.

    Args:
        model_chunks: the (DDP-wrapped) model chunks.
        microbatches: collated micro-batches on the model's device.
        output_fn: what to keep of each micro-batch's logits.
        params: as in :func:`compute_logprobs`.
        forward: the forward stage (:class:`~fnppo.steps.protocols.ForwardFn`).
        recorder: where the routers' top-k choices go (MoE models), or None.

    Returns:
        The results of ``output_fn`` in micro-batch order on the last pipeline stage, ``None`` on
        the other stages.

    Under the interleaved pipeline schedule (``vpp`` set) the micro-batches must share one shape
    (it runs without shape exchanges: pad packed micro-batches to one length with
    :func:`fnppo.pad_microbatch`) and their number must be a multiple of its micro-batch group
    (``pp`` by default).

    Raises:
        InputError: no micro-batches; ``params`` not one dict per model chunk; under ``vpp``,
            micro-batches of several shapes or a count that is not a multiple of the group.
    """
    model = model_facts(list(model_chunks), current_layout())
    check_forward_only_microbatches("forward_only", microbatches, model)
    microbatches = shape_microbatches(model, microbatches)
    return run_forward_only(model, microbatches, output_fn, params=params, forward=forward, recorder=recorder)


def _logprob_config(config: StepConfig | None, **given: Any) -> StepConfig:
    """``config`` (or the defaults) with the keywords of :func:`compute_logprobs` that are not None.

    A split given as a keyword (``split`` or a flat one) replaces the one of ``config``. Validated by
    :class:`~fnppo.steps.config.StepConfig`.
    """
    if config is not None and not isinstance(config, StepConfig):
        raise input_error(
            "compute_logprobs",
            "config",
            "a fnppo.StepConfig or None (a CriticConfig is compute_values')",
            f"{type(config).__name__} {config!r}"[:160],
        )
    base = StepConfig() if config is None else config
    given = {k: v for k, v in given.items() if v is not None}
    if any(k in given for k in (*SPLIT_MODES, "split")):
        base = dataclasses.replace(base, split=None, **dict.fromkeys(SPLIT_MODES))
    return dataclasses.replace(base, **given) if given else base


def _from_last_stage(
    per_sample: list[tuple[torch.Tensor, torch.Tensor | None]] | None,
    lengths: list[int],
    with_entropy: bool,
    plan: Plan,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-sample results of the last pipeline stage (None elsewhere), on every stage (one broadcast)."""
    layout = plan.model.layout
    total = sum(lengths)
    flat = torch.zeros(2 if with_entropy else 1, total, dtype=torch.float32)
    if per_sample is not None and total:
        flat[0] = torch.cat([lp for lp, _ in per_sample])
        if with_entropy:
            flat[1] = torch.cat([ent for _, ent in per_sample])
    if layout.pp > 1:
        buf = flat.to(plan.model.device)
        src = dist.get_global_rank(layout.pp_group, layout.pp - 1)
        dist.broadcast(buf, src=src, group=layout.pp_group)
        flat = buf.cpu()
    lp_out = list(torch.split(flat[0], lengths))
    ent_out = list(torch.split(flat[1], lengths)) if with_entropy else None
    return lp_out, ent_out


def compute_logprobs(
    model_chunks: Sequence[nn.Module],
    batch: Sequence[Sample],
    *,
    params: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]] | None = None,
    with_entropy: bool = False,
    config: StepConfig | None = None,
    temperature: float | None = None,
    layout: str | None = None,
    split: Split | None = None,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    max_tokens_per_microbatch: int | None = None,
    pad_to_multiple_of: int | None = None,
    max_seq_len: int | None = None,
    fns: StepFns | None = None,
    return_routing: bool = False,
) -> (
    tuple[list[torch.Tensor], list[torch.Tensor] | None]
    | tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor]]
):
    """Forward-only log-probs (and entropy) of every sample's response tokens, in sample order.

    ``logprobs_i[j] = log pi(y_ij | x_i, y_i<j) `` at ``temperature`` (and the entropy of that
    distribution), for every response token ``j`` of every sample ``i``. Runs Megatron's schedule
    with ``forward_only=True`` in eval mode (no dropout) and without autograd.

    Args:
        model_chunks: the (DDP-wrapped) model chunks.
        batch: this DP rank's samples (the same on its TP and PP ranks).
        params: one dict per model chunk (names of the unwrapped ``GPTModel``): evaluate another
            parameter set with the same modules, e.g. the frozen reference policy
            (:func:`fnppo.megatron.forward.snapshot_params`).
        with_entropy: also return the entropies.
        config: the :class:`~fnppo.steps.config.StepConfig` (temperature, layout, split, padding,
            length cap, stages; its loss settings are unused), as :func:`compute_values` takes a
            ``CriticConfig``; default ``StepConfig()``.
        temperature: sugar, as ``layout``, ``split``, ``num_microbatches``, ``microbatch_size``,
            ``max_tokens_per_microbatch``, ``pad_to_multiple_of``, ``max_seq_len`` and ``fns``: each
            one given (not None) replaces that field of ``config`` (a split given this way replaces
            ``config``'s split).
        return_routing: also return the experts the routers chose (MoE models; routing replay,
            :mod:`fnppo.megatron.routing`). Samples that carry ``routed_experts`` are always run with
            those experts forced.

    Returns:
        On every rank, one fp32 CPU tensor of length ``len(response_ids)`` per sample, in the
        order of ``batch`` (restored by :meth:`~fnppo.core.batching.split.SplitPlan.restore`), and the entropies
        likewise (or ``None``). Under context parallelism each CP rank computes its shard and the
        shards are gathered (:func:`~fnppo.core.batching.context_parallel.gather_per_sample`). With
        ``return_routing``, a third list: per sample ``[tokens, MoE layers, topk]`` expert
        indices, one row per token of the sample as collated (``len(sample)``; under
        :class:`fnppo.megatron.vlm_collate.VLMCollate` its expanded length, every image ``tokens_per_image`` rows)
        (:func:`fnppo.megatron.routing.record_dtype`; gathered over sequence, context and pipeline
        parallelism), ready for ``Sample.routed_experts``.

    Raises:
        InputError: as :func:`~fnppo.steps.train.train_step` for the batch, the logits and a virtual
            pipeline; ``params`` not one dict per chunk; invalid keywords (as
            :class:`~fnppo.steps.config.StepConfig`); ``return_routing`` for a dense model or for samples
            that carry ``routed_experts``.
    """
    chunks = list(model_chunks)
    par = current_layout()
    samples = list(batch)

    def entry() -> tuple[StepConfig, Plan, RoutingRecorder | None]:
        cfg = _logprob_config(
            config,
            temperature=temperature,
            layout=layout,
            split=split,
            num_microbatches=num_microbatches,
            microbatch_size=microbatch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            pad_to_multiple_of=pad_to_multiple_of,
            max_seq_len=max_seq_len,
            fns=fns,
        )
        check_head("compute_logprobs", "model_chunks", chunks[0], "lm")
        per_chunk(params, len(chunks))
        plan = checked_plan("compute_logprobs", cfg, model_facts(chunks, par), samples)
        return cfg, plan, routing_recorder(return_routing, samples, plan)

    cfg, plan, recorder = agree_on_refusal(entry, par)
    split, mbs = microbatches(samples, plan, cfg.fns.collate)
    unpack = unpacker(par)
    weights: dict[str, torch.Tensor | None] = {"w": None}

    def fused_forward(
        model: nn.Module, mb: Microbatch, *, params: Mapping[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        # The schedule calls per_sample right after the last stage's forward of the same micro-batch.
        hidden, weights["w"] = cfg.fns.forward(model, mb, params=params)
        return hidden

    def per_sample(out: torch.Tensor, mb: Microbatch) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        lp, ent = token_logprobs("compute_logprobs", out, weights["w"], mb, cfg, plan, with_entropy)
        if par.cp == 1:  # one copy to the host per micro-batch, then per-sample views of it
            lp, ent = lp.float().cpu(), (ent.float().cpu() if with_entropy else None)
        ents = unpack(ent, mb) if with_entropy else [None] * mb.num_samples
        return [
            (a.float().cpu(), None if b is None else b.float().cpu()) for a, b in zip(unpack(lp, mb), ents, strict=True)
        ]

    store = run_forward_only(
        plan.model,
        mbs,
        per_sample,
        params=params,
        forward=fused_forward if cfg.fns.head is not None else cfg.fns.forward,
        recorder=recorder,
    )
    restored = None if store is None else split.restore(store)
    out = _from_last_stage(restored, [s.response_len for s in samples], with_entropy, plan)
    if recorder is None:
        return out
    return (*out, recorder.per_sample(mbs, split, plan.model.routing[0], par.pp_group))


def compute_values(
    model_chunks: Sequence[nn.Module],
    batch: Sequence[Sample],
    *,
    params: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]] | None = None,
    config: CriticConfig | None = None,
) -> list[torch.Tensor]:
    """Forward-only values of every sample's response tokens, in sample order, on every rank.

    ``values_i[j] = V(x_i ++ y_i[:j])``: the value model's value of the state in which response
    token ``j`` of sample ``i`` is chosen, read at the position before that token (the last prompt
    token for ``j = 0``, where GAE's first TD error needs it). Feed them, with per-token rewards, to
    :func:`~fnppo.core.advantages.gae_advantages` (the value after the last token is 0: the response
    ends the episode), and store them as :attr:`Sample.values` for the clipped value loss of
    :func:`~fnppo.steps.train.critic_step`. Runs Megatron's schedule with ``forward_only=True`` in eval mode and without
    autograd, like :func:`compute_logprobs`.

    Reference: PPO, arXiv:1707.06347; GAE, arXiv:1506.02438.

    Args:
        model_chunks: the (DDP-wrapped) chunks of a value model (``build_gpt(cfg, head="value")``).
        batch: this DP rank's samples (the same on its TP and PP ranks).
        params: one dict per model chunk (names of the unwrapped model): evaluate another parameter
            set with the same modules.
        config: a :class:`~fnppo.steps.config.CriticConfig` for the split and layout (its loss is unused; default: one
            micro-batch, packed).

    Returns:
        On every rank, one fp32 CPU tensor of length ``len(response_ids)`` per sample, in the order
        of ``batch``; under context parallelism the CP ranks' shards are gathered.

    Raises:
        InputError: a model without a value head; the batch and virtual-pipeline errors of
            :func:`~fnppo.steps.train.train_step`; ``params`` not one dict per chunk; values from ``config.fns.forward``
            that are not ``[batch, seq]``.
    """
    cfg = CriticConfig() if config is None else config
    chunks = list(model_chunks)
    par = current_layout()
    samples = without_routes(batch)

    def entry() -> Plan:
        if not isinstance(cfg, CriticConfig):
            raise input_error(
                "compute_values",
                "config",
                "a fnppo.CriticConfig or None (a StepConfig is compute_logprobs')",
                f"{type(cfg).__name__} {cfg!r}"[:160],
            )
        check_head("compute_values", "model_chunks", chunks[0], "value")
        per_chunk(params, len(chunks))
        return checked_plan("compute_values", cfg, model_facts(chunks, par), samples)

    plan = agree_on_refusal(entry, par)
    split, mbs = microbatches(samples, plan, cfg.fns.collate)
    unpack = unpacker(par)

    def per_sample(values: torch.Tensor, mb: Microbatch) -> list[tuple[torch.Tensor, None]]:
        check_values("compute_values", values, mb)
        return [(v.float().cpu(), None) for v in unpack(values, mb)]

    store = run_forward_only(plan.model, mbs, per_sample, params=params, forward=cfg.fns.forward, recorder=None)
    restored = None if store is None else split.restore(store)
    values, _ = _from_last_stage(restored, [s.response_len for s in samples], False, plan)
    return values
