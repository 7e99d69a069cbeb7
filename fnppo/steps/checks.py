"""The steps' entry checks: everything a call refuses, decided before anything runs.

Checks happen once, where data enters: the configs check themselves when built
(:mod:`fnppo.steps.config`), :func:`checked_plan` the samples (their values included, for every
mini-batch and epoch) and what the parallel layout needs of the config when a public step receives
them, :func:`check_logits` / :func:`check_values` what a forward stage returns. Everything
downstream trusts them. The public steps run their entry checks before any collective and agree on
the verdict over every rank (:func:`~fnppo.megatron.parallel.agree_on_refusal`): a refusal is raised
on all ranks, with one message, or on none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fnppo.core.batching.checks import (
    check_devices,
    check_lengths,
    check_routed_experts,
    check_routing_rows,
    check_same_fields,
    check_sample_values,
    check_token_ids,
)
from fnppo.core.batching.collate import collate_microbatch
from fnppo.core.batching.prefix import check_prompt_groups
from fnppo.core.batching.sample import Microbatch, Sample, padding_multiple
from fnppo.core.batching.split import check_split
from fnppo.core.errors import describe, input_error
from fnppo.core.losses import SEQ_REJECTION_CRITERIA, LossConfig, ValueLossConfig
from fnppo.core.losses.policy import loss_name, reads_probabilities
from fnppo.core.typing import typechecking_enabled
from fnppo.megatron.parallel import ParallelLayout
from fnppo.megatron.routing import RoutingRecorder
from fnppo.steps.config import Batching
from fnppo.steps.plan import ModelFacts, Plan, make_plan, uses_transformer_engine
from fnppo.steps.protocols import CollateFn

__all__ = [
    "checked_plan",
    "check_packing",
    "check_context_parallel",
    "check_interleaved",
    "check_batch",
    "check_collate_inputs",
    "check_forward_only_microbatches",
    "check_logits",
    "check_values",
    "check_critic_targets",
    "check_rollout_logprobs",
    "check_old_logprobs",
    "check_probabilities",
    "check_config",
    "per_chunk",
    "routing_recorder",
    "interleaved_where",
]


def checked_plan(
    fn: str, config: Batching, model: ModelFacts, samples: Sequence[Any], *, num_minibatches: int = 1, loss: Any = None
) -> Plan:
    """:func:`~fnppo.steps.plan.make_plan`, after the checks every entry point makes before anything
    runs: :func:`check_context_parallel` (of the loss ``loss``; None: no loss is computed),
    :func:`check_interleaved`, :func:`check_packing`, :func:`check_batch` and
    :func:`check_collate_inputs`, in that order."""
    plan = make_plan(config, model)
    check_context_parallel(fn, config, plan, loss)
    check_interleaved(fn, config, plan)
    check_packing(fn, config, plan)
    check_batch(fn, samples, plan, config.fns.collate, num_minibatches)
    check_collate_inputs(fn, config.fns.collate, samples, model)
    return plan


def check_context_parallel(fn: str, config: Batching, plan: Plan, loss: Any) -> None:
    """What context parallelism needs of the config: packed layout, segments divisible by ``2*cp*tp``,
    and a token-level loss (the shard of a sequence does not know the sequence's token count); for
    the policy loss, a policy loss whose tokens read no statistic of their whole sequence (``gspo``,
    ``gmpo``: ``per_sequence``) and token-level rollout correction. ``loss``: the loss the call computes, or None.

    Raises:
        InputError: naming the config field.
    """
    layout = plan.model.layout
    if layout.cp == 1:
        return
    need = padding_multiple(layout.tp, layout.cp)
    if config.layout != "packed":
        raise input_error(
            fn, "config.layout", f"'packed' with context parallelism (cp={layout.cp})", repr(config.layout)
        )
    if plan.pad_to_multiple_of % need:
        raise input_error(
            fn,
            "config.pad_to_multiple_of",
            f"a multiple of 2*cp*tp = {need} (context parallelism)",
            repr(plan.pad_to_multiple_of),
        )
    if loss is None:
        return
    if loss.agg.mode != "token-mean":
        raise input_error(
            fn, "config.loss.agg.mode", f"'token-mean' with context parallelism (cp={layout.cp})", repr(loss.agg.mode)
        )
    policy = getattr(loss, "policy", None)  # the policy loss (the critic has none)
    if getattr(policy, "per_sequence", False):
        raise input_error(
            fn,
            "config.loss.policy",
            f"a policy loss of tokens, not of whole sequences, with context parallelism (cp={layout.cp}: a rank "
            "holds part of every sequence, so a sequence ratio or mean would be of that part)",
            loss_name(policy),
        )
    correction = getattr(loss, "correction", None)  # the policy loss's rollout correction (the critic has none)
    if correction is None:
        return
    if correction.sequence_level:
        name = "level" if correction.level == "sequence" else "reject_level"
        raise input_error(
            fn,
            f"config.loss.correction.{name}",
            f"'token' with context parallelism (cp={layout.cp})",
            repr(getattr(correction, name)),
        )
    seq_criteria = [n for n in SEQ_REJECTION_CRITERIA if getattr(correction, n) is not None]
    if seq_criteria:  # sequence statistics need the whole sequence; a CP rank holds part of it
        raise input_error(
            fn,
            f"config.loss.correction.{seq_criteria[0]}",
            f"None with context parallelism (cp={layout.cp})",
            repr(getattr(correction, seq_criteria[0])),
        )


def check_packing(fn: str, config: Batching, plan: Plan) -> None:
    """What shared-prefix packing (``config.packing``) needs of the model and the stages, where it
    is exact: fnppo's packed attention of the local layer spec (Transformer Engine's THD attention
    has no mask for a prefix that several segments see), no context parallelism (a CP rank's
    shard of a document would need the prefix rule in the all-gathered attention), no module that
    says why it cannot share one (its ``no_shared_prefix``: e.g. an attention that fixes a sample's bits
    by running it alone), the default collate stage (a stage
    of its own, e.g. :class:`~fnppo.megatron.vlm_collate.VLMCollate`, packs by itself) and a text
    model.

    Raises:
        InputError: naming ``config.packing`` (the model or layout) or ``config.fns.collate``.
    """
    if plan.packing is None:
        return
    model = plan.model
    why = None
    if model.layout.cp > 1:
        why = f"context parallelism (cp={model.layout.cp}): the shards' attention has no shared-prefix rule"
    elif uses_transformer_engine(model.core):
        why = "Transformer Engine's layer spec: its THD attention cannot express a prefix shared by segments"
    elif refusal := next((r for m in model.core.modules() if (r := getattr(m, "no_shared_prefix", None))), None):
        why = refusal  # a module of the model says why it cannot share a prefix
    elif getattr(model.core, "takes_multi_modal", False):
        why = "a vision-language model: its images expand inside each sample"
    if why is not None:
        raise input_error(fn, "config.packing", f"None with {why}", repr(plan.packing))
    if config.fns.collate is not collate_microbatch:
        raise input_error(
            fn,
            "config.fns.collate",
            "collate_microbatch with shared-prefix packing (a collate stage of its own packs by itself)",
            getattr(config.fns.collate, "__name__", type(config.fns.collate).__name__),
        )


def interleaved_where(layout: ParallelLayout) -> str:
    return f"the interleaved pipeline schedule (pp={layout.pp}, vpp={layout.vpp})"


def check_interleaved(fn: str, config: Batching, plan: Plan) -> None:
    """What Megatron's interleaved pipeline schedule (``vpp`` set) needs of the config, checked
    before anything runs: the packed layout (the schedule runs without shape exchanges, so every
    micro-batch of a step must have one activation shape; padded micro-batches differ in their
    number of rows), and an explicit micro-batch count that is a multiple of the schedule's group
    (the default, one micro-batch, is not). The split modes that decide the count at run time
    (``microbatch_size``, ``max_tokens_per_microbatch``) round it up instead
    (:func:`~fnppo.core.batching.split.build_microbatches`).

    Raises:
        InputError: naming ``config.layout`` or ``config.num_microbatches``.
    """
    layout = plan.model.layout
    if layout.vpp is None:
        return
    group = plan.count_multiple
    where = interleaved_where(layout)
    if config.layout != "packed":
        raise input_error(
            fn,
            "config.layout",
            f"'packed' under {where}: its stages exchange activations of one shape "
            "per step, and padded micro-batches differ in their number of rows",
            repr(config.layout),
        )
    count = plan.split.fixed_count
    if count is not None and count % group:
        given = config.split is not None or config.num_microbatches is not None
        raise input_error(
            fn,
            f"config.{config.split_arg}",
            f"a multiple of {group} under {where}, which runs "
            f"micro-batches in groups of {group} per virtual stage (e.g. {-(-count // group) * group}; "
            "or split by microbatch_size or max_tokens_per_microbatch, whose count is rounded up)",
            repr(config.split or count) if given else "None (one micro-batch)",
        )


def check_batch(fn: str, samples: Sequence[Any], plan: Plan, collate: CollateFn, num_minibatches: int = 1) -> None:
    """Refuse a batch the step cannot take, before anything runs (the step's one sample check).

    Every check runs on the caller's whole batch, for every mini-batch and epoch the step will run,
    and names ``batch[i]`` with ``i`` the sample's position in it: a non-empty list of
    :class:`~fnppo.core.batching.sample.Sample`, of a length divisible by ``num_minibatches``; no sample longer
    than ``plan.max_seq_len``; a split each mini-batch can take (an explicit ``num_microbatches`` of
    at most the mini-batch size, every sample within ``max_tokens_per_microbatch``:
    :func:`~fnppo.core.batching.split.check_split`); every tensor on one device; reference and rollout
    log-probs (values, returns) for every sample or for none (micro-batches that separate them
    would each look fine on their own); 0/1 response masks and finite per-token values
    (:func:`~fnppo.core.batching.checks.check_sample_values`); token ids in ``[0, vocab_size)`` of the model
    (while call-time checking is on; otherwise ``>= 0``, as the collate stage checks; one host
    sync); routed experts only for an MoE model, of its MoE layers and top-k, in a dtype that holds
    its expert indices, and (while call-time checking is on) valid and distinct indices
    (:func:`~fnppo.core.batching.checks.check_routed_experts`), and, with the default collate stage, one row per
    token (:func:`~fnppo.core.batching.checks.check_routing_rows`). The collate stage checks its micro-batch
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
    if plan.max_seq_len is not None:
        limit = plan.max_seq_len
        check_lengths(fn, samples, limit, f"at most {limit} tokens ({plan.max_seq_len_source})", arg="batch")
    check_split(
        fn,
        samples,
        plan.split,
        pad_to_multiple_of=plan.pad_to_multiple_of,
        length=getattr(collate, "collated_length", len),
        parts=num_minibatches,
        arg="batch",
        count_arg=f"config.{plan.split_arg}",
        layout=plan.layout,
        packing=plan.packing,
    )
    check_devices(fn, samples, arg="batch")
    check_same_fields(fn, samples, arg="batch")
    check_sample_values(fn, samples, arg="batch")
    check_token_ids(fn, samples, plan.model.real_vocab_size if typechecking_enabled() else None, arg="batch")
    if samples[0].routed_experts is not None:  # check_same_fields: all samples or none
        routing = plan.model.routing
        if routing is None:
            raise input_error(
                fn, "batch[0].routed_experts", "None (the model has no MoE layers)", describe(samples[0].routed_experts)
            )
        layers, topk, experts = routing
        check_routed_experts(
            fn, samples, num_layers=layers, topk=topk, num_experts=experts, arg="batch", values=typechecking_enabled()
        )
        if collate is collate_microbatch:  # a stage that expands multi-modal items (VLMCollate) checks its own rows
            check_routing_rows(fn, samples, arg="batch")
    if plan.packing is not None:  # a declared group's prompts, multi-modal items, a group's prompt routes
        check_prompt_groups(fn, samples, arg="batch")


def check_collate_inputs(fn: str, collate: CollateFn, samples: Sequence[Sample], model: ModelFacts) -> None:
    """A collate stage's own input checks, on the caller's whole batch before anything runs.

    A stage with a ``check_batch(fn, samples, *, arg, model)`` method (:class:`~fnppo.megatron.vlm_collate.VLMCollate`:
    images, placeholders and their routed-expert rows, against the model's own image shape) is
    asked here, so its refusals name ``batch[i]`` and come before the first update, agreed over ranks.
    """
    check = getattr(collate, "check_batch", None)
    if check is not None:
        check(fn, samples, arg="batch", model=model.core)


def check_forward_only_microbatches(fn: str, microbatches: Sequence[Microbatch], model: ModelFacts) -> None:
    """What :func:`~fnppo.steps.infer.forward_only` needs of micro-batches collated by its caller:
    at least one, and under ``vpp`` one shape and a count that is a multiple of the schedule's group.

    Raises:
        InputError: naming ``microbatches``.
    """
    if not microbatches:
        raise input_error(fn, "microbatches", "a non-empty sequence", "an empty sequence")
    group = model.interleaved_group
    if group is None:
        return
    where = interleaved_where(model.layout)
    if len(microbatches) % group:
        raise input_error(
            fn,
            "microbatches",
            f"a multiple of {group} micro-batches under {where}, which runs "
            f"micro-batches in groups of {group} per virtual stage",
            f"{len(microbatches)} micro-batches",
        )
    shapes = sorted({tuple(mb.input_ids.shape) for mb in microbatches})
    if len(shapes) > 1:
        raise input_error(
            fn,
            "microbatches",
            f"micro-batches of one shape under {where}, which runs without shape "
            "exchanges (pad packed micro-batches to one length with fnppo.pad_microbatch)",
            f"input_ids of shapes {', '.join(str(list(t)) for t in shapes)}",
        )


def check_logits(fn: str, logits: torch.Tensor, vocab: int | None, layout: ParallelLayout) -> None:
    """The forward must return this rank's vocab shard: ``[..., vocab_size / tp]``."""
    if vocab is None or not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        return
    shard = vocab // layout.tp
    if logits.shape[-1] != shard:
        gathered = logits.shape[-1] == vocab and layout.tp > 1
        hint = " (logits already gathered over tensor parallelism; return this rank's shard)" if gathered else ""
        raise input_error(
            fn,
            "logits",
            f"a last dimension of vocab_size / tp = {vocab} / {layout.tp} = {shard} (this rank's vocab shard)",
            f"{describe(logits)}{hint}",
        )


def check_values(fn: str, values: torch.Tensor, mb: Microbatch) -> None:
    """The value forward must return one value per position of the micro-batch: ``[batch, seq]``."""
    if not isinstance(values, torch.Tensor) or tuple(values.shape) != tuple(mb.loss_mask.shape):
        got = describe(values) if isinstance(values, torch.Tensor) else type(values).__name__
        want = f"shape {tuple(mb.loss_mask.shape)} (one value per position of the micro-batch)"
        raise input_error(fn, "values", want, got)


def check_critic_targets(fn: str, samples: Sequence[Sample], loss_cfg: ValueLossConfig) -> None:
    """The critic needs every sample's ``returns``, and its ``values`` when the value loss clips
    (all-or-none was checked with the batch, so the first sample speaks for all)."""
    if samples[0].returns is None:
        raise input_error(
            fn, "batch[0].returns", "a tensor (the critic's targets, e.g. from fnppo.advantages.gae_advantages)", "None"
        )
    if loss_cfg.clip_range is not None and samples[0].values is None:
        raise input_error(
            fn,
            "batch[0].values",
            f"a tensor (the rollout-time values) since ValueLossConfig.clip_range={loss_cfg.clip_range!r}",
            "None",
        )


def check_rollout_logprobs(fn: str, samples: Sequence[Sample], loss_cfg: LossConfig) -> None:
    """Bypass mode and rollout correction need every sample's ``rollout_logprobs`` (checked before anything runs)."""
    if loss_cfg.needs_rollout_logprobs and samples[0].rollout_logprobs is None:
        why = "bypass_old_logprobs=True" if loss_cfg.bypass_old_logprobs else "a rollout correction is configured"
        raise input_error(fn, "batch[0].rollout_logprobs", f"a tensor since {why} in LossConfig", "None")


def check_config(fn: str, config: Any, cls: type, expected: str) -> None:
    """A step's ``config`` is its own config class (another config, a loss config or a dict is refused)."""
    if not isinstance(config, cls):
        shown = f"the class {config.__name__}" if isinstance(config, type) else f"{type(config).__name__} {config!r}"
        raise input_error(fn, "config", expected, shown[:160])


def check_old_logprobs(fn: str, samples: Sequence[Any], loss_cfg: LossConfig) -> None:
    """A loss that reads the old (proximal) log-probs (:attr:`~fnppo.core.losses.config.LossConfig.needs_old_logprobs`:
    a ratio-based policy loss or a rollout correction, outside bypass mode) needs them on every sample:
    the step never computes them, and a missing one would be trained against as zeros."""
    if not loss_cfg.needs_old_logprobs:
        return
    for i, s in enumerate(samples):
        if isinstance(s, Sample) and s.old_logprobs is None:
            raise input_error(
                fn,
                f"batch[{i}].old_logprobs",
                f"a tensor: the loss reads the old (proximal) policy's log-probs (policy loss "
                f"{loss_name(loss_cfg.policy)!r}{', rollout correction' if loss_cfg.correction is not None else ''}); "
                "compute them before the step with fnppo.compute_logprobs(state.model, batch, config=config), "
                "or set LossConfig(bypass_old_logprobs=True) to use the samples' rollout_logprobs instead",
                "None",
            )


def check_probabilities(fn: str, samples: Sequence[Any], loss_cfg: LossConfig) -> None:
    """A policy loss that reads ``exp(old)`` as a probability (DPPO, IPO, KPop:
    :func:`~fnppo.core.losses.policy.reads_probabilities`) refuses old log-probs above 0 (in bypass mode:
    the rollout log-probs) at any response position, before anything runs (the loss would refuse them
    inside the schedule)."""
    if not reads_probabilities(loss_cfg.policy):
        return
    name = "rollout_logprobs" if loss_cfg.bypass_old_logprobs else "old_logprobs"
    for i, s in enumerate(samples):
        t = getattr(s, name, None) if isinstance(s, Sample) else None
        if t is not None and t.numel() and bool((t > 0).any()):
            raise input_error(
                fn,
                f"batch[{i}].{name}",
                f"log-probs <= 0 (the policy loss {loss_name(loss_cfg.policy)!r} reads exp({name}) as the "
                "probability of the token)",
                f"{describe(t)} with max {t.max().item()!r}",
            )


def per_chunk(params: Any, n: int) -> list[Mapping[str, torch.Tensor] | None]:
    """``params`` (None, one dict, or one dict per chunk) as one entry per model chunk.

    Raises:
        InputError: not one dict per model chunk.
    """
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


def routing_recorder(return_routing: bool, samples: Sequence[Sample], plan: Plan) -> RoutingRecorder | None:
    """The recorder of ``compute_logprobs(return_routing=True)``, after its argument checks."""
    if not return_routing:
        return None
    if plan.model.routing is None:
        raise input_error("compute_logprobs", "return_routing", "False for a model without MoE layers", "True")
    if samples[0].routed_experts is not None:
        raise input_error(
            "compute_logprobs",
            "return_routing",
            "False when the samples carry routed_experts (those are replayed, not recorded)",
            "True",
        )
    return RoutingRecorder(plan.model.routing[2])
