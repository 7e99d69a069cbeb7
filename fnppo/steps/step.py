"""The training steps: the pure stages composed inside Megatron's own pipeline schedule.

This is the only module that knows the order of the stages::

    train_step:   build_microbatches (split_batch -> collate) -> forward_logits -> logprob -> ppo_loss
                      -> (Megatron backward) -> finalize_grads -> optimizer
    critic_step:  build_microbatches (split_batch -> collate) -> forward_values -> value_loss
                      -> (Megatron backward) -> finalize_grads -> optimizer

Both run one update mechanism (:func:`_update`: micro-batches, the global loss normalizer, the
schedule with fnppo's finalizer, the finalize check, the non-finite skip, the optimizer step);
they differ only in the :class:`_Objective` it is given. :func:`compute_logprobs` and
:func:`compute_values` are their forward-only counterparts.

Every stage is a field of :class:`StepFns` and can be replaced by a function with the same
signature (a custom loss, a custom log-prob); :class:`CollateFn`, :class:`ForwardFn`,
:class:`LogprobFn` and :class:`LossFn` state those signatures. State that persists (model chunks,
optimizer, step counter) lives in :class:`TrainState`, which is passed in and returned.

Checks happen once, where data enters: :class:`StepConfig` checks the configuration when built,
:func:`_check_batch` the samples (their values included, for every mini-batch and epoch) when
:func:`train_step` / :func:`compute_logprobs` receive them, :func:`_check_logits` the logits a
forward stage returns. Everything downstream trusts them. The entry checks run before any
collective and their verdict is agreed over every rank (:func:`~fnppo.megatron.parallel.agree_on_refusal`):
a refusal is raised on all ranks, with one message, or on none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn

from fnppo.core.batch import (
    LAYOUTS,
    Microbatch,
    Sample,
    check_devices,
    check_lengths,
    check_positive_int,
    check_routed_experts,
    check_routing_rows,
    check_same_fields,
    check_sample_values,
    check_token_ids,
    collate_microbatch,
    padding_multiple,
    unpack_per_sample,
)
from fnppo.core.context_parallel import gather_per_sample
from fnppo.megatron.grads import FinalizeNotCalledError, GradStats, finalize_grads
from fnppo.core.linear_logprob import BackwardGraphs, linear_logprob_and_entropy
from fnppo.core.logprob import logprob_and_entropy
from fnppo.core.loss import (
    SEQ_REJECTION_CRITERIA,
    PolicyLossConfig,
    ValueLossConfig,
    loss_normalizer,
    ppo_loss,
    tis_batch_stats,
    value_loss,
)
from fnppo.core.metrics import finalize_metrics, merge_metrics, reduce_metrics
from fnppo.megatron.model import check_head, deterministic_algorithms, forward_hidden, forward_logits, forward_values, unwrap_model
from fnppo.megatron.moe import is_moe, router_derived_metrics, router_step
from fnppo.megatron.parallel import ParallelLayout, agree_on_refusal, current_layout
from fnppo.megatron.routing import RoutingRecorder, routed, routing_spec
from fnppo.core.split import SPLIT_MODES, SplitPlan, build_microbatches, check_split, plan_microbatches, split_mode
from fnppo.core.typing import check_bool_fields, describe, input_error, typechecking_enabled

__all__ = [
    "StepFns", "StepConfig", "TrainState", "train_step", "compute_logprobs", "forward_only", "shard_for_data_parallel",
    "CollateFn", "ForwardFn", "LogprobFn", "LossFn",
    "CriticFns", "CriticConfig", "ValueLossFn", "critic_step", "compute_values",
]


# ---------------------------------------------------------------------------------------------
# the stage signatures
# ---------------------------------------------------------------------------------------------
class CollateFn(Protocol):
    """The collate stage: samples of one micro-batch -> :class:`~fnppo.core.batch.Microbatch`.

    Default :func:`~fnppo.core.batch.collate_microbatch`. ``sample_index`` holds the samples' indices
    in the (mini-)batch being split.
    """

    def __call__(self, samples: Sequence[Sample], *, layout: str, pad_to_multiple_of: int,
                 sample_index: Sequence[int]) -> Microbatch: ...


class ForwardFn(Protocol):
    """The forward stage: one model chunk on a micro-batch -> this rank's vocab-shard logits.

    Default :func:`~fnppo.megatron.model.forward_logits`. On the last pipeline stage the result must be
    ``[batch, seq, vocab_size / tp]``; ``params`` (one dict of the chunk's parameters, or None) is
    passed by :func:`compute_logprobs` / :func:`forward_only` only.
    """

    def __call__(self, model: nn.Module, microbatch: Microbatch, *,
                 params: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor: ...


class LogprobFn(Protocol):
    """The log-prob stage: logits and labels -> ``(logprobs, entropy or None)``, both ``[batch, seq]``.

    Default :func:`~fnppo.core.logprob.logprob_and_entropy`. ``vocab_size`` is the model's real
    vocabulary: logits columns at or beyond it (a padded vocabulary's) must be left out.
    """

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, *, tp_group: Any, temperature: float,
                 with_entropy: bool, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class LossFn(Protocol):
    """The loss stage: per-token tensors of one micro-batch -> ``(loss, metrics)``.

    Default :func:`~fnppo.core.loss.ppo_loss`; ``metrics`` are ``[2]`` pairs (:mod:`fnppo.core.metrics`).
    In bypass mode (``config.bypass_old_logprobs``) ``old_logprobs`` are the rollout log-probs; the
    keyword ``tis_mean`` (the global mean TIS weight) is passed only when ``config.tis_batch_normalize``.
    """

    def __call__(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 loss_mask: torch.Tensor, config: PolicyLossConfig, *, entropy: torch.Tensor | None,
                 ref_logprobs: torch.Tensor | None, rollout_logprobs: torch.Tensor | None,
                 normalizer: torch.Tensor | None, seq_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class ValueLossFn(Protocol):
    """The critic's loss stage: per-token values and targets of one micro-batch -> ``(loss, metrics)``.

    Default :func:`~fnppo.core.loss.value_loss`; ``clip_range``, ``loss_agg_mode`` and
    ``loss_scale_factor`` come from :class:`~fnppo.core.loss.ValueLossConfig`, ``normalizer`` is the
    step's global denominator; ``metrics`` are ``[2]`` pairs (:mod:`fnppo.core.metrics`).
    """

    def __call__(self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                 clip_range: float | None, *, loss_agg_mode: str, loss_scale_factor: float | None,
                 normalizer: torch.Tensor | None, seq_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class StepFns:
    """The swappable stages of a step; each must keep the signature of its protocol.

    Attributes:
        collate: :class:`CollateFn` (default :func:`~fnppo.core.batch.collate_microbatch`).
        forward: :class:`ForwardFn` (default :func:`~fnppo.megatron.model.forward_logits`).
        logprob: :class:`LogprobFn` (default :func:`~fnppo.core.logprob.logprob_and_entropy`).
        loss: :class:`LossFn` (default :func:`~fnppo.core.loss.ppo_loss`).
    """

    collate: CollateFn = collate_microbatch
    forward: ForwardFn = forward_logits
    logprob: LogprobFn = logprob_and_entropy
    loss: LossFn = ppo_loss


@dataclass(frozen=True)
class StepConfig:
    """How a batch becomes micro-batches and updates.

    Exactly one of ``num_microbatches``, ``microbatch_size`` and ``max_tokens_per_microbatch``
    chooses the split (default: one micro-batch). ``num_minibatches`` optimizer steps are taken per
    epoch (mini-batch ``k`` holds samples ``k, k + num_minibatches, ...`` of this rank's batch, which
    makes the mini-batches the same in every data-parallel layout), ``ppo_epochs`` passes over the
    batch per call. ``pad_to_multiple_of`` defaults to the TP size (``2*cp*tp`` under context
parallelism, :func:`~fnppo.core.batch.padding_multiple`). ``max_seq_len`` caps the
    length (prompt + response) of every sample; when None, the model's ``max_sequence_length`` is
    the cap. A longer sample is refused (:class:`~fnppo.core.typing.InputError`), never truncated.
    ``fused_output``: the last pipeline stage stops before the output layer
    (:func:`~fnppo.megatron.model.forward_hidden`) and computes log-probs and entropy with
    :func:`~fnppo.linear_logprob_and_entropy`, never materializing the logits; it replaces the
    ``forward`` and ``logprob`` stages of ``fns`` (which must then be the defaults).
    ``fused_output_chunk_vocab``: the fused backward's block of vocabulary rows (its
    ``chunk_vocab``; None: the function's default, about 3-5 % of the logits per block). Larger
    blocks mean fewer kernel launches per micro-batch (host time, which bounds steps of small
    models) for ``tokens x chunk_vocab`` more elements of memory. ``fused_output_graphs``: a
    :class:`~fnppo.core.linear_logprob.BackwardGraphs` cache passed to the fused function (its
    ``graphs``): on CUDA the fused backward is replayed as a CUDA graph, for steps whose host time
    binds, at the cost of the cache's static buffers (about 0.17 of one logits tensor at the 0.5B
    shape).

    Raises:
        InputError: ``fused_output`` that is not a bool (``"yes"``, ``0``), an unknown layout, two
            split modes, a size that is not an int >= 1, a temperature that is not a finite float > 0.
    """

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    layout: str = "packed"
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    max_tokens_per_microbatch: int | None = None
    pad_to_multiple_of: int | None = None
    max_seq_len: int | None = None
    temperature: float = 1.0
    num_minibatches: int = 1
    ppo_epochs: int = 1
    fns: StepFns = field(default_factory=StepFns)
    fused_output: bool = False
    fused_output_chunk_vocab: int | None = None
    fused_output_graphs: BackwardGraphs | None = None

    def __post_init__(self) -> None:
        fn = "StepConfig"
        check_bool_fields(fn, self)
        _check_batching_fields(fn, self)
        check_positive_int(fn, "fused_output_chunk_vocab", self.fused_output_chunk_vocab, allow_none=True)
        if self.fused_output_graphs is not None:
            if not isinstance(self.fused_output_graphs, BackwardGraphs):
                raise input_error(fn, "fused_output_graphs", "a fnppo.BackwardGraphs or None", repr(self.fused_output_graphs))
            if not self.fused_output:
                raise input_error(fn, "fused_output_graphs", "None unless fused_output=True (the graphs are the fused backward's)",
                                  repr(self.fused_output_graphs))
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise input_error(fn, "temperature", "a finite float > 0", repr(self.temperature))
        if self.fused_output and (self.fns.forward is not forward_logits or self.fns.logprob is not logprob_and_entropy):
            raise input_error(fn, "fused_output", "False when fns.forward or fns.logprob is replaced (the fused path replaces both)", "True")


def _check_batching_fields(fn: str, config: Any) -> None:
    """The batching fields that :class:`StepConfig` and :class:`CriticConfig` share (checked here only).

    Raises:
        InputError: an unknown layout, two split modes, a size that is not an int >= 1.
    """
    if config.layout not in LAYOUTS:
        raise input_error(fn, "layout", "'packed' or 'padded'", repr(config.layout))
    split_mode(config.num_microbatches, config.microbatch_size, config.max_tokens_per_microbatch, fn=fn, required=False)
    for n in ("num_minibatches", "ppo_epochs"):
        check_positive_int(fn, n, getattr(config, n))
    for n in ("pad_to_multiple_of", "max_seq_len"):
        check_positive_int(fn, n, getattr(config, n), allow_none=True)


@dataclass(frozen=True)
class CriticFns:
    """The swappable stages of :func:`critic_step`; each must keep the signature of its protocol.

    Attributes:
        collate: :class:`CollateFn` (default :func:`~fnppo.core.batch.collate_microbatch`).
        forward: :class:`ForwardFn` returning ``[batch, seq]`` values on the last stage (default
            :func:`~fnppo.megatron.model.forward_values`).
        loss: :class:`ValueLossFn` (default :func:`~fnppo.core.loss.value_loss`).
    """

    collate: CollateFn = collate_microbatch
    forward: ForwardFn = forward_values
    loss: ValueLossFn = value_loss


@dataclass(frozen=True)
class CriticConfig:
    """How :func:`critic_step` and :func:`compute_values` turn a batch into micro-batches and updates.

    ``loss``: the clipped value loss (:class:`~fnppo.core.loss.ValueLossConfig`). The batching fields
    (``layout``, the split, ``pad_to_multiple_of``, ``max_seq_len``, ``num_minibatches``,
    ``ppo_epochs``) mean what they mean in :class:`StepConfig`.

    Raises:
        InputError: as :class:`StepConfig` for the batching fields; a bool field holding anything
            but a bool.
    """

    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    layout: str = "packed"
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    max_tokens_per_microbatch: int | None = None
    pad_to_multiple_of: int | None = None
    max_seq_len: int | None = None
    num_minibatches: int = 1
    ppo_epochs: int = 1
    fns: CriticFns = field(default_factory=CriticFns)

    def __post_init__(self) -> None:
        check_bool_fields("CriticConfig", self)
        _check_batching_fields("CriticConfig", self)


@dataclass(frozen=True)
class TrainState:
    """What persists between steps: DDP-wrapped model chunks, Megatron optimizer, step counter."""

    model: tuple[nn.Module, ...]
    optimizer: Any
    step: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.model, nn.Module):
            object.__setattr__(self, "model", (self.model,))
        else:
            object.__setattr__(self, "model", tuple(self.model))


def shard_for_data_parallel(samples: Sequence[Any], layout: ParallelLayout | None = None) -> list[Any]:
    """This data-parallel rank's contiguous share of a global list of samples.

    ``len(samples)`` must be divisible by the DP size; TP and PP ranks of one DP rank get the same
    share (which is what :func:`train_step` requires).

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
        raise input_error("shard_for_data_parallel", "samples", f"a length divisible by dp={layout.dp}", str(len(samples)))
    per = len(samples) // layout.dp
    return list(samples[layout.dp_rank * per : (layout.dp_rank + 1) * per])


# ---------------------------------------------------------------------------------------------
# where samples and logits enter: worked out and checked once
# ---------------------------------------------------------------------------------------------
def _device_of(chunks: Sequence[nn.Module]) -> torch.device:
    return next(unwrap_model(chunks[0]).parameters()).device


class _Batching(NamedTuple):
    """How one call turns samples into micro-batches: worked out once from the config and the model."""

    split: tuple[str, int]  # (mode, size), see fnppo.core.split.split_mode
    layout: str
    pad_to_multiple_of: int
    max_seq_len: int | None  # StepConfig.max_seq_len, else the model's max_sequence_length
    max_seq_len_source: str
    vocab_size: int | None  # the model's (padded) vocabulary: the logits' width over all TP ranks
    real_vocab_size: int | None  # ModelConfig.vocab_size: logits columns at or beyond it are padding
    dp_group: Any  # the group the micro-batch count is agreed over (None without DP)
    same_length: bool  # the interleaved schedule needs one shape for every micro-batch
    count_multiple: int  # the interleaved schedule's micro-batch group (1 otherwise): counts are multiples of it
    context_parallel: tuple[int, int] = (1, 0)  # (cp, cp_rank): micro-batches are cut to this CP rank's tokens
    routing: tuple[int, int, int] | None = None  # (MoE layers, top-k, experts) of an MoE model, else None


def _batching(config: StepConfig, chunks: Sequence[nn.Module], layout: ParallelLayout) -> _Batching:
    core = unwrap_model(chunks[0])
    vocab, model_max = getattr(core, "vocab_size", None), getattr(core, "max_sequence_length", None)
    if config.max_seq_len is not None:
        limit, source = config.max_seq_len, "StepConfig.max_seq_len"
    else:
        limit, source = model_max, "the model's max_sequence_length"
    given = [(name, getattr(config, name)) for name in SPLIT_MODES if getattr(config, name) is not None]
    return _Batching(
        split=given[0] if given else ("num_microbatches", 1),  # StepConfig allows at most one
        layout=config.layout,
        pad_to_multiple_of=config.pad_to_multiple_of or padding_multiple(layout.tp, layout.cp),
        max_seq_len=limit,
        max_seq_len_source=source,
        vocab_size=vocab,
        real_vocab_size=getattr(getattr(core, "fnppo_config", None), "vocab_size", vocab),  # set by build_gpt
        dp_group=layout.dp_group if layout.dp > 1 else None,
        # The interleaved schedule runs without shape exchanges (_run_schedule), so every
        # micro-batch of a step gets one shape, and their number is a multiple of its group.
        same_length=layout.vpp is not None,
        count_multiple=_interleaved_group(chunks, layout) or 1,
        context_parallel=(layout.cp, layout.cp_rank),
        routing=routing_spec(chunks),
    )


def _check_context_parallel(fn: str, config: StepConfig | CriticConfig, spec: _Batching, layout: ParallelLayout) -> None:
    """What context parallelism needs of the config: packed layout, segments divisible by ``2*cp*tp``,
    and a token-level loss (the shard of a sequence does not know the sequence's token count); for
    the policy loss, token-level rollout correction.

    Raises:
        InputError: naming the config field.
    """
    if layout.cp == 1:
        return
    need = padding_multiple(layout.tp, layout.cp)
    if config.layout != "packed":
        raise input_error(fn, "config.layout", f"'packed' with context parallelism (cp={layout.cp})", repr(config.layout))
    if spec.pad_to_multiple_of % need:
        raise input_error(fn, "config.pad_to_multiple_of", f"a multiple of 2*cp*tp = {need} (context parallelism)", repr(spec.pad_to_multiple_of))
    loss = config.loss
    if loss.loss_agg_mode != "token-mean":
        raise input_error(fn, "config.loss.loss_agg_mode", f"'token-mean' with context parallelism (cp={layout.cp})", repr(loss.loss_agg_mode))
    if not isinstance(loss, PolicyLossConfig):
        return
    if loss.tis_active and "sequence" in (loss.tis_level, loss.tis_reject_level):
        raise input_error(fn, "config.loss.tis_level", f"'token' with context parallelism (cp={layout.cp})", repr(loss.tis_level))
    seq_criteria = [n for n in SEQ_REJECTION_CRITERIA if getattr(loss, n) is not None]
    if seq_criteria:  # sequence statistics need the whole sequence; a CP rank holds part of it
        raise input_error(fn, f"config.loss.{seq_criteria[0]}", f"None with context parallelism (cp={layout.cp})",
                          repr(getattr(loss, seq_criteria[0])))


def _interleaved_group(chunks: Sequence[nn.Module], layout: ParallelLayout) -> int | None:
    """The micro-batch group of Megatron's interleaved schedule (``vpp`` set), else None.

    The schedule runs the micro-batches in groups of ``microbatch_group_size_per_vp_stage`` (``pp``
    unless the model config sets it) per virtual stage; fnppo gives it a multiple of that many.
    """
    if layout.vpp is None:
        return None
    return getattr(unwrap_model(chunks[0]).config, "microbatch_group_size_per_vp_stage", None) or layout.pp


def _interleaved_where(layout: ParallelLayout) -> str:
    return f"the interleaved pipeline schedule (pp={layout.pp}, vpp={layout.vpp})"


def _check_interleaved(fn: str, config: StepConfig | CriticConfig, spec: _Batching, layout: ParallelLayout) -> None:
    """What Megatron's interleaved pipeline schedule (``vpp`` set) needs of the config, checked
    before anything runs: the packed layout (the schedule runs without shape exchanges, so every
    micro-batch of a step must have one activation shape; padded micro-batches differ in their
    number of rows), and an explicit micro-batch count that is a multiple of the schedule's group
    (the default, one micro-batch, is not). The split modes that decide the count at run time
    (``microbatch_size``, ``max_tokens_per_microbatch``) round it up instead (:func:`~fnppo.core.split.build_microbatches`).

    Raises:
        InputError: naming ``config.layout`` or ``config.num_microbatches``.
    """
    if layout.vpp is None:
        return
    group = spec.count_multiple
    where = _interleaved_where(layout)
    if config.layout != "packed":
        raise input_error(fn, "config.layout", f"'packed' under {where}: its stages exchange activations of one shape per step, "
                          "and padded micro-batches differ in their number of rows", repr(config.layout))
    name, count = spec.split
    if name == "num_microbatches" and count % group:
        got = repr(count) if config.num_microbatches is not None else "None (one micro-batch)"
        raise input_error(fn, "config.num_microbatches", f"a multiple of {group} under {where}, which runs micro-batches in "
                          f"groups of {group} per virtual stage (e.g. {-(-count // group) * group}; or split by microbatch_size "
                          "or max_tokens_per_microbatch, whose count is rounded up)", got)


def _with_cp_in_dp(layout: ParallelLayout) -> ParallelLayout:
    """``layout`` whose data-parallel group is Megatron's data-parallel-with-CP group: sums of
    per-token quantities (loss normalizer, metric pairs) run over every token once."""
    if layout.cp == 1:
        return layout
    return dataclasses.replace(layout, dp=layout.dp * layout.cp, dp_group=layout.dp_cp_group)


def _check_batch(fn: str, samples: Sequence[Any], spec: _Batching, collate: CollateFn,
                 num_minibatches: int = 1) -> None:
    """Refuse a batch the step cannot take, before anything runs (the step's one sample check).

    Every check runs on the caller's whole batch, for every mini-batch and epoch the step will run,
    and names ``batch[i]`` with ``i`` the sample's position in it: a non-empty list of
    :class:`~fnppo.core.batch.Sample`, of a length divisible by ``num_minibatches``; no sample longer
    than ``spec.max_seq_len``; a split each mini-batch can take (an explicit ``num_microbatches`` of
    at most the mini-batch size, every sample within ``max_tokens_per_microbatch``:
    :func:`~fnppo.core.split.check_split`); every tensor on one device; reference and rollout
    log-probs (values, returns) for every sample or for none (micro-batches that separate them
    would each look fine on their own); 0/1 response masks and finite per-token values
    (:func:`~fnppo.core.batch.check_sample_values`); token ids in ``[0, vocab_size)`` of the model
    (while call-time checking is on; otherwise ``>= 0``, as the collate stage checks; one host
    sync); routed experts only for an MoE model, of its MoE layers and top-k, in a dtype that holds
    its expert indices, and (while call-time checking is on) valid and distinct indices
    (:func:`~fnppo.core.batch.check_routed_experts`), and, with the default collate stage, one row per
    token (:func:`~fnppo.core.batch.check_routing_rows`). The collate stage checks its micro-batch
    again; the step never relies on that to refuse.

    Raises:
        InputError: naming ``batch``, ``batch[i]...`` or ``config.num_microbatches``.
    """
    if not samples:
        raise input_error(fn, "batch", "a non-empty list of samples", "an empty list")
    if len(samples) % num_minibatches:
        raise input_error(fn, "batch", f"a length divisible by num_minibatches={num_minibatches}", str(len(samples)))
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise input_error(fn, f"batch[{i}]", "a fnppo.Sample", type(s).__name__)
    if spec.max_seq_len is not None:
        limit = spec.max_seq_len
        check_lengths(fn, samples, limit, f"at most {limit} tokens ({spec.max_seq_len_source})", arg="batch")
    check_split(fn, samples, spec.split, pad_to_multiple_of=spec.pad_to_multiple_of,
                length=getattr(collate, "collated_length", len), parts=num_minibatches, arg="batch",
                count_arg="config.num_microbatches")
    check_devices(fn, samples, arg="batch")
    check_same_fields(fn, samples, arg="batch")
    check_sample_values(fn, samples, arg="batch")
    check_token_ids(fn, samples, spec.real_vocab_size if typechecking_enabled() else None, arg="batch")
    if samples[0].routed_experts is not None:  # check_same_fields: all samples or none
        if spec.routing is None:
            raise input_error(fn, "batch[0].routed_experts", "None (the model has no MoE layers)", describe(samples[0].routed_experts))
        layers, topk, experts = spec.routing
        check_routed_experts(fn, samples, num_layers=layers, topk=topk, num_experts=experts, arg="batch", values=typechecking_enabled())
        if collate is collate_microbatch:  # a stage that expands multi-modal items (VLMCollate) checks its own rows
            check_routing_rows(fn, samples, arg="batch")


def _checked_batching(fn: str, config: StepConfig | CriticConfig, chunks: Sequence[nn.Module], samples: Sequence[Any],
                      layout: ParallelLayout, *, num_minibatches: int = 1,
                      cp_config: StepConfig | CriticConfig | None = None) -> _Batching:
    """:func:`_batching`, after the checks every entry point makes before anything runs:
    :func:`_check_context_parallel` (of ``cp_config``, default ``config``), :func:`_check_interleaved`
    and :func:`_check_batch`, in that order."""
    spec = _batching(config, chunks, layout)
    _check_context_parallel(fn, config if cp_config is None else cp_config, spec, layout)
    _check_interleaved(fn, config, spec, layout)
    _check_batch(fn, samples, spec, config.fns.collate, num_minibatches)
    _check_collate_inputs(fn, config.fns.collate, samples, chunks)
    return spec


def _check_collate_inputs(fn: str, collate: CollateFn, samples: Sequence[Sample], chunks: Sequence[nn.Module]) -> None:
    """A collate stage's own input checks, on the caller's whole batch before anything runs.

    A stage with a ``check_batch(fn, samples, *, arg, model)`` method (:class:`~fnppo.megatron.vlm.VLMCollate`:
    images, placeholders and their routed-expert rows, against the model's own image shape) is
    asked here, so its refusals name ``batch[i]`` and come before the first update, agreed over ranks.
    """
    check = getattr(collate, "check_batch", None)
    if check is not None:
        check(fn, samples, arg="batch", model=unwrap_model(chunks[0]))


def _plan(samples: Sequence[Sample], spec: _Batching, collate: CollateFn) -> SplitPlan:
    """The split of ``samples`` as ``spec`` says (:func:`~fnppo.core.split.plan_microbatches`; agreed over DP)."""
    return plan_microbatches(samples, spec.split, layout=spec.layout, pad_to_multiple_of=spec.pad_to_multiple_of,
                             collate=collate, dp_group=spec.dp_group, count_multiple=spec.count_multiple)


def _microbatches(samples: Sequence[Sample], spec: _Batching, collate: CollateFn, device: torch.device,
                  plan: SplitPlan | None = None) -> tuple[Any, list[Microbatch]]:
    """``(plan, micro-batches)`` of ``samples`` split (by ``plan`` when given, else by :func:`_plan`)
    and collated as ``spec`` says (:func:`~fnppo.core.split.build_microbatches`)."""
    return build_microbatches(samples, spec.split, layout=spec.layout, pad_to_multiple_of=spec.pad_to_multiple_of,
                              collate=collate, device=device, dp_group=spec.dp_group,
                              same_length=spec.same_length, context_parallel=spec.context_parallel,
                              count_multiple=spec.count_multiple, plan=plan)


def _unpacker(layout: ParallelLayout) -> Callable[[torch.Tensor, Microbatch], list[torch.Tensor]]:
    """Per-sample views of a micro-batch's ``[batch, seq]`` output; under context parallelism the CP
    ranks' shards gathered (:func:`~fnppo.core.context_parallel.gather_per_sample`)."""
    if layout.cp == 1:
        return unpack_per_sample
    return lambda v, mb: gather_per_sample(v, mb, layout.cp_group)


def _check_logits(fn: str, logits: torch.Tensor, vocab: int | None, layout: ParallelLayout) -> None:
    """The forward must return this rank's vocab shard: ``[..., vocab_size / tp]``."""
    if vocab is None or not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        return
    shard = vocab // layout.tp
    if logits.shape[-1] != shard:
        hint = " (logits already gathered over tensor parallelism; return this rank's shard)" if logits.shape[-1] == vocab and layout.tp > 1 else ""
        raise input_error(
            fn, "logits", f"a last dimension of vocab_size / tp = {vocab} / {layout.tp} = {shard} (this rank's vocab shard)",
            f"{describe(logits)}{hint}",
        )


def _check_values(fn: str, values: torch.Tensor, mb: Microbatch) -> None:
    """The value forward must return one value per position of the micro-batch: ``[batch, seq]``."""
    if not isinstance(values, torch.Tensor) or tuple(values.shape) != tuple(mb.loss_mask.shape):
        got = describe(values) if isinstance(values, torch.Tensor) else type(values).__name__
        raise input_error(fn, "values", f"shape {tuple(mb.loss_mask.shape)} (one value per position of the micro-batch)", got)


def _check_critic_targets(fn: str, samples: Sequence[Sample], loss_cfg: ValueLossConfig) -> None:
    """The critic needs every sample's ``returns``, and its ``values`` when the value loss clips
    (all-or-none was checked with the batch, so the first sample speaks for all)."""
    if samples[0].returns is None:
        raise input_error(fn, "batch[0].returns", "a tensor (the critic's targets, e.g. from fnppo.gae_advantages)", "None")
    if loss_cfg.clip_range is not None and samples[0].values is None:
        raise input_error(fn, "batch[0].values", f"a tensor (the rollout-time values) since ValueLossConfig.clip_range={loss_cfg.clip_range!r}", "None")


def _per_chunk(params: Any, n: int) -> list[Mapping[str, torch.Tensor] | None]:
    if params is None:
        return [None] * n
    if isinstance(params, Mapping):
        if n != 1:
            raise input_error("compute_logprobs", "params", f"a list of {n} dicts (one per model chunk)", "one dict")
        return [params]
    params = list(params)
    if len(params) != n:
        raise input_error("compute_logprobs", "params", f"{n} dicts (one per model chunk)", f"{len(params)}")
    return params


# ---------------------------------------------------------------------------------------------
# one update
# ---------------------------------------------------------------------------------------------
_MEGATRON_HOOKS = ("finalize_model_grads_func", "no_sync_func", "grad_sync_func", "param_sync_func")
"""The fields of Megatron's model config that :func:`_fnppo_finalizer` sets (and restores)."""


@contextlib.contextmanager
def _fnppo_finalizer(chunks: Sequence[nn.Module]) -> Iterator[dict[str, GradStats]]:
    """Point Megatron's config at fnppo's finalizer for one schedule; restore every field it set.

    Sets :data:`_MEGATRON_HOOKS` on the model config that Megatron's schedule reads: fnppo's
    :func:`~fnppo.megatron.grads.finalize_grads` as ``finalize_model_grads_func``, the chunks' ``no_sync``
    as ``no_sync_func``, no grad/param sync hooks (fnppo does not overlap communication). On exit
    (also on error) the four fields get back the values they had, so a user's own schedule run
    afterwards sees its own settings.

    Yields:
        A dict that holds ``"stats"`` (:class:`~fnppo.megatron.grads.GradStats`) once the finalizer ran.
    """
    config = unwrap_model(chunks[0]).config
    saved = {name: getattr(config, name) for name in _MEGATRON_HOOKS}
    record: dict[str, GradStats] = {}

    def finalize(model: list[nn.Module], num_tokens: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> None:
        record["stats"] = finalize_grads(model, num_tokens=num_tokens if config.calculate_per_token_loss else None)

    no_sync = [c.no_sync for c in chunks]
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


def _global_normalizer(mbs: Sequence[Microbatch], loss_cfg: PolicyLossConfig | str, layout: ParallelLayout, device: torch.device) -> torch.Tensor:
    """The loss denominator of the whole mini-batch: summed over micro-batches and DP ranks (fp64).

    ``loss_cfg``: a :class:`PolicyLossConfig` or an aggregation mode name (the value loss's)."""
    local = torch.zeros((), dtype=torch.float64, device=device)
    for mb in mbs:
        local = local + loss_normalizer(mb.loss_mask, loss_cfg, seq_ids=mb.seq_ids).to(device=device, dtype=torch.float64)
    total = local.reshape(1).clone()
    if layout.dp > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=layout.dp_group)
    return total[0].float()


def _check_rollout_logprobs(fn: str, samples: Sequence[Sample], loss_cfg: PolicyLossConfig) -> None:
    """Bypass mode and rollout correction need every sample's ``rollout_logprobs`` (checked before anything runs)."""
    if (loss_cfg.bypass_old_logprobs or loss_cfg.tis_active) and samples[0].rollout_logprobs is None:
        why = "bypass_old_logprobs=True" if loss_cfg.bypass_old_logprobs else "rollout correction is configured"
        raise input_error(fn, "batch[0].rollout_logprobs", f"a tensor since {why} in PolicyLossConfig", "None")


def _global_sums(mbs: Sequence[Microbatch], loss_cfg: PolicyLossConfig, layout: ParallelLayout,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss normalizer and, with ``tis_batch_normalize``, the mean TIS weight of the mini-batch.

    Both are summed over micro-batches and DP ranks before the schedule, in one all-reduce (fp64):
    ``tis_mean = sum(w) / count`` over the kept units (:func:`~fnppo.core.loss.tis_batch_stats`).
    """
    if not loss_cfg.tis_batch_normalize:
        return _global_normalizer(mbs, loss_cfg, layout, device), None
    local = torch.zeros(3, dtype=torch.float64, device=device)
    for mb in mbs:
        pair = tis_batch_stats(mb.old_logprobs, mb.rollout_logprobs, mb.loss_mask, loss_cfg, seq_ids=mb.seq_ids)
        norm = loss_normalizer(mb.loss_mask, loss_cfg, seq_ids=mb.seq_ids).reshape(1)
        local = local + torch.cat([norm, pair.reshape(2)]).to(device=device, dtype=torch.float64)
    if layout.dp > 1:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=layout.dp_group)
    count = local[2]
    return local[0].float(), local[1] / torch.where(count > 0, count, torch.ones_like(count))


def _forward_step_fn(
    config: StepConfig,
    layout: ParallelLayout,
    *,
    normalizer: torch.Tensor | None,
    loss_scale: float,
    spec: _Batching,
    tis_mean: torch.Tensor | None = None,
) -> Callable[[Iterator[Microbatch], nn.Module], Any]:
    """Megatron's ``forward_step_func``: forward, then (last stage) logprob -> loss, scaled."""
    fns = config.fns
    loss_cfg = config.loss
    extra = {} if tis_mean is None else {"tis_mean": tis_mean}

    def forward_step(data_iterator: Iterator[Microbatch], model: nn.Module):
        mb = next(data_iterator)
        with routed(model, mb):  # routing replay when the micro-batch carries routed experts
            out, weight = forward_hidden(model, mb) if config.fused_output else (fns.forward(model, mb), None)

        def loss_func(logits: torch.Tensor):
            # the entropy is always computed: it is reported as a metric whatever its coefficient
            lp, ent = _token_logprobs("train_step", logits, weight, mb, config, layout, spec, True)
            old = mb.rollout_logprobs if loss_cfg.bypass_old_logprobs else mb.old_logprobs  # bypass mode
            loss, metrics = fns.loss(
                lp, old, mb.advantages, mb.loss_mask, loss_cfg,
                entropy=ent, ref_logprobs=mb.ref_logprobs, rollout_logprobs=mb.rollout_logprobs,
                normalizer=normalizer, seq_ids=mb.seq_ids, **extra,
            )
            return loss * loss_scale, {"metrics": metrics}

        return out, loss_func

    return forward_step


def _value_forward_step_fn(config: CriticConfig, *, normalizer: torch.Tensor, loss_scale: float) -> Callable[[Iterator[Microbatch], nn.Module], Any]:
    """Megatron's ``forward_step_func`` of the critic: ``forward_values``, then (last stage) the value loss, scaled."""
    fns, loss_cfg = config.fns, config.loss

    def forward_step(data_iterator: Iterator[Microbatch], model: nn.Module):
        mb = next(data_iterator)
        out = fns.forward(model, mb)

        def loss_func(values: torch.Tensor):
            _check_values("critic_step", values, mb)
            old = mb.values if mb.values is not None else values.detach()  # unused without clipping
            loss, metrics = fns.loss(values, old, mb.returns, mb.loss_mask, loss_cfg.clip_range,
                                     loss_agg_mode=loss_cfg.loss_agg_mode, loss_scale_factor=loss_cfg.loss_scale_factor,
                                     normalizer=normalizer, seq_ids=mb.seq_ids)
            return loss * loss_scale, {"metrics": metrics}

        return out, loss_func

    return forward_step


def _token_logprobs(
    fn: str, out: torch.Tensor, weight: torch.Tensor | None, mb: Microbatch, config: StepConfig,
    layout: ParallelLayout, spec: _Batching, with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``mb``'s labels from the logits, or, with ``weight`` (the fused
    path), from the hidden states ``[seq, batch, hidden]`` and the output-weight shard; over the
    model's real vocabulary (a padded vocabulary's extra columns are left out)."""
    tp_group = layout.tp_group if layout.tp > 1 else None
    kwargs = dict(tp_group=tp_group, temperature=config.temperature, with_entropy=with_entropy, vocab_size=spec.real_vocab_size)
    if weight is None:
        _check_logits(fn, out, spec.vocab_size, layout)
        return config.fns.logprob(out, mb.labels, **kwargs)
    return linear_logprob_and_entropy(out.transpose(0, 1), weight, mb.labels, chunk_vocab=config.fused_output_chunk_vocab,
                                      graphs=config.fused_output_graphs, **kwargs)


def _run_schedule(chunks: Sequence[nn.Module], mbs: Sequence[Microbatch], forward_step: Callable, *, forward_only: bool,
                  layout: ParallelLayout) -> list[Any]:
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
    micro-batch (:func:`_check_interleaved`, the ``same_length`` padding of the split).

    A model built with ``ModelConfig(deterministic=True)`` (Megatron's ``deterministic_mode``) runs
    under torch's deterministic algorithms (:func:`fnppo.megatron.model.deterministic_algorithms`).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fb = get_forward_backward_func()
    interleaved = layout.vpp is not None
    # the schedule's seq_length is the whole sequence: it divides by cp itself (micro-batches hold this CP rank's share)
    seq_len = max(int(mb.input_ids.shape[-1]) for mb in mbs) * layout.cp
    data = [iter(mbs) for _ in chunks]
    config = unwrap_model(chunks[0]).config
    saved = config.variable_seq_lengths
    config.variable_seq_lengths = saved and not interleaved
    try:
        with deterministic_algorithms(config.deterministic_mode):
            return fb(
                forward_step_func=forward_step,
                data_iterator=data if interleaved else data[0],
                model=list(chunks),
                num_microbatches=len(mbs),
                seq_length=seq_len,
                micro_batch_size=int(mbs[0].input_ids.shape[0]),
                forward_only=forward_only,
            )
    finally:
        config.variable_seq_lengths = saved


def _routers(chunks: Sequence[nn.Module], mbs: Sequence[Microbatch], layout: ParallelLayout, device: torch.device):
    """:func:`fnppo.megatron.moe.router_step` for MoE models (yields its state), else a block yielding None."""
    return router_step(chunks, mbs, layout, device) if is_moe(chunks) else contextlib.nullcontext()


class _Objective(NamedTuple):
    """What one update optimizes: the parts in which :func:`train_step` and :func:`critic_step` differ.

    ``global_sums(mbs, layout, device)`` runs before the schedule (the loss normalizer, summed over
    micro-batches and DP ranks, and whatever else the loss needs of the whole mini-batch);
    ``forward_step(sums, loss_scale)`` is Megatron's ``forward_step_func`` for those sums.
    """

    fn: str  # the public function, named in errors
    collate: CollateFn
    global_sums: Callable[[Sequence[Microbatch], ParallelLayout, torch.device], Any]
    forward_step: Callable[[Any, float], Callable[[Iterator[Microbatch], nn.Module], Any]]
    loss_key: str  # the metric whose non-finite value skips the update


def _update(state: TrainState, minibatch: Sequence[Sample], plan: SplitPlan, objective: _Objective, spec: _Batching,
            layout: ParallelLayout, device: torch.device) -> tuple[dict[str, torch.Tensor], float, bool]:
    """One optimizer update on one mini-batch (split by ``plan``): the five steps of :func:`train_step`
    (and of :func:`critic_step`, with its objective).

    Returns:
        ``(metrics, grad_norm, stepped)``: metric pairs reduced over micro-batches and DP ranks
        (identical on every rank), the global grad norm, and whether the optimizer stepped.

    Raises:
        FinalizeNotCalledError: Megatron's schedule returned without calling the finalizer.
    """
    chunks, optimizer = state.model, state.optimizer
    _, mbs = _microbatches(minibatch, spec, objective.collate, device, plan)
    sums = objective.global_sums(mbs, _with_cp_in_dp(layout), device)
    for c in chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    with _fnppo_finalizer(chunks) as record, _routers(chunks, mbs, layout, device) as moe:
        # MoE: the loss is scaled by the step's router token count instead, so that the
        # routers' aux/z losses get exact weights (fnppo.megatron.moe.router_step).
        scale = moe.loss_scale if moe is not None else float(len(mbs) * layout.dp)
        store = _run_schedule(chunks, mbs, objective.forward_step(sums, scale), forward_only=False, layout=layout)
    if "stats" not in record:
        raise FinalizeNotCalledError(
            f"{objective.fn}: Megatron's schedule returned without calling finalize_model_grads; "
            "gradients were not reduced across data-parallel ranks"
        )
    stats = record["stats"]
    metrics = reduce_metrics([s["metrics"] for s in store] if layout.is_last_stage else [], _with_cp_in_dp(layout), device)
    if moe is not None:
        metrics.update(moe.metrics)
    finite = stats.finite and bool(torch.isfinite(metrics.get(objective.loss_key, torch.zeros(2))).all())
    if finite:
        ok, _norm, _zeros = optimizer.step()
        finite = bool(ok)
    return metrics, float(stats.grad_norm), finite


def _train(state: TrainState, samples: list[Sample], objective: _Objective, config: StepConfig | CriticConfig,
           spec: _Batching, layout: ParallelLayout, device: torch.device) -> tuple[TrainState, dict[str, float]]:
    """``ppo_epochs`` passes of ``num_minibatches`` updates (:func:`_update`); the step's metrics.

    Every mini-batch is planned before the first update (the plan is the same in every epoch), so
    that a split refused over the data-parallel group changes nothing."""
    totals: dict[str, torch.Tensor] = {}
    grad_norms: list[float] = []
    skipped = 0
    # Strided mini-batches: with contiguous DP shards (shard_for_data_parallel) of a length
    # divisible by num_minibatches, mini-batch k holds the same samples in every layout.
    minibatches = [samples[k :: config.num_minibatches] for k in range(config.num_minibatches)]
    plans = [_plan(mb, spec, objective.collate) for mb in minibatches]
    for _epoch in range(config.ppo_epochs):
        for minibatch, plan in zip(minibatches, plans, strict=True):
            metrics, norm, stepped = _update(state, minibatch, plan, objective, spec, layout, device)
            totals = merge_metrics([totals, metrics])
            grad_norms.append(norm)
            skipped += 0 if stepped else 1
    step = state.step + len(grad_norms)
    out = finalize_metrics(totals)
    out.update(router_derived_metrics(out))
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["skipped"] = float(skipped)
    out["updates"] = float(len(grad_norms) - skipped)
    out["step"] = float(step)
    lr = [g["lr"] for g in state.optimizer.param_groups] if hasattr(state.optimizer, "param_groups") else []
    if lr:
        out["lr"] = float(lr[0])
    return dataclasses.replace(state, step=step), out


# ---------------------------------------------------------------------------------------------
# public
# ---------------------------------------------------------------------------------------------
def train_step(state: TrainState, batch: Sequence[Sample], config: StepConfig) -> tuple[TrainState, dict[str, float]]:
    """One PPO/GRPO update (or ``ppo_epochs`` x ``num_minibatches`` updates) on this rank's samples.

    ``batch`` is this data-parallel rank's list of :class:`~fnppo.core.batch.Sample` (identical on the TP
    and PP ranks of one DP rank; see :func:`shard_for_data_parallel`). For each mini-batch:

    1. split into micro-batches (same count on every DP rank) and collate them;
    2. the loss normalizer (tokens or sequences, by ``loss_agg_mode``) is summed over all
       micro-batches and DP ranks *before* the schedule, so the sum of micro-batch losses is the
       full-batch loss whatever the split (with ``tis_batch_normalize``, the mean TIS weight of the
       mini-batch too, in the same all-reduce). Under context parallelism (``cp > 1``, packed layout,
       ``token-mean`` loss) every micro-batch is cut to this CP rank's tokens
       (:mod:`fnppo.core.context_parallel`), and the normalizer and the metric pairs are summed over
       Megatron's data-parallel-with-CP group, so each token counts once over CP x DP;
    3. Megatron's ``get_forward_backward_func`` runs ``forward -> logprob -> loss`` per micro-batch;
       each micro-batch loss is multiplied by ``num_microbatches * dp`` to cancel the schedule's mean
       over micro-batches and DDP's mean over DP ranks (with CP, Megatron's schedule multiplies the
       loss by ``cp`` and DDP averages the gradients over the ``dp * cp`` ranks of its
       data-parallel-with-CP group: the factors cancel, and the CP ranks' partial losses add up);
    4. :func:`~fnppo.megatron.grads.finalize_grads` reduces the gradients (installed as Megatron's
       ``finalize_model_grads_func`` for the schedule only; if the schedule does not call it,
       :class:`FinalizeNotCalledError`);
    5. if the loss and grad norm are finite, the optimizer steps (Megatron clips to ``clip_grad``);
       otherwise the step is skipped, parameters and optimizer state stay untouched, and
       ``metrics["skipped"]`` counts it.

    MoE models: samples that carry ``routed_experts`` run every forward (and recomputation) with
    those experts forced (routing replay, :mod:`fnppo.megatron.routing`).

    Reference: PPO, arXiv:1707.06347 (epochs of mini-batch updates on one batch of rollouts).

    Returns:
        The new state (same objects, ``step`` advanced by the number of optimizer updates) and
        metrics reduced exactly over micro-batches, mini-batches and DP ranks, identical on every
        rank: the finalized loss metrics, ``grad_norm`` (mean over updates), ``skipped``,
        ``updates``, ``step`` and ``lr``; for MoE models the router metrics of
        :mod:`fnppo.megatron.moe` (aux and z losses, expert loads and imbalance).

    Raises:
        InputError: before anything runs, nothing changed (no parameter, optimizer state or
            ``state.step``, whichever mini-batch or epoch the offending sample would have been
            trained in), raised on every rank alike (the verdict is agreed over all ranks, the
            message is the lowest refusing rank's, followed by which ranks refused unless all
            refused alike), naming
            ``batch[i]`` with ``i`` the position in ``batch``: a value model (``head="value"``: use
            :func:`critic_step`), an empty batch, a batch length not divisible by
            ``num_minibatches``, a sample longer than ``config.max_seq_len`` (default: the model's
            ``max_sequence_length``), a ``num_microbatches`` above the mini-batch size, a sample
            longer than ``max_tokens_per_microbatch``, tensors on different devices, a response mask
            that is not 0/1, NaN/inf in advantages, log-probs, values or returns, token ids outside
            the model's vocabulary (while call-time checking is on; negative ones always),
            ``ref_logprobs`` / ``rollout_logprobs`` given for some samples only, no
            ``rollout_logprobs`` in bypass mode or with rollout correction, routed experts that do
            not fit the model (:func:`~fnppo.core.batch.check_routed_experts`); under a virtual pipeline
            (``vpp``), a ``num_microbatches`` (default one) that is not a multiple of ``pp`` or the
            padded layout (:func:`_check_interleaved`). Before the first update, on every rank: too
            few samples for the micro-batch count agreed over data parallelism. Inside the
            schedule: logits from ``config.fns.forward`` whose last dimension is not this rank's
            vocab shard. ``docs/errors.md`` lists every error.
        FinalizeNotCalledError: see step 4.
    """
    layout = current_layout()
    samples = list(batch)

    def entry() -> _Batching:
        check_head("train_step", "state.model", state.model[0], "lm")
        checked = _checked_batching("train_step", config, state.model, samples, layout,
                                    num_minibatches=config.num_minibatches)
        _check_rollout_logprobs("train_step", samples, config.loss)
        return checked

    spec = agree_on_refusal(entry, layout)
    device = _device_of(state.model)

    def sums(mbs: Sequence[Microbatch], lay: ParallelLayout, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _global_sums(mbs, config.loss, lay, dev)

    def forward_step(pair: tuple[torch.Tensor, torch.Tensor | None], scale: float) -> Callable:
        return _forward_step_fn(config, layout, normalizer=pair[0], loss_scale=scale, spec=spec, tis_mean=pair[1])

    return _train(state, samples, _Objective("train_step", config.fns.collate, sums, forward_step, "loss"),
                  config, spec, layout, device)


def critic_step(state: TrainState, batch: Sequence[Sample], config: CriticConfig) -> tuple[TrainState, dict[str, float]]:
    """One update of the critic (or ``ppo_epochs`` x ``num_minibatches`` updates) on this rank's samples.

    The value-model counterpart of :func:`train_step`, through the same update mechanism: split and
    collate, the loss normalizer of ``config.loss.loss_agg_mode`` summed over all micro-batches and
    DP ranks before the schedule (so the loss and its gradient do not depend on the split or the
    layout), Megatron's schedule running ``forward_values -> value_loss`` per micro-batch (scaled as
    in :func:`train_step`), :func:`~fnppo.megatron.grads.finalize_grads` installed for the schedule (else
    :class:`FinalizeNotCalledError`), and the optimizer step unless the value loss or the grad norm
    is not finite (then ``metrics["skipped"]`` counts it and nothing changes). Per token, with
    ``V`` the values the forward returns at the position of response token ``j`` (the state before
    it), ``old_V = sample.values[j]`` and ``R = sample.returns[j]``, the loss is
    :func:`~fnppo.core.loss.value_loss`'s clipped ``1/2 max((V - R)^2, (V_clip - R)^2)``, aggregated by
    ``loss_agg_mode`` over the tokens of ``response_mask``. Context parallelism as in
    :func:`train_step` (``token-mean`` only).

    Reference: PPO, arXiv:1707.06347 (the value function trained on the same rollouts as the policy).

    The policy's ``routed_experts`` (routing replay) are left out: an MoE critic routes on its own.

    Args:
        state: the critic's :class:`TrainState` (a value model, ``build_gpt(cfg, head="value")``).
        batch: this DP rank's samples with ``returns`` (and ``values`` when
            ``config.loss.clip_range`` is set), as for :func:`train_step`.
        config: :class:`CriticConfig`.

    Returns:
        The new state (``step`` advanced by the number of updates) and metrics reduced exactly over
        micro-batches, mini-batches and DP ranks, identical on every rank: ``vf_loss``,
        ``vf_clipfrac``, ``vpred_mean``, ``vf_explained_var`` (and the means it derives from:
        ``vf_returns``, ``vf_returns_sq``, ``vf_error``, ``vf_error_sq``), ``grad_norm`` (mean over
        updates), ``skipped``, ``updates``, ``step``, ``lr``.

    Raises:
        InputError: before anything runs, nothing changed, on every rank alike (as in
            :func:`train_step`): a model without a value head; the batch errors (NaN/inf
            ``returns`` or ``values`` included, naming ``batch[i]``) and the virtual-pipeline errors
            of :func:`train_step`; no ``returns``, or no ``values`` while the loss clips. Inside the
            schedule: values from ``config.fns.forward`` that are not ``[batch, seq]``.
        FinalizeNotCalledError: the schedule did not call the finalizer.
    """
    layout = current_layout()
    samples = _without_routes(batch)

    def entry() -> _Batching:
        check_head("critic_step", "state.model", state.model[0], "value")
        checked = _checked_batching("critic_step", config, state.model, samples, layout,
                                    num_minibatches=config.num_minibatches)
        _check_critic_targets("critic_step", samples, config.loss)
        return checked

    spec = agree_on_refusal(entry, layout)
    device = _device_of(state.model)

    def sums(mbs: Sequence[Microbatch], lay: ParallelLayout, dev: torch.device) -> torch.Tensor:
        return _global_normalizer(mbs, config.loss.loss_agg_mode, lay, dev)

    def forward_step(normalizer: torch.Tensor, scale: float) -> Callable:
        return _value_forward_step_fn(config, normalizer=normalizer, loss_scale=scale)

    return _train(state, samples, _Objective("critic_step", config.fns.collate, sums, forward_step, "vf_loss"),
                  config, spec, layout, device)


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
        forward: the forward stage (:class:`ForwardFn`).
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
    chunks = list(model_chunks)
    fn = "forward_only"
    if not microbatches:
        raise input_error(fn, "microbatches", "a non-empty sequence", "an empty sequence")
    layout = current_layout()
    group = _interleaved_group(chunks, layout)
    if group is not None:
        where = _interleaved_where(layout)
        if len(microbatches) % group:
            raise input_error(fn, "microbatches", f"a multiple of {group} micro-batches under {where}, which runs micro-batches "
                              f"in groups of {group} per virtual stage", f"{len(microbatches)} micro-batches")
        shapes = sorted({tuple(mb.input_ids.shape) for mb in microbatches})
        if len(shapes) > 1:
            raise input_error(fn, "microbatches", f"micro-batches of one shape under {where}, which runs without shape exchanges "
                              "(pad packed micro-batches to one length with fnppo.pad_microbatch)",
                              f"input_ids of shapes {', '.join(str(list(t)) for t in shapes)}")
    return _forward_only(chunks, microbatches, output_fn, params=params, forward=forward, recorder=recorder, layout=layout)


def _forward_only(chunks: list[nn.Module], microbatches: Sequence[Microbatch], output_fn: Callable[[torch.Tensor, Microbatch], Any], *,
                  params: Any, forward: ForwardFn, recorder: RoutingRecorder | None, layout: ParallelLayout) -> list[Any] | None:
    """:func:`forward_only` on micro-batches the caller built right (the step's own: one shape and a
    valid count under ``vpp``, see :func:`_check_interleaved`)."""
    by_chunk = {id(c): p for c, p in zip(chunks, _per_chunk(params, len(chunks)))}

    def forward_step(data_iterator: Iterator[Microbatch], model: nn.Module):
        mb = next(data_iterator)
        with routed(model, mb, recorder):
            out = forward(model, mb, params=by_chunk.get(id(model)))

        def loss_func(logits: torch.Tensor):
            return logits.new_zeros((), dtype=torch.float32), {"out": output_fn(logits, mb)}

        return out, loss_func

    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        with torch.no_grad():
            store = _run_schedule(chunks, microbatches, forward_step, forward_only=True, layout=layout)
    finally:
        for c, m in zip(chunks, modes):
            c.train(m)
    if not layout.is_last_stage:
        return None
    return [s["out"] for s in store]


def _logprob_config(config: StepConfig | None, **given: Any) -> StepConfig:
    """``config`` (or the defaults) with the keywords of :func:`compute_logprobs` that are not None.

    A split mode given as a keyword replaces the one of ``config``. Validated by :class:`StepConfig`.
    """
    base = config or StepConfig()
    given = {k: v for k, v in given.items() if v is not None}
    if any(k in given for k in SPLIT_MODES):
        base = dataclasses.replace(base, num_microbatches=None, microbatch_size=None, max_tokens_per_microbatch=None)
    return dataclasses.replace(base, **given) if given else base


def _from_last_stage(per_sample: list[tuple[torch.Tensor, torch.Tensor | None]] | None, lengths: list[int],
                     with_entropy: bool, layout: ParallelLayout, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-sample results of the last pipeline stage (None elsewhere), on every stage (one broadcast)."""
    total = sum(lengths)
    flat = torch.zeros(2 if with_entropy else 1, total, dtype=torch.float32)
    if per_sample is not None and total:
        flat[0] = torch.cat([lp for lp, _ in per_sample])
        if with_entropy:
            flat[1] = torch.cat([ent for _, ent in per_sample])
    if layout.pp > 1:
        buf = flat.to(device)
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
    temperature: float | None = None,
    layout: str | None = None,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    max_tokens_per_microbatch: int | None = None,
    pad_to_multiple_of: int | None = None,
    max_seq_len: int | None = None,
    fns: StepFns | None = None,
    config: StepConfig | None = None,
    return_routing: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None] | tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor]]:
    """Forward-only log-probs (and entropy) of every sample's response tokens, in sample order.

    ``logprobs_i[j] = log pi(y_ij | x_i, y_i<j) `` at ``temperature`` (and the entropy of that
    distribution), for every response token ``j`` of every sample ``i``. Runs Megatron's schedule
    with ``forward_only=True`` in eval mode (no dropout) and without autograd.

    Args:
        model_chunks: the (DDP-wrapped) model chunks.
        batch: this DP rank's samples (the same on its TP and PP ranks).
        params: one dict per model chunk (names of the unwrapped ``GPTModel``): evaluate another
            parameter set with the same modules, e.g. the frozen reference policy
            (:func:`fnppo.megatron.model.snapshot_params`).
        with_entropy: also return the entropies.
        temperature, layout, num_microbatches, microbatch_size, max_tokens_per_microbatch,
            pad_to_multiple_of, max_seq_len: as in :class:`StepConfig` (None: from ``config``,
            else the default).
        fns: the collate, forward and logprob stages (:class:`StepFns`; its loss is unused).
        config: a :class:`StepConfig` supplying every field above left None (accepted for
            compatibility; its loss settings are unused).
        return_routing: also return the experts the routers chose (MoE models; routing replay,
            :mod:`fnppo.megatron.routing`). Samples that carry ``routed_experts`` are always run with
            those experts forced.

    Returns:
        On every rank, one fp32 CPU tensor of length ``len(response_ids)`` per sample, in the
        order of ``batch`` (restored by :meth:`~fnppo.core.split.SplitPlan.restore`), and the entropies
        likewise (or ``None``). Under context parallelism each CP rank computes its shard and the
        shards are gathered (:func:`~fnppo.core.context_parallel.gather_per_sample`). With
        ``return_routing``, a third list: per sample ``[tokens, MoE layers, topk]`` expert
        indices, one row per token of the sample as collated (``len(sample)``; under
        :class:`fnppo.megatron.vlm.VLMCollate` its expanded length, every image ``tokens_per_image`` rows)
        (:func:`fnppo.megatron.routing.record_dtype`; gathered over sequence, context and pipeline
        parallelism), ready for ``Sample.routed_experts``.

    Raises:
        InputError: as :func:`train_step` for the batch, the logits and a virtual pipeline; ``params`` not one dict
            per chunk; invalid keywords (as :class:`StepConfig`); ``return_routing`` for a dense
            model or for samples that carry ``routed_experts``.
    """
    chunks = list(model_chunks)
    par = current_layout()
    samples = list(batch)

    def entry() -> tuple[StepConfig, _Batching, RoutingRecorder | None]:
        cfg = _logprob_config(config, temperature=temperature, layout=layout, num_microbatches=num_microbatches,
                              microbatch_size=microbatch_size, max_tokens_per_microbatch=max_tokens_per_microbatch,
                              pad_to_multiple_of=pad_to_multiple_of, max_seq_len=max_seq_len, fns=fns)
        check_head("compute_logprobs", "model_chunks", chunks[0], "lm")
        _per_chunk(params, len(chunks))
        checked = _checked_batching("compute_logprobs", cfg, chunks, samples, par,
                                    cp_config=dataclasses.replace(cfg, loss=PolicyLossConfig()))
        return cfg, checked, _routing_recorder(return_routing, samples, checked)

    cfg, spec, recorder = agree_on_refusal(entry, par)
    device = _device_of(chunks)
    plan, mbs = _microbatches(samples, spec, cfg.fns.collate, device)
    unpack = _unpacker(par)
    weights: dict[str, torch.Tensor | None] = {"w": None}

    def fused_forward(model: nn.Module, mb: Microbatch, *, params: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        # The schedule calls per_sample right after the last stage's forward of the same micro-batch.
        hidden, weights["w"] = forward_hidden(model, mb, params=params)
        return hidden

    def per_sample(out: torch.Tensor, mb: Microbatch) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        lp, ent = _token_logprobs("compute_logprobs", out, weights["w"], mb, cfg, par, spec, with_entropy)
        if par.cp == 1:  # one copy to the host per micro-batch, then per-sample views of it
            lp, ent = lp.float().cpu(), (ent.float().cpu() if with_entropy else None)
        ents = unpack(ent, mb) if with_entropy else [None] * mb.num_samples
        return [(a.float().cpu(), None if b is None else b.float().cpu()) for a, b in zip(unpack(lp, mb), ents, strict=True)]

    store = _forward_only(chunks, mbs, per_sample, params=params, forward=fused_forward if cfg.fused_output else cfg.fns.forward,
                          recorder=recorder, layout=par)
    restored = None if store is None else plan.restore(store)
    out = _from_last_stage(restored, [s.response_len for s in samples], with_entropy, par, device)
    if recorder is None:
        return out
    return (*out, recorder.per_sample(mbs, plan, spec.routing[0], par.pp_group))


def _routing_recorder(return_routing: bool, samples: Sequence[Sample], spec: _Batching) -> RoutingRecorder | None:
    """The recorder of ``compute_logprobs(return_routing=True)``, after its argument checks."""
    if not return_routing:
        return None
    if spec.routing is None:
        raise input_error("compute_logprobs", "return_routing", "False for a model without MoE layers", "True")
    if samples[0].routed_experts is not None:
        raise input_error("compute_logprobs", "return_routing", "False when the samples carry routed_experts (those are replayed, not recorded)", "True")
    return RoutingRecorder(spec.routing[2])


def _without_routes(batch: Sequence[Sample]) -> list[Sample]:
    """The critic routes on its own: the policy's ``routed_experts`` are not replayed on it."""
    return [dataclasses.replace(s, routed_experts=None) if isinstance(s, Sample) and s.routed_experts is not None else s for s in batch]


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
    :func:`critic_step`. Runs Megatron's schedule with ``forward_only=True`` in eval mode and without
    autograd, like :func:`compute_logprobs`.

    Reference: PPO, arXiv:1707.06347; GAE, arXiv:1506.02438.

    Args:
        model_chunks: the (DDP-wrapped) chunks of a value model (``build_gpt(cfg, head="value")``).
        batch: this DP rank's samples (the same on its TP and PP ranks).
        params: one dict per model chunk (names of the unwrapped model): evaluate another parameter
            set with the same modules.
        config: a :class:`CriticConfig` for the split and layout (its loss is unused; default: one
            micro-batch, packed).

    Returns:
        On every rank, one fp32 CPU tensor of length ``len(response_ids)`` per sample, in the order
        of ``batch``; under context parallelism the CP ranks' shards are gathered.

    Raises:
        InputError: a model without a value head; the batch and virtual-pipeline errors of
            :func:`train_step`; ``params`` not one dict per chunk; values from ``config.fns.forward``
            that are not ``[batch, seq]``.
    """
    cfg = config or CriticConfig()
    chunks = list(model_chunks)
    par = current_layout()
    samples = _without_routes(batch)

    def entry() -> _Batching:
        check_head("compute_values", "model_chunks", chunks[0], "value")
        _per_chunk(params, len(chunks))
        return _checked_batching("compute_values", cfg, chunks, samples, par,
                                 cp_config=dataclasses.replace(cfg, loss=ValueLossConfig()))

    spec = agree_on_refusal(entry, par)
    device = _device_of(chunks)
    plan, mbs = _microbatches(samples, spec, cfg.fns.collate, device)
    unpack = _unpacker(par)

    def per_sample(values: torch.Tensor, mb: Microbatch) -> list[tuple[torch.Tensor, None]]:
        _check_values("compute_values", values, mb)
        return [(v.float().cpu(), None) for v in unpack(values, mb)]

    store = _forward_only(chunks, mbs, per_sample, params=params, forward=cfg.fns.forward, recorder=None, layout=par)
    restored = None if store is None else plan.restore(store)
    values, _ = _from_last_stage(restored, [s.response_len for s in samples], False, par, device)
    return values
