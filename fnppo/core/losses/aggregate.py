"""Aggregation of per-token losses into one scalar, split-invariantly (pure torch).

* :data:`LOSS_AGG_MODES` and :class:`Aggregation` -- the mode (and Dr. GRPO's constant ``C``).
* :func:`loss_normalizer` -- the local denominator of a micro-batch, to be summed over the step.
* :func:`agg_weights` / :func:`denominator` -- ``loss = sum(l * w) / N`` for the losses.
* :class:`Tokens` -- the valid tokens of one loss call in the compute dtype (inputs cleaned to 0
  off the mask, so NaN/inf there can never leak).

With ``normalizer=N`` (the denominator of the whole step: the sum of :func:`loss_normalizer` over
all micro-batches and data-parallel ranks), every micro-batch loss is ``numerator_i / N``, so the sum
of the micro-batch losses is exactly the full-batch loss, whatever the split (sequences are never
split across micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from fnppo.core.losses.checks import Checker, finite_number
from fnppo.core.segments import Segments, segments
from fnppo.core.typing import Integer, PaddedMask, Scalar, Tensor, typechecked

__all__ = [
    "LOSS_AGG_MODES",
    "Aggregation",
    "HasAggregation",
    "loss_normalizer",
    "agg_weights",
    "denominator",
    "Tokens",
    "check_agg",
    "mode_and_scale",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""The aggregation modes (see :class:`Aggregation`)."""


def check_agg(c: Checker, *, stray_scale_ok: bool = False) -> None:
    """``mode`` is one of :data:`LOSS_AGG_MODES` and ``scale`` fits it (the one home of this rule).

    ``seq-mean-token-sum-norm`` needs a constant ``scale > 0``; the other modes take ``None``
    (``stray_scale_ok``: a scale given with another mode is ignored instead of refused).
    """
    mode, scale = c.get("mode"), c.get("scale")
    c.need(isinstance(mode, str) and mode in LOSS_AGG_MODES, "mode", f"one of {list(LOSS_AGG_MODES)}")
    if mode == "seq-mean-token-sum-norm":
        c.need(
            finite_number(scale) and scale > 0,
            "scale",
            "a number > 0 (the constant C of 'seq-mean-token-sum-norm', e.g. the max response length)",
        )
    else:
        c.need(scale is None or stray_scale_ok, "scale", f"None unless {c.label('mode')}='seq-mean-token-sum-norm'")


@dataclass(frozen=True)
class Aggregation:
    """How per-token losses ``l_t`` become one scalar ``sum_t a_t l_t / N``.

    Over valid tokens (``loss_mask == 1``) and sequences i (rows, or ``seq_ids`` groups):

    * ``token-mean``: ``a_t = 1``, ``N`` = number of valid tokens (DAPO, arXiv:2503.14476);
    * ``seq-mean-token-sum``: ``a_t = 1``, ``N`` = number of valid sequences;
    * ``seq-mean-token-mean``: ``a_t = 1 / |i|`` (valid tokens of t's sequence), ``N`` = number of
      valid sequences (GRPO, arXiv:2402.03300);
    * ``seq-mean-token-sum-norm``: ``a_t = 1 / C`` with the constant ``C = scale``, ``N`` = number
      of valid sequences (Dr. GRPO, arXiv:2503.20783).

    Attributes:
        mode: one of :data:`LOSS_AGG_MODES`.
        scale: the constant ``C`` of ``seq-mean-token-sum-norm`` (e.g. the maximum response length):
            required for that mode, ``None`` otherwise. Being a constant, it keeps the loss
            split-invariant.

    Raises:
        InputError: ``fnppo.losses.Aggregation: argument 'mode' / 'scale' ...``.
    """

    mode: str = "token-mean"
    scale: float | None = None

    def __post_init__(self) -> None:
        check_agg(Checker.of(self, "fnppo.losses.Aggregation"))


@runtime_checkable
class HasAggregation(Protocol):
    """A config holding an :class:`Aggregation` as ``agg`` (``LossConfig``, ``ValueLossConfig``)."""

    agg: Aggregation


def agg_weights(mf: Tensor, seg: Segments, mode: str, scale: float | None) -> tuple[Tensor, Tensor]:
    """Per-token aggregation weights ``w`` and the local denominator, so that
    ``loss = sum(l * w) / denominator`` (denominator summed over micro-batches when split)."""
    if mode == "token-mean":
        return mf, mf.sum()
    count = seg.sum(mf)
    n_seq = (count > 0).to(mf.dtype).sum()
    if mode == "seq-mean-token-sum":
        return mf, n_seq
    if mode == "seq-mean-token-mean":
        inv = 1.0 / torch.where(count > 0, count, torch.ones_like(count))
        return mf * seg.gather(inv, mf), n_seq
    return mf / scale, n_seq  # seq-mean-token-sum-norm (modes are checked where they enter)


def denominator(normalizer: float | int | Tensor | None, local: Tensor) -> Tensor | float:
    """The divisor: ``normalizer`` (or the local count), with 0 replaced by 1 (no host sync)."""
    if normalizer is None:
        n = local
    elif isinstance(normalizer, Tensor):
        n = normalizer.to(device=local.device, dtype=local.dtype)
    else:
        return float(normalizer) if normalizer > 0 else 1.0
    return torch.where(n > 0, n, torch.ones_like(n))


def mode_and_scale(
    fn: str, agg: Aggregation | str | HasAggregation, scale: float | None = None, label: dict[str, str] | None = None
) -> tuple[str, float | None]:
    """``(mode, scale)`` of an :class:`Aggregation` (validated when built), of a config holding one, or
    of a checked mode name (a stray ``scale`` with another mode is ignored); ``label`` names the two
    in errors (default ``loss_agg_mode`` / ``loss_scale_factor``)."""
    if isinstance(agg, HasAggregation) and not isinstance(agg, Aggregation):
        agg = agg.agg
    if isinstance(agg, Aggregation):
        return agg.mode, agg.scale
    names = label or {"mode": "loss_agg_mode", "scale": "loss_scale_factor"}
    check_agg(Checker(fn, {"mode": agg, "scale": scale}.__getitem__, names.__getitem__), stray_scale_ok=True)
    return agg, scale


@typechecked
def loss_normalizer(
    loss_mask: PaddedMask,
    agg: Aggregation | str | HasAggregation,
    *,
    seq_ids: Integer[Tensor, "batch seq"] | None = None,
) -> Scalar:
    """The local denominator of the aggregation for one micro-batch (0-dim fp32).

    ``token-mean``: the number of valid tokens (``loss_mask == 1``); the ``seq-mean-*`` modes: the
    number of valid sequences (sequences with at least one valid token). Sum it over all
    micro-batches and data-parallel ranks of the step and pass the sum as ``normalizer`` to
    :func:`fnppo.core.losses.ppo.ppo_loss` / :func:`fnppo.core.losses.value.value_loss`, which makes
    the sum of micro-batch losses the full-batch loss (see :class:`Aggregation` for the modes and
    their papers).

    Args:
        loss_mask: ``[batch, seq]`` 0/1 mask.
        agg: an :class:`Aggregation`, a config holding one as ``agg`` (``LossConfig``,
            ``ValueLossConfig``) or a mode name of :data:`LOSS_AGG_MODES`.
        seq_ids: packed layout: per-token sequence index, -1 for no sequence.

    Returns:
        The 0-dim fp32 count.

    Raises:
        InputError: an unknown mode name (named ``loss_agg_mode``).
    """
    mode, scale = mode_and_scale("fnppo.losses.loss_normalizer", agg, 1.0)
    mf = (loss_mask != 0).float()
    return agg_weights(mf, segments(loss_mask.shape, seq_ids), mode, scale)[1].float()


class Tokens(NamedTuple):
    """The valid tokens of one loss call: masks in the compute dtype and the sequence grouping.

    The compute dtype is fp32, or fp64 when the inputs are fp64 (``promote_types(dtype, fp32)``).
    """

    m: Tensor  # bool, True on valid tokens
    mf: Tensor  # the same as 0/1 in the compute dtype
    zero: Tensor  # 0-dim zero in the compute dtype
    seg: Segments

    @classmethod
    def of(cls, like: Tensor, mask: Tensor, seq_ids: Tensor | None) -> Tokens:
        dtype = torch.promote_types(like.dtype, torch.float32)
        m = mask != 0
        return cls(m, m.to(dtype), torch.zeros((), dtype=dtype, device=like.device), segments(mask.shape, seq_ids))

    def clean(self, t: Tensor, detach: bool) -> Tensor:
        """``t`` in the compute dtype, 0 wherever the mask is 0 (so NaN/inf there cannot leak)."""
        t = t.detach() if detach else t
        return torch.where(self.m, t.to(self.zero.dtype), self.zero)
