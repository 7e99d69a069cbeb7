"""One public call's plan: the model's facts and the batching spec, worked out once and passed down.

A step (or a forward-only call) unwraps its model chunks, finds their device, vocabulary, sequence
cap, MoE routing shape and interleaved-schedule group, and turns its config's batching fields into
a split spec exactly once, here (:func:`model_facts`, :func:`make_plan`); every stage below reads
them from the :class:`Plan` it is given. The helpers that split and collate by a plan live here too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fnppo.core.batching.collate import pad_microbatch, unpack_per_sample
from fnppo.core.batching.context_parallel import gather_per_sample
from fnppo.core.batching.prefix import SharedPrefix
from fnppo.core.batching.sample import Microbatch, Sample, padding_multiple
from fnppo.core.batching.split import Split, SplitPlan, build_microbatches, plan_microbatches
from fnppo.megatron.numerics import microbatch_shape
from fnppo.megatron.parallel import ParallelLayout
from fnppo.megatron.routing import routing_spec
from fnppo.megatron.unwrap import unwrap_model
from fnppo.steps.config import Batching
from fnppo.steps.protocols import CollateFn

__all__ = [
    "ModelFacts",
    "Plan",
    "model_facts",
    "make_plan",
    "with_cp_in_dp",
    "split_plan",
    "microbatches",
    "unpacker",
    "without_routes",
]


@dataclass(frozen=True)
class ModelFacts:
    """What a call needs to know of its model chunks and the parallel layout, read once."""

    chunks: tuple[nn.Module, ...]  # as given (DDP-wrapped)
    core: nn.Module  # the first chunk unwrapped (its GPTModel)
    layout: ParallelLayout
    device: torch.device
    vocab_size: int | None  # the model's (padded) vocabulary: the logits' width over all TP ranks
    real_vocab_size: int | None  # ModelConfig.vocab_size: logits columns at or beyond it are padding
    max_sequence_length: int | None
    routing: tuple[int, int, int] | None  # (MoE layers, top-k, experts) of an MoE model, else None
    interleaved_group: int | None  # the interleaved schedule's micro-batch group (vpp set), else None

    @property
    def config(self) -> Any:
        """Megatron's model config (the one its schedule reads)."""
        return self.core.config

    @property
    def moe(self) -> bool:
        return self.routing is not None


def model_facts(chunks: Sequence[nn.Module], layout: ParallelLayout) -> ModelFacts:
    """:class:`ModelFacts` of ``chunks`` under ``layout`` (the only place the steps unwrap a chunk).

    The interleaved schedule (``vpp`` set) runs the micro-batches in groups of
    ``microbatch_group_size_per_vp_stage`` (``pp`` unless the model config sets it) per virtual
    stage; the steps give it a multiple of that many.
    """
    core = unwrap_model(chunks[0])
    vocab = getattr(core, "vocab_size", None)
    group = None
    if layout.vpp is not None:
        group = getattr(core.config, "microbatch_group_size_per_vp_stage", None) or layout.pp
    return ModelFacts(
        chunks=tuple(chunks),
        core=core,
        layout=layout,
        device=next(core.parameters()).device,
        vocab_size=vocab,
        real_vocab_size=getattr(getattr(core, "fnppo_config", None), "vocab_size", vocab),  # set by build_gpt
        max_sequence_length=getattr(core, "max_sequence_length", None),
        routing=routing_spec(chunks),
        interleaved_group=group,
    )


@dataclass(frozen=True)
class Plan:
    """How one call turns samples into micro-batches: worked out once from the config and the model."""

    model: ModelFacts
    split: Split  # the split in effect (Batching.splitting), passed down as it is
    split_arg: str  # the config field errors name for it (Batching.split_arg)
    layout: str  # 'packed' or 'padded'
    pad_to_multiple_of: int
    max_seq_len: int | None  # the config's max_seq_len, else the model's max_sequence_length
    max_seq_len_source: str
    dp_group: Any  # the group the micro-batch count is agreed over (None without DP)
    same_length: bool  # the interleaved schedule needs one shape for every micro-batch
    count_multiple: int  # the interleaved schedule's micro-batch group (1 otherwise): counts are multiples of it
    context_parallel: tuple[int, int] = (1, 0)  # (cp, cp_rank): micro-batches are cut to this CP rank's tokens
    min_tokens: int | None = None  # micro-batches are padded to at least this many tokens (the model's MicrobatchShape)
    packing: SharedPrefix | None = None  # prompt groups packed with their prompt once (Batching.packing)


def make_plan(config: Batching, model: ModelFacts) -> Plan:
    """The :class:`Plan` of ``config``'s batching fields for ``model``."""
    layout = model.layout
    if config.max_seq_len is not None:
        limit, source = config.max_seq_len, f"{type(config).__name__}.max_seq_len"
    else:
        limit, source = model.max_sequence_length, "the model's max_sequence_length"
    # what the model asks of its micro-batches (FP8 GEMMs, the batch-invariant mode): fnppo.megatron.numerics
    shape = microbatch_shape(
        model.config,
        padded=config.layout == "padded",
        te_spec=uses_transformer_engine(model.core),
        owner=type(config).__name__,
    )
    multiple = math.lcm(config.pad_to_multiple_of or padding_multiple(layout.tp, layout.cp), shape.multiple)
    return Plan(
        model=model,
        split=config.splitting,
        split_arg=config.split_arg,
        layout=config.layout,
        pad_to_multiple_of=multiple,
        max_seq_len=limit,
        max_seq_len_source=source,
        dp_group=layout.dp_group if layout.dp > 1 else None,
        # The interleaved schedule runs without shape exchanges (fnppo.steps.schedule.run_schedule), so
        # every micro-batch of a step gets one shape, and their number is a multiple of its group.
        same_length=layout.vpp is not None,
        count_multiple=model.interleaved_group or 1,
        context_parallel=(layout.cp, layout.cp_rank),
        min_tokens=shape.min_tokens,
        packing=config.packing,
    )


def uses_transformer_engine(core: nn.Module) -> bool:
    """Whether any module of ``core`` is one of Megatron's Transformer Engine layers."""
    return any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in core.modules())


def min_tokens(mb: Microbatch, tokens: int, multiple: int) -> Microbatch:
    """``mb`` padded (:func:`~fnppo.core.batching.collate.pad_microbatch`) to at least ``tokens`` tokens, its
    length a multiple of ``multiple`` (``mb`` itself when it has that many already)."""
    rows, length = (int(n) for n in mb.input_ids.shape)
    if rows * length >= tokens:
        return mb
    need = -(-tokens // rows)
    return pad_microbatch(mb, -(-need // multiple) * multiple)


def shape_microbatches(model: ModelFacts, mbs: Sequence[Microbatch]) -> list[Microbatch]:
    """Micro-batches made by the caller (``forward_only``) padded to the fewest tokens the model asks for
    (:func:`fnppo.megatron.numerics.microbatch_shape`: the batch-invariant mode's), else as given."""
    shape = microbatch_shape(model.config)
    if shape.min_tokens is None:
        return list(mbs)
    return [min_tokens(mb, shape.min_tokens, shape.multiple) for mb in mbs]


def with_cp_in_dp(layout: ParallelLayout) -> ParallelLayout:
    """``layout`` whose data-parallel group is Megatron's data-parallel-with-CP group: sums of
    per-token quantities (loss normalizer, metric pairs) run over every token once."""
    if layout.cp == 1:
        return layout
    return dataclasses.replace(layout, dp=layout.dp * layout.cp, dp_group=layout.dp_cp_group)


def split_plan(samples: Sequence[Sample], plan: Plan, collate: CollateFn) -> SplitPlan:
    """The split of ``samples`` as ``plan`` says (:func:`~fnppo.core.batching.split.plan_microbatches`; agreed over DP)."""
    return plan_microbatches(
        samples,
        plan.split,
        layout=plan.layout,
        pad_to_multiple_of=plan.pad_to_multiple_of,
        collate=collate,
        dp_group=plan.dp_group,
        count_multiple=plan.count_multiple,
        packing=plan.packing,
    )


def microbatches(
    samples: Sequence[Sample], plan: Plan, collate: CollateFn, split: SplitPlan | None = None
) -> tuple[Any, list[Microbatch]]:
    """``(split, micro-batches)`` of ``samples`` split (by ``split`` when given, else by :func:`split_plan`)
    and collated as ``plan`` says, on the model's device (:func:`~fnppo.core.batching.split.build_microbatches`)."""
    split, mbs = build_microbatches(
        samples,
        plan.split,
        layout=plan.layout,
        pad_to_multiple_of=plan.pad_to_multiple_of,
        collate=collate,
        device=plan.model.device,
        dp_group=plan.dp_group,
        same_length=plan.same_length,
        context_parallel=plan.context_parallel,
        count_multiple=plan.count_multiple,
        plan=split,
        packing=plan.packing,
    )
    if plan.min_tokens is not None:
        mbs = [min_tokens(mb, plan.min_tokens, plan.pad_to_multiple_of) for mb in mbs]
    return split, mbs


def unpacker(layout: ParallelLayout) -> Callable[[torch.Tensor, Microbatch], list[torch.Tensor]]:
    """Per-sample views of a micro-batch's ``[batch, seq]`` output; under context parallelism the CP
    ranks' shards gathered (:func:`~fnppo.core.batching.context_parallel.gather_per_sample`)."""
    if layout.cp == 1:
        return unpack_per_sample
    return lambda v, mb: gather_per_sample(v, mb, layout.cp_group)


def without_routes(batch: Sequence[Any]) -> list[Any]:
    """The critic routes on its own: the policy's ``routed_experts`` are not replayed on it."""
    return [
        dataclasses.replace(s, routed_experts=None) if isinstance(s, Sample) and s.routed_experts is not None else s
        for s in batch
    ]
