"""The steps' configurations and their persistent state, each validated once when built.

:class:`Batching` holds how a batch becomes micro-batches and updates (the fields that the policy
and the critic share) and checks them; :class:`StepConfig` (the policy) and :class:`CriticConfig`
(the critic) inherit it, so both are built with flat keyword arguments. :class:`TrainState` is what
persists between steps (defined in :mod:`fnppo.megatron.state`, where the checkpoint layer types it).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from fnppo.core.batching.sample import LAYOUTS
from fnppo.core.batching.split import ByCount, BySize, ByTokens, Split, split_mode
from fnppo.core.errors import check_bool_fields, check_float, check_positive_int, input_error
from fnppo.core.losses import LossConfig, ValueLossConfig
from fnppo.core.ops.linear_logprob_graphs import BackwardGraphs
from fnppo.core.ops.logprob import logprob_and_entropy
from fnppo.megatron.forward import forward_logits
from fnppo.megatron.state import TrainState
from fnppo.steps.protocols import CriticFns, FusedHead, StepFns

__all__ = ["Batching", "StepConfig", "CriticConfig", "TrainState", "check_part"]


@dataclass(frozen=True, kw_only=True)
class Batching:
    """How a batch becomes micro-batches and updates (the fields every step config shares).

    ``split`` chooses the split, one :data:`~fnppo.core.batching.split.Split` value (``ByCount(4)``,
    ``BySize(8)``, ``ByTokens(4096)``); the flat fields ``num_microbatches``, ``microbatch_size`` and
    ``max_tokens_per_microbatch`` are sugar for it (at most one of the four; default: one
    micro-batch). :attr:`splitting` is the split in effect, the one value the step passes down.
    ``num_minibatches`` optimizer steps are taken per epoch (mini-batch ``k`` holds samples
    ``k, k + num_minibatches, ...`` of this rank's batch, which makes the mini-batches the same in
    every data-parallel layout), ``ppo_epochs`` passes over the batch per call. ``pad_to_multiple_of`` defaults to the TP size (``2*cp*tp`` under context
    parallelism, :func:`~fnppo.core.batching.sample.padding_multiple`). ``max_seq_len`` caps the length
    (prompt + response) of every sample; when None, the model's ``max_sequence_length`` is the cap.
    A longer sample is refused (:class:`~fnppo.core.errors.InputError`), never truncated.

    Raises:
        InputError: naming the class (``StepConfig``, ``CriticConfig``): a bool field holding
            anything but a bool, an unknown layout, two split modes, a size that is not an int >= 1.
    """

    layout: str = "packed"
    split: Split | None = None
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
        flat = split_mode(
            self.num_microbatches, self.microbatch_size, self.max_tokens_per_microbatch, fn=fn, required=False
        )
        if self.split is not None:
            if not isinstance(self.split, (ByCount, BySize, ByTokens)):
                raise input_error(
                    fn, "split", "a ByCount, BySize or ByTokens (fnppo.batching) or None", repr(self.split)
                )
            if flat is not None:
                raise input_error(fn, flat.flat, "None when split is given (one way in)", repr(flat.n))
        for n in ("num_minibatches", "ppo_epochs"):
            check_positive_int(fn, n, getattr(self, n))
        for n in ("pad_to_multiple_of", "max_seq_len"):
            check_positive_int(fn, n, getattr(self, n), allow_none=True)

    @property
    def splitting(self) -> Split:
        """The split in effect: ``split``, else the one the flat field builds, else ``ByCount(1)``."""
        flat = split_mode(
            self.num_microbatches, self.microbatch_size, self.max_tokens_per_microbatch, fn="", required=False
        )
        return self.split or flat or ByCount(1)

    @property
    def split_arg(self) -> str:
        """How errors name the split: the field it was given by (``num_microbatches`` by default: one micro-batch)."""
        flat = [n for n in ("microbatch_size", "max_tokens_per_microbatch") if getattr(self, n) is not None]
        return "split" if self.split is not None else (flat[0] if flat else "num_microbatches")


@dataclass(frozen=True, kw_only=True)
class StepConfig(Batching):
    """How :func:`~fnppo.steps.train.train_step` and :func:`~fnppo.steps.infer.compute_logprobs`
    turn a batch into micro-batches, log-probs and updates.

    ``loss``: the policy loss, a :class:`~fnppo.core.losses.config.LossConfig` (the step itself reads
    only its aggregation, rollout correction and bypass mode). The batching fields (``layout``, the
    split, ``pad_to_multiple_of``, ``max_seq_len``, ``num_minibatches``, ``ppo_epochs``) are
    :class:`Batching`'s.
    The fused output path is a stage value: ``fns=StepFns.fused(chunk_vocab=..., graphs=...)``
    (:meth:`~fnppo.steps.protocols.StepFns.fused`). ``fused_output``, ``fused_output_chunk_vocab``
    and ``fused_output_graphs`` are deprecated (one release): ``fused_output=True`` becomes
    ``fns=StepFns.fused(chunk_vocab=fused_output_chunk_vocab, graphs=fused_output_graphs)`` with a
    ``DeprecationWarning`` (``fns.collate`` and ``fns.loss`` are kept).

    Raises:
        InputError: a ``loss`` that is not a ``LossConfig`` (a ``ValueLossConfig``), ``fns`` that is
            not a ``StepFns`` (``"fused"``), ``fused_output`` that is not a bool (``"yes"``, ``0``), an unknown layout, two
            split modes, a size that is not an int >= 1, a temperature that is not a finite float > 0;
            the deprecated fused flags with replaced ``fns.forward``/``fns.logprob`` or another head.
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
        check_part(
            fn,
            "loss",
            self.loss,
            LossConfig,
            "a fnppo.losses.LossConfig (a ValueLossConfig is the critic's: CriticConfig)",
        )
        check_part(fn, "fns", self.fns, StepFns, "a fnppo.StepFns (e.g. StepFns() or StepFns.fused(chunk_vocab=...))")
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
        self._translate_fused_flags()

    def _translate_fused_flags(self) -> None:
        """The deprecated fused flags as ``fns=StepFns.fused(...)`` (a DeprecationWarning), once."""
        fn = "StepConfig"
        chunk, graphs = self.fused_output_chunk_vocab, self.fused_output_graphs
        if not self.fused_output:
            if chunk is not None:
                warnings.warn(_FUSED_DEPRECATED.format(chunk=chunk, graphs=None), DeprecationWarning, stacklevel=4)
            return
        head = self.fns.head
        if head is not None:  # already translated (dataclasses.replace of a translated config) or set twice
            if not (isinstance(head, FusedHead) and head.chunk_vocab == chunk and head.graphs is graphs):
                raise input_error(fn, "fused_output", "False when fns.head is set (fns=StepFns.fused(...))", "True")
            return
        if self.fns.forward is not forward_logits or self.fns.logprob is not logprob_and_entropy:
            raise input_error(
                fn,
                "fused_output",
                "False when fns.forward or fns.logprob is replaced (the fused path replaces both)",
                "True",
            )
        graphs_text = None if graphs is None else "BackwardGraphs(...)"
        warnings.warn(_FUSED_DEPRECATED.format(chunk=chunk, graphs=graphs_text), DeprecationWarning, stacklevel=4)
        fns = StepFns.fused(chunk_vocab=chunk, graphs=graphs, collate=self.fns.collate, loss=self.fns.loss)
        object.__setattr__(self, "fns", fns)


_FUSED_DEPRECATED = (
    "StepConfig(fused_output=..., fused_output_chunk_vocab=..., fused_output_graphs=...) is deprecated and will be "
    "removed in the next release; write StepConfig(fns=StepFns.fused(chunk_vocab={chunk}, graphs={graphs}))"
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
            but a bool; a ``loss`` that is not a ``ValueLossConfig``, ``fns`` that are not ``CriticFns``.
    """

    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    fns: CriticFns = field(default_factory=CriticFns)

    def __post_init__(self) -> None:
        super().__post_init__()
        fn = "CriticConfig"
        check_part(
            fn,
            "loss",
            self.loss,
            ValueLossConfig,
            "a fnppo.losses.ValueLossConfig (a LossConfig is the policy's: StepConfig)",
        )
        check_part(fn, "fns", self.fns, CriticFns, "a fnppo.CriticFns")


def check_part(fn: str, arg: str, value: object, cls: type, expected: str) -> None:
    """A config's part is an instance of its class (a string or another config is refused by name)."""
    if not isinstance(value, cls):
        shown = f"the class {value.__name__}" if isinstance(value, type) else f"{type(value).__name__} {value!r}"
        raise input_error(fn, arg, expected, shown[:160])
