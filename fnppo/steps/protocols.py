"""The stage signatures of the steps and the records of swappable stages.

Every stage of a step is a field of :class:`StepFns` (the policy) or :class:`CriticFns` (the
critic) and can be replaced by a function with the same signature (a custom loss, a custom
log-prob); :class:`CollateFn`, :class:`ForwardFn`, :class:`LogprobFn`, :class:`LossFn` and
:class:`ValueLossFn` state those signatures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fnppo.core.collate import collate_microbatch
from fnppo.core.logprob import logprob_and_entropy
from fnppo.core.losses import LossConfig, ppo_loss, value_loss
from fnppo.core.sample import Microbatch, Sample
from fnppo.megatron.forward import forward_logits, forward_values

__all__ = ["CollateFn", "ForwardFn", "LogprobFn", "LossFn", "ValueLossFn", "StepFns", "CriticFns"]


class CollateFn(Protocol):
    """The collate stage: samples of one micro-batch -> :class:`~fnppo.core.sample.Microbatch`.

    Default :func:`~fnppo.core.collate.collate_microbatch`. ``sample_index`` holds the samples' indices
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

    Default :func:`~fnppo.core.logprob.logprob_and_entropy`. ``vocab_size`` is the model's real
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


class LossFn(Protocol):
    """The loss stage: per-token tensors of one micro-batch -> ``(loss, metrics)``.

    Default :func:`~fnppo.core.losses.ppo.ppo_loss`; ``metrics`` are ``[2]`` pairs (:mod:`fnppo.core.metrics`).
    In bypass mode (``config.bypass_old_logprobs``) ``old_logprobs`` are the rollout log-probs; the
    keyword ``tis_mean`` (the global mean TIS weight) is passed only when the rollout correction
    normalizes its weights over the batch (``config.correction.batch_normalize``).
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
        collate: :class:`CollateFn` (default :func:`~fnppo.core.collate.collate_microbatch`).
        forward: :class:`ForwardFn` (default :func:`~fnppo.megatron.forward.forward_logits`).
        logprob: :class:`LogprobFn` (default :func:`~fnppo.core.logprob.logprob_and_entropy`).
        loss: :class:`LossFn` (default :func:`~fnppo.core.losses.ppo.ppo_loss`).
    """

    collate: CollateFn = collate_microbatch
    forward: ForwardFn = forward_logits
    logprob: LogprobFn = logprob_and_entropy
    loss: LossFn = ppo_loss


@dataclass(frozen=True)
class CriticFns:
    """The swappable stages of :func:`~fnppo.steps.train.critic_step`; each must keep the signature of its protocol.

    Attributes:
        collate: :class:`CollateFn` (default :func:`~fnppo.core.collate.collate_microbatch`).
        forward: :class:`ForwardFn` returning ``[batch, seq]`` values on the last stage (default
            :func:`~fnppo.megatron.forward.forward_values`).
        loss: :class:`ValueLossFn` (default :func:`~fnppo.core.losses.value.value_loss`).
    """

    collate: CollateFn = collate_microbatch
    forward: ForwardFn = forward_values
    loss: ValueLossFn = value_loss
