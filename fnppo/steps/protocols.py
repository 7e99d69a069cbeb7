"""The stage signatures of the steps and the records of swappable stages.

Every stage of a step is a field of :class:`StepFns` (the policy) or :class:`CriticFns` (the
critic) and can be replaced by a function with the same signature (a custom loss, a custom
log-prob); :class:`CollateFn`, :class:`ForwardFn`, :class:`LogprobFn`, :class:`HeadFn`,
:class:`LossFn` and :class:`ValueLossFn` state those signatures. :meth:`StepFns.fused` is the
fused output path (hidden states and the output weight -> log-probs, never the logits): its head
stage is a :class:`FusedHead`, which owns the fused backward's block size and graph cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fnppo.core.batching.collate import collate_microbatch
from fnppo.core.batching.sample import Microbatch, Sample
from fnppo.core.errors import check_positive_int, input_error
from fnppo.core.losses import LossConfig, ppo_loss, value_loss
from fnppo.core.ops.linear_distill import linear_logprob_entropy_and_divergence
from fnppo.core.ops.linear_logprob import linear_logprob_and_entropy
from fnppo.core.ops.linear_logprob_graphs import BackwardGraphs
from fnppo.core.ops.logprob import logprob_and_entropy
from fnppo.megatron.forward import forward_hidden, forward_logits, forward_values

__all__ = [
    "CollateFn",
    "ForwardFn",
    "LogprobFn",
    "HeadFn",
    "FusedHead",
    "LossFn",
    "ValueLossFn",
    "StepFns",
    "CriticFns",
]


class CollateFn(Protocol):
    """The collate stage: samples of one micro-batch -> :class:`~fnppo.core.batching.sample.Microbatch`.

    Default :func:`~fnppo.core.batching.collate.collate_microbatch`. ``sample_index`` holds the samples' indices
    in the (mini-)batch being split.
    """

    def __call__(
        self, samples: Sequence[Sample], *, layout: str, pad_to_multiple_of: int, sample_index: Sequence[int]
    ) -> Microbatch: ...


class ForwardFn(Protocol):
    """The forward stage: one model chunk on a micro-batch -> this rank's vocab-shard logits.

    Default :func:`~fnppo.megatron.forward.forward_logits`. On the last pipeline stage the result must be
    ``[batch, seq, vocab_size / tp]``; ``params`` (one dict of the chunk's parameters, or None) is
    passed by :func:`~fnppo.steps.infer.compute_logprobs` / :func:`~fnppo.steps.infer.forward_only` only.
    """

    def __call__(
        self, model: nn.Module, microbatch: Microbatch, *, params: Mapping[str, torch.Tensor] | None = None
    ) -> torch.Tensor: ...


class LogprobFn(Protocol):
    """The log-prob stage: logits and labels -> ``(logprobs, entropy or None)``, both ``[batch, seq]``.

    Default :func:`~fnppo.core.ops.logprob.logprob_and_entropy`. ``vocab_size`` is the model's real
    vocabulary: logits columns at or beyond it (a padded vocabulary's) must be left out.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        tp_group: Any,
        temperature: float,
        with_entropy: bool,
        vocab_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class HeadFn(Protocol):
    """The head stage of the fused output path: hidden states and the output-weight shard -> ``(logprobs, entropy)``.

    Used in place of the log-prob stage when :attr:`StepFns.head` is set; the forward stage then
    returns ``(hidden, weight)`` (:func:`~fnppo.megatron.forward.forward_hidden`). ``hidden`` is
    ``[batch, seq, hidden]``, ``weight`` ``[vocab_size / tp, hidden]`` (``hidden @ weight.T`` are
    this rank's logits); the keywords and the result are those of :class:`LogprobFn`. Default
    (:meth:`StepFns.fused`): a :class:`FusedHead`.
    """

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        tp_group: Any,
        temperature: float,
        with_entropy: bool,
        vocab_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass(frozen=True)
class FusedHead:
    """:func:`~fnppo.core.ops.linear_logprob.linear_logprob_and_entropy` as a :class:`HeadFn`, with its settings.

    ``chunk_vocab``: the fused backward's block of vocabulary rows (None: the function's default,
    about 3-5 % of the logits per block); larger blocks mean fewer kernel launches per micro-batch
    (host time, which bounds steps of small models) for ``tokens x chunk_vocab`` more elements of
    memory. ``graphs``: a :class:`~fnppo.core.ops.linear_logprob_graphs.BackwardGraphs` cache that the
    caller creates and owns (one per model; it keeps static buffers and, on CUDA, replays the fused
    backward as a CUDA graph); None: no cache. The head holds a reference to it and never replaces it.

    Raises:
        InputError: ``chunk_vocab`` that is not an int >= 1 or None; ``graphs`` that is not a
            ``BackwardGraphs`` or None.
    """

    chunk_vocab: int | None = None
    graphs: BackwardGraphs | None = None

    def __post_init__(self) -> None:
        check_positive_int("fnppo.FusedHead", "chunk_vocab", self.chunk_vocab, allow_none=True)
        if self.graphs is not None and not isinstance(self.graphs, BackwardGraphs):
            raise input_error("fnppo.FusedHead", "graphs", "a fnppo.ops.BackwardGraphs or None", repr(self.graphs))

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        tp_group: Any,
        temperature: float,
        with_entropy: bool,
        vocab_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return linear_logprob_and_entropy(
            hidden,
            weight,
            labels,
            tp_group=tp_group,
            temperature=temperature,
            with_entropy=with_entropy,
            vocab_size=vocab_size,
            chunk_vocab=self.chunk_vocab,
            graphs=self.graphs,
        )

    def with_divergence(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        *,
        kind: str,
        logprob_floor: float,
        tp_group: Any,
        temperature: float,
        with_entropy: bool,
        vocab_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The distillation step's head (:func:`fnppo.steps.objective.student_outputs`): log-probs, entropy
        and the divergence to the teacher from both models' hidden states and output-weight shards in one
        chunked pass (:func:`~fnppo.core.ops.linear_distill.linear_logprob_entropy_and_divergence`): no
        ``[tokens, vocab]`` tensor of either model.

        The teacher's log-probs here are exact (only non-finite or extremely small scaled teacher logits
        are raised to ``-1e4``): ``logprob_floor`` (the reverse KL's floor of the teacher's log-probs on
        the unfused paths, applied to the whole log-ratio) is not applied, since one pass over the
        vocabulary knows the teacher's normalizer only at its end. The two paths agree wherever the
        teacher gives every token a log-prob above the floor (``tests/test_distill_step.py``)."""
        del logprob_floor  # see above: the one-pass head computes the exact divergence
        return linear_logprob_entropy_and_divergence(
            hidden,
            weight,
            labels,
            teacher_hidden,
            teacher_weight,
            kind=kind,
            tp_group=tp_group,
            temperature=temperature,
            with_entropy=with_entropy,
            vocab_size=vocab_size,
            chunk_vocab=self.chunk_vocab,
        )


class LossFn(Protocol):
    """The loss stage: per-token tensors of one micro-batch -> ``(loss, metrics)``.

    Default :func:`~fnppo.core.losses.ppo.ppo_loss`; ``metrics`` are ``[2]`` pairs (:mod:`fnppo.core.metrics`).
    In bypass mode (``config.bypass_old_logprobs``) ``old_logprobs`` are the rollout log-probs; the
    keyword ``tis_mean`` (the global mean TIS weight) is passed only when the rollout correction
    normalizes its weights over the batch (``config.correction.batch_normalize``), ``m2_cutoff`` only
    with M2PO's mask, and ``staleness`` (each token's age, ``[batch, seq]``) only when the samples
    carry per-token ages (partial rollouts, ``Staleness.prepare``).
    """

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        config: LossConfig,
        *,
        entropy: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
        rollout_logprobs: torch.Tensor | None,
        normalizer: torch.Tensor | None,
        seq_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class ValueLossFn(Protocol):
    """The critic's loss stage: per-token values and targets of one micro-batch -> ``(loss, metrics)``.

    Default :func:`~fnppo.core.losses.value.value_loss`; ``clip_range`` and the aggregation
    (``loss_agg_mode``, ``loss_scale_factor``: the mode and scale of ``ValueLossConfig.agg``) come from
    :class:`~fnppo.core.losses.value.ValueLossConfig`, ``normalizer`` is the step's global denominator;
    ``metrics`` are ``[2]`` pairs (:mod:`fnppo.core.metrics`).
    """

    def __call__(
        self,
        values: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
        clip_range: float | None,
        *,
        loss_agg_mode: str,
        loss_scale_factor: float | None,
        normalizer: torch.Tensor | None,
        seq_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class StepFns:
    """The swappable stages of a policy step; each must keep the signature of its protocol.

    Attributes:
        collate: :class:`CollateFn` (default :func:`~fnppo.core.batching.collate.collate_microbatch`).
        forward: :class:`ForwardFn` (default :func:`~fnppo.megatron.forward.forward_logits`); with
            ``head`` set, a forward returning ``(hidden, weight)`` on the last pipeline stage
            (:func:`~fnppo.megatron.forward.forward_hidden`).
        logprob: :class:`LogprobFn` (default :func:`~fnppo.core.ops.logprob.logprob_and_entropy`); unused
            (and must stay the default) when ``head`` is set.
        loss: :class:`LossFn` (default :func:`~fnppo.core.losses.ppo.ppo_loss`).
        head: :class:`HeadFn` or None (default): the fused output path's head stage, which replaces
            the log-prob stage and never materializes the logits. :meth:`fused` builds it.

    Raises:
        InputError: ``head`` set with the default ``forward`` (logits, not ``(hidden, weight)``) or
            with a replaced ``logprob`` (the head replaces it).
    """

    collate: CollateFn = collate_microbatch
    forward: ForwardFn = forward_logits
    logprob: LogprobFn = logprob_and_entropy
    loss: LossFn = ppo_loss
    head: HeadFn | None = None

    def __post_init__(self) -> None:
        if self.head is None:
            return
        if self.forward is forward_logits:
            raise input_error(
                "StepFns",
                "forward",
                "a forward returning (hidden, weight) such as forward_hidden when head is set (StepFns.fused())",
                "forward_logits",
            )
        if self.logprob is not logprob_and_entropy:
            raise input_error(
                "StepFns", "logprob", "the default when head is set (the head replaces it)", repr(self.logprob)
            )

    @classmethod
    def fused(cls, *, chunk_vocab: int | None = None, graphs: BackwardGraphs | None = None, **stages: Any) -> StepFns:
        """The fused output path: the last pipeline stage stops before the output layer
        (:func:`~fnppo.megatron.forward.forward_hidden`) and a :class:`FusedHead` computes log-probs
        and entropy from the hidden states and the output weight, never materializing the logits.

        ``chunk_vocab`` and ``graphs`` are :class:`FusedHead`'s (``graphs``: a
        :class:`~fnppo.core.ops.linear_logprob_graphs.BackwardGraphs` the caller creates and keeps);
        ``stages``: other fields of :class:`StepFns` (``collate``, ``loss``, or ``head`` for a head
        of one's own).
        """
        if "head" in stages and (chunk_vocab is not None or graphs is not None):
            raise input_error(
                "StepFns.fused", "head", "None when chunk_vocab or graphs is given (they are FusedHead's)", "a head"
            )
        head = stages.pop("head", None) or FusedHead(chunk_vocab=chunk_vocab, graphs=graphs)
        return cls(**{"forward": forward_hidden, **stages, "head": head})


@dataclass(frozen=True)
class CriticFns:
    """The swappable stages of :func:`~fnppo.steps.train.critic_step`; each must keep the signature of its protocol.

    Attributes:
        collate: :class:`CollateFn` (default :func:`~fnppo.core.batching.collate.collate_microbatch`).
        forward: :class:`ForwardFn` returning ``[batch, seq]`` values on the last stage (default
            :func:`~fnppo.megatron.forward.forward_values`).
        loss: :class:`ValueLossFn` (default :func:`~fnppo.core.losses.value.value_loss`).
    """

    collate: CollateFn = collate_microbatch
    forward: ForwardFn = forward_values
    loss: ValueLossFn = value_loss
