"""The checks shared by the losses and the rollout correction (pure torch, no Megatron).

* :class:`Checker` -- one rule for a group of settings, written once and read under several
  namings: the fields of a part (``fnppo.losses.ppo_clip``'s ``clip_low``), the flat names of
  :func:`fnppo.core.losses.flat.from_flat` (``clip_ratio_low``) or the arguments of
  :func:`fnppo.core.losses.rollout_weights.compute_tis_weights` (``cap``). Every refusal uses the one
  error contract ``input_error(fn, arg, expected, received)``.
* :func:`finite_number` -- the number test of every setting (finite, not a bool).
* :func:`check_non_empty` -- an empty ``[batch, seq]`` tensor has no loss.
* :func:`validate_inputs` -- the tensor checks of one loss call (mask 0/1, no NaN/inf at trained
  positions, sequence ids in range, scalars finite and >= 0) for one device-to-host sync.

Below the losses package and the rollout correction, which both use it (so neither imports the
other's checks and no import cycle forms).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fnppo.core.errors import check_finite, check_mask01, describe, input_error
from fnppo.core.typing import Tensor

__all__ = ["Checker", "finite_number", "describe_value", "check_non_empty", "validate_inputs"]


def finite_number(x: Any) -> bool:
    """A finite ``int`` or ``float`` (a bool is not a number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def describe_value(x: Any) -> str:
    """How an error message shows a received scalar: a tensor by dtype and shape, else ``repr``."""
    return describe(x) if isinstance(x, Tensor) else repr(x)


def _same(name: str) -> str:
    return name


class Checker(NamedTuple):
    """Reads settings by their rule names and refuses one naming it as the caller knows it.

    Attributes:
        fn: the function (or config) named in the error, e.g. ``"fnppo.losses.cispo"``.
        get: the value of a setting from its rule name.
        label: the name shown in the error for a rule name (default: the rule name itself).
    """

    fn: str
    get: Callable[[str], Any]
    label: Callable[[str], str] = _same

    @classmethod
    def of(cls, obj: Any, fn: str) -> Checker:
        """The checker of a config object: settings are its attributes, ``"a.b"`` a nested one."""

        def get(path: str) -> Any:
            value = obj
            for part in path.split("."):
                value = getattr(value, part)
            return value

        return cls(fn, get)

    def need(self, ok: bool, arg: str, expected: str) -> None:
        """Raise ``InputError`` naming ``arg`` (its label) and its value unless ``ok``."""
        if not ok:
            raise input_error(self.fn, self.label(arg), expected, repr(self.get(arg)))

    def number(
        self,
        arg: str,
        low: float | None = None,
        *,
        strict: bool = False,
        high: float | None = None,
        expected: str | None = None,
    ) -> None:
        """``arg`` is a finite number ``>= low`` (``> low`` when ``strict``) and ``<= high`` where given."""
        v = self.get(arg)
        ok = finite_number(v) and (low is None or (v > low if strict else v >= low)) and (high is None or v <= high)
        if expected is None:
            expected = "a finite number" if low is None else f"a finite number {'>' if strict else '>='} {low:g}"
        self.need(ok, arg, expected)


def check_non_empty(fn: str, arg: str, t: Tensor) -> None:
    """An empty ``[batch, seq]`` tensor has no loss: refuse it (the one home of this check)."""
    if t.numel() == 0:
        raise input_error(fn, arg, "a non-empty [batch, seq] tensor (an empty batch has no loss)", describe(t))


def validate_inputs(
    fn: str,
    mask: Tensor,
    finite: dict[str, Tensor | None],
    normalizer: Any,
    seq_ids: Tensor | None,
    mask_name: str = "loss_mask",
    *,
    tis_mean: Any = None,
) -> None:
    """The tensor checks of one loss call, at the cost of one device-to-host sync.

    ``mask`` is 0/1; every tensor of ``finite`` is finite wherever the mask is 1 (other positions are
    never read); ``normalizer`` and ``tis_mean`` (when given) are finite and ``>= 0``; ``seq_ids`` lie
    in ``[-1, numel)`` and are ``>= 0`` wherever the mask is 1. Only when a flag is raised are the
    inputs searched for the culprit (slow path, several syncs).

    Raises:
        InputError: naming the first argument that breaks its rule.
    """
    m = mask != 0
    scalars = {name: v for name, v in (("normalizer", normalizer), ("tis_mean", tis_mean)) if v is not None}
    flags = []
    if mask.dtype != torch.bool:
        flags.append(((mask != 0) & (mask != 1)).any())
    for t in finite.values():
        if t is not None and t.is_floating_point():
            flags.append((~torch.isfinite(t) & m).any())
    for name, v in scalars.items():
        if isinstance(v, Tensor):
            flags.append(~torch.isfinite(v) | (v < 0))
        elif not (math.isfinite(v) and v >= 0):
            raise input_error(fn, name, "a finite number >= 0", repr(v))
    if seq_ids is not None:
        flags.append(((seq_ids < -1) | (seq_ids >= seq_ids.numel()) | ((seq_ids < 0) & m)).any())
    if not flags or not bool(torch.stack([f.reshape(()) for f in flags]).any()):
        return
    # Something is wrong: find it (slow path, may sync several times).
    check_mask01(fn, mask_name, mask)
    for name, t in finite.items():
        check_finite(fn, name, t, where=mask)
    for name, v in scalars.items():
        if isinstance(v, Tensor) and not bool(torch.isfinite(v) & (v >= 0)):
            raise input_error(fn, name, "a finite number >= 0", f"{describe(v)} = {v.item()!r}")
    if seq_ids is not None:
        lo, hi = int(seq_ids.min()), int(seq_ids.max())
        raise input_error(
            fn,
            "seq_ids",
            f"values in [-1, {seq_ids.numel()}) and >= 0 wherever {mask_name} is 1",
            f"{describe(seq_ids)} with values in [{lo}, {hi}]",
        )
