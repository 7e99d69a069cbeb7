"""The steps' configurations and their persistent state, each validated once when built.

:class:`Batching` holds how a batch becomes micro-batches and updates (the fields that the policy
and the critic share) and checks them; :class:`StepConfig` (the policy) and :class:`CriticConfig`
(the critic) inherit it, so both are built with flat keyword arguments. :class:`TrainState` is what
persists between steps (defined in :mod:`fnppo.megatron.state`, where the checkpoint layer types it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fnppo.core.batching.prefix import SharedPrefix
from fnppo.core.batching.sample import LAYOUTS
from fnppo.core.batching.split import Split, split_mode
from fnppo.core.batching.splits.count import ByCount
from fnppo.core.errors import check_bool_fields, check_float, check_positive_int, input_error
from fnppo.core.losses import LossConfig, ValueLossConfig
from fnppo.megatron.state import TrainState
from fnppo.steps.protocols import CriticFns, StepFns

__all__ = ["Batching", "StepConfig", "CriticConfig", "TrainState", "check_part"]


@dataclass(frozen=True, kw_only=True)
class Batching:
    """How a batch becomes micro-batches and updates (the fields every step config shares).

    ``split`` chooses the split, one split rule (:class:`~fnppo.core.batching.splits.base.Split`:
    ``ByCount(4)``, ``BySize(8)``, ``ByTokens(4096)`` or your own); the flat fields ``num_microbatches``, ``microbatch_size`` and
    ``max_tokens_per_microbatch`` are sugar for it (at most one of the four; default: one
    micro-batch). :attr:`splitting` is the split in effect, the one value the step passes down.
    ``num_minibatches`` optimizer steps are taken per epoch (mini-batch ``k`` holds samples
    ``k, k + num_minibatches, ...`` of this rank's batch, which makes the mini-batches the same in
    every data-parallel layout), ``ppo_epochs`` passes over the batch per call. ``pad_to_multiple_of`` defaults to the TP size (``2*cp*tp`` under context
    parallelism, :func:`~fnppo.core.batching.sample.padding_multiple`). ``max_seq_len`` caps the length
    (prompt + response) of every sample; when None, the model's ``max_sequence_length`` is the cap.
    A longer sample is refused (:class:`~fnppo.core.errors.InputError`), never truncated.
    ``packing``: :class:`~fnppo.core.batching.prefix.SharedPrefix` packs every prompt group of a
    micro-batch with its prompt once (GRPO's G samples of a prompt: the prompt's activations and
    their gradient computed once, every sample's numbers those of the unshared step up to rounding;
    packed layout, local layer spec, no context parallelism, not in the batch-invariant mode; refused
    by name elsewhere); None packs every sample on its own.

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
    packing: SharedPrefix | None = None

    def __post_init__(self) -> None:
        fn = type(self).__name__
        check_bool_fields(fn, self)
        if self.layout not in LAYOUTS:
            raise input_error(fn, "layout", "'packed' or 'padded'", repr(self.layout))
        flat = split_mode(
            self.num_microbatches, self.microbatch_size, self.max_tokens_per_microbatch, fn=fn, required=False
        )
        if self.split is not None:
            if not isinstance(self.split, Split):  # the protocol: refusal, count, group, fixed_count
                raise input_error(
                    fn, "split", "a split rule (ByCount, BySize, ByTokens: fnppo.batching) or None", repr(self.split)
                )
            if flat is not None:
                raise input_error(fn, flat.flat, "None when split is given (one way in)", repr(flat.n))
        for n in ("num_minibatches", "ppo_epochs"):
            check_positive_int(fn, n, getattr(self, n))
        if self.packing is not None and not isinstance(self.packing, SharedPrefix):
            raise input_error(fn, "packing", "None or a fnppo.batching.SharedPrefix", repr(self.packing))
        if self.packing is not None and self.layout != "packed":
            raise input_error(
                fn, "layout", "'packed' with shared-prefix packing (one document per prompt group)", repr(self.layout)
            )
        for n in ("pad_to_multiple_of", "max_seq_len"):
            check_positive_int(fn, n, getattr(self, n), allow_none=True)

    def _flat(self) -> Split | None:
        """The rule a flat field builds (checked in ``__post_init__``), or None."""
        return split_mode(
            self.num_microbatches, self.microbatch_size, self.max_tokens_per_microbatch, fn="", required=False
        )

    @property
    def splitting(self) -> Split:
        """The split in effect: ``split``, else the one the flat field builds, else ``ByCount(1)``."""
        return self.split or self._flat() or ByCount(1)

    @property
    def split_arg(self) -> str:
        """How errors name the split: the field it was given by (``num_microbatches`` by default: one micro-batch)."""
        flat = self._flat()
        return "split" if self.split is not None else getattr(flat, "flat", "num_microbatches")


@dataclass(frozen=True, kw_only=True)
class StepConfig(Batching):
    """How :func:`~fnppo.steps.train.train_step` and :func:`~fnppo.steps.infer.compute_logprobs`
    turn a batch into micro-batches, log-probs and updates.

    ``loss``: the policy loss, a :class:`~fnppo.core.losses.config.LossConfig` (the step itself reads
    only its aggregation, rollout correction and bypass mode). The batching fields (``layout``, the
    split, ``pad_to_multiple_of``, ``max_seq_len``, ``num_minibatches``, ``ppo_epochs``) are
    :class:`Batching`'s.
    The fused output path is a stage value: ``fns=StepFns.fused(chunk_vocab=..., graphs=...)``
    (:meth:`~fnppo.steps.protocols.StepFns.fused`).

    Raises:
        InputError: a ``loss`` that is not a ``LossConfig`` (a ``ValueLossConfig``), ``fns`` that is
            not a ``StepFns`` (``"fused"``), an unknown layout, two split modes, a size that is not an
            int >= 1, a temperature that is not a finite float > 0.
    """

    loss: LossConfig = field(default_factory=LossConfig)
    temperature: float = 1.0
    fns: StepFns = field(default_factory=StepFns)

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
        check_float(fn, "temperature", self.temperature, low=0, low_open=True)


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
