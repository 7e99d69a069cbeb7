"""The steps' configurations and their persistent state, each validated once when built.

:class:`Batching` holds how a batch becomes micro-batches and updates (the fields that the policy
and the critic share) and checks them; :class:`StepConfig` (the policy) and :class:`CriticConfig`
(the critic) inherit it, so both are built with flat keyword arguments. :class:`TrainState` is what
persists between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fnppo.core.errors import check_bool_fields, check_float, check_positive_int, input_error
from fnppo.core.linear_logprob_graphs import BackwardGraphs
from fnppo.core.logprob import logprob_and_entropy
from fnppo.core.losses import LossConfig, ValueLossConfig
from fnppo.core.sample import LAYOUTS
from fnppo.core.split import split_mode
from fnppo.megatron.forward import forward_logits
from fnppo.steps.protocols import CriticFns, StepFns

__all__ = ["Batching", "StepConfig", "CriticConfig", "TrainState"]


@dataclass(frozen=True, kw_only=True)
class Batching:
    """How a batch becomes micro-batches and updates (the fields every step config shares).

    Exactly one of ``num_microbatches``, ``microbatch_size`` and ``max_tokens_per_microbatch``
    chooses the split (default: one micro-batch). ``num_minibatches`` optimizer steps are taken per
    epoch (mini-batch ``k`` holds samples ``k, k + num_minibatches, ...`` of this rank's batch, which
    makes the mini-batches the same in every data-parallel layout), ``ppo_epochs`` passes over the
    batch per call. ``pad_to_multiple_of`` defaults to the TP size (``2*cp*tp`` under context
    parallelism, :func:`~fnppo.core.sample.padding_multiple`). ``max_seq_len`` caps the length
    (prompt + response) of every sample; when None, the model's ``max_sequence_length`` is the cap.
    A longer sample is refused (:class:`~fnppo.core.errors.InputError`), never truncated.

    Raises:
        InputError: naming the class (``StepConfig``, ``CriticConfig``): a bool field holding
            anything but a bool, an unknown layout, two split modes, a size that is not an int >= 1.
    """

    layout: str = "packed"
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    max_tokens_per_microbatch: int | None = None
    pad_to_multiple_of: int | None = None
    max_seq_len: int | None = None
    num_minibatches: int = 1
    ppo_epochs: int = 1

    def __post_init__(self) -> None:
        fn = type(self).__name__
        check_bool_fields(fn, self)
        if self.layout not in LAYOUTS:
            raise input_error(fn, "layout", "'packed' or 'padded'", repr(self.layout))
        split_mode(self.num_microbatches, self.microbatch_size, self.max_tokens_per_microbatch, fn=fn, required=False)
        for n in ("num_minibatches", "ppo_epochs"):
            check_positive_int(fn, n, getattr(self, n))
        for n in ("pad_to_multiple_of", "max_seq_len"):
            check_positive_int(fn, n, getattr(self, n), allow_none=True)


@dataclass(frozen=True, kw_only=True)
class StepConfig(Batching):
    """How :func:`~fnppo.steps.train.train_step` and :func:`~fnppo.steps.infer.compute_logprobs`
    turn a batch into micro-batches, log-probs and updates.

    ``loss``: the policy loss, a :class:`~fnppo.core.losses.config.LossConfig` (the step itself reads
    only its aggregation, rollout correction and bypass mode). The batching fields (``layout``, the
    split, ``pad_to_multiple_of``, ``max_seq_len``, ``num_minibatches``, ``ppo_epochs``) are
    :class:`Batching`'s.
    ``fused_output``: the last pipeline stage stops before the output layer
    (:func:`~fnppo.megatron.forward.forward_hidden`) and computes log-probs and entropy with
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

    loss: LossConfig = field(default_factory=LossConfig)
    temperature: float = 1.0
    fns: StepFns = field(default_factory=StepFns)
    fused_output: bool = False
    fused_output_chunk_vocab: int | None = None
    fused_output_graphs: BackwardGraphs | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        fn = "StepConfig"
        check_positive_int(fn, "fused_output_chunk_vocab", self.fused_output_chunk_vocab, allow_none=True)
        if self.fused_output_graphs is not None:
            if not isinstance(self.fused_output_graphs, BackwardGraphs):
                raise input_error(
                    fn, "fused_output_graphs", "a fnppo.ops.BackwardGraphs or None", repr(self.fused_output_graphs)
                )
            if not self.fused_output:
                raise input_error(
                    fn,
                    "fused_output_graphs",
                    "None unless fused_output=True (the graphs are the fused backward's)",
                    repr(self.fused_output_graphs),
                )
        check_float(fn, "temperature", self.temperature, low=0, low_open=True)
        replaced = self.fns.forward is not forward_logits or self.fns.logprob is not logprob_and_entropy
        if self.fused_output and replaced:
            raise input_error(
                fn,
                "fused_output",
                "False when fns.forward or fns.logprob is replaced (the fused path replaces both)",
                "True",
            )


@dataclass(frozen=True, kw_only=True)
class CriticConfig(Batching):
    """How :func:`~fnppo.steps.train.critic_step` and :func:`~fnppo.steps.infer.compute_values`
    turn a batch into micro-batches and updates.

    ``loss``: the clipped value loss (:class:`~fnppo.core.losses.value.ValueLossConfig`). The batching fields
    (``layout``, the split, ``pad_to_multiple_of``, ``max_seq_len``, ``num_minibatches``,
    ``ppo_epochs``) are :class:`Batching`'s, as in :class:`StepConfig`.

    Raises:
        InputError: as :class:`StepConfig` for the batching fields; a bool field holding anything
            but a bool.
    """

    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    fns: CriticFns = field(default_factory=CriticFns)


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
