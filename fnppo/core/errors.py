"""The error contract: the two error types, the one message format and the value checks.

Every refusal in fnppo names the function, the argument, what was expected and what was received:

    ``<function>: argument '<name>' expected <what>, received <what>``

* :class:`InputError` (a ``ValueError``): the right type and shape, an invalid value (range, NaN,
  0/1, ...); built by :func:`input_error`.
* :class:`ShapeError` (a ``TypeError``): a jaxtyping annotation is violated; raised by
  :func:`fnppo.core.typing.typechecked`.
* :func:`describe` -- the short form of a received value (``f32[2,3]`` for tensors).
* ``check_*`` -- the value checks a type annotation cannot say, one function each.

Plain torch; nothing here imports any other fnppo module.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = [
    "InputError",
    "ShapeError",
    "CheckpointError",
    "input_error",
    "checkpoint_error",
    "describe",
    "check_mask01",
    "check_finite",
    "check_range",
    "check_bool_fields",
    "check_positive_int",
    "check_number",
    "check_int",
    "check_float",
    "check_bool",
]


class ShapeError(TypeError):
    """An argument or return value does not match its jaxtyping annotation.

    The message names the function, the argument, the expected type (with the dimension sizes
    bound so far) and the received value.
    """


class InputError(ValueError):
    """An argument has the right type and shape but an invalid value (range, NaN, 0/1, ...)."""


def describe(t: Any) -> str:
    """Short description of a value for error messages: ``f32[2,3]`` for tensors."""
    if isinstance(t, torch.Tensor):
        dt = {
            torch.float32: "f32",
            torch.float64: "f64",
            torch.bfloat16: "bf16",
            torch.float16: "f16",
            torch.int64: "i64",
            torch.int32: "i32",
            torch.bool: "bool",
            torch.uint8: "u8",
        }.get(t.dtype, str(t.dtype).replace("torch.", ""))
        return f"{dt}[{','.join(str(s) for s in t.shape)}]"
    return repr(t)


def input_error(fn: str, arg: str, expected: str, received: str) -> InputError:
    """Build the standard error: function, argument, what was expected, what was received."""
    return InputError(f"{fn}: argument '{arg}' expected {expected}, received {received}")


class CheckpointError(RuntimeError):
    """A checkpoint or a file to be written is missing, incomplete, corrupt, unwritable, or does not fit
    the current run. Its message has the one format of every refusal: ``<function>: argument
    '<argument>' expected <what>, received <what>``."""


def checkpoint_error(fn: str, arg: str, expected: str, received: str) -> CheckpointError:
    """The standard message (:func:`input_error`'s) as a :class:`CheckpointError`."""
    return CheckpointError(str(input_error(fn, arg, expected, received)))


def check_mask01(fn: str, arg: str, mask: torch.Tensor) -> None:
    """Raise unless every entry of ``mask`` is 0 or 1."""
    if mask.dtype == torch.bool or mask.numel() == 0:
        return
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        value = mask[bad].flatten()[0].item()
        raise input_error(fn, arg, "a 0/1 mask", f"{describe(mask)} containing {value!r}")


def check_finite(fn: str, arg: str, t: torch.Tensor | None, where: torch.Tensor | None = None) -> None:
    """Raise if ``t`` has NaN or inf (only at positions where ``where`` is non-zero, if given)."""
    if t is None or t.numel() == 0 or not t.is_floating_point():
        return
    bad = ~torch.isfinite(t)
    if where is not None:
        bad = bad & (where != 0)
    if bool(bad.any()):
        n = int(bad.sum().item())
        raise input_error(fn, arg, "finite values", f"{describe(t)} with {n} NaN/inf entries")


def check_range(fn: str, arg: str, t: torch.Tensor, low: int, high: int) -> None:
    """Raise unless ``low <= t < high`` everywhere (integer tensors, e.g. token ids)."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min().item()), int(t.max().item())
    if lo < low or hi >= high:
        raise input_error(fn, arg, f"values in [{low}, {high})", f"{describe(t)} with values in [{lo}, {hi}]")


def check_bool_fields(fn: str, config: Any) -> None:
    """Raise unless every field of the dataclass ``config`` annotated ``bool`` (or ``bool | None``)
    holds a real ``bool`` (``None`` where allowed): ``"yes"``, ``0`` or ``1`` are refused, never
    stored as given and read as truthy later."""
    for f in dataclasses.fields(config):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", repr(f.type))
        kind = kind.replace(" ", "")
        if kind not in ("bool", "bool|None", "None|bool", "Optional[bool]"):
            continue
        value = getattr(config, f.name)
        if value is None and kind != "bool":
            continue
        if not isinstance(value, bool):
            expected = "a bool" if kind == "bool" else "a bool or None"
            raise input_error(fn, f.name, expected, f"{value!r} ({type(value).__name__})")


def check_positive_int(fn: str, name: str, v: Any, allow_none: bool = False) -> None:
    """``v`` is an int >= 1 (not a bool), or None when ``allow_none`` (:func:`check_int` with ``low=1``).

    Raises:
        InputError: ``"<fn>: argument '<name>' expected an int >= 1 [or None], received <v>"``.
    """
    check_int(fn, name, v, low=1, allow_none=allow_none)


def _received(v: Any) -> str:
    plain = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
    return repr(v) if plain else f"{v!r} ({type(v).__name__})"


def check_number(
    fn: str,
    name: str,
    v: Any,
    *,
    integer: bool = False,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
    also: str = "",
) -> None:
    """The one number guard: ``v`` is a real number (an ``int`` when ``integer``) in the given range.

    Refused, each by name: a bool (``True`` is no count, no rate), a string (``"3"``, ``"abc"``),
    any non-number (``None`` unless ``allow_none``, lists, tensors), NaN and +-inf, a float where an
    int is expected (``2.0`` included), and a value outside ``[low, high]`` (``(low`` / ``high)``
    with ``low_open`` / ``high_open``; either bound may be None). ``also``: words appended to the
    expected text (e.g. ``" (the vocabulary size)"``).

    Raises:
        InputError: ``"<fn>: argument '<name>' expected an int >= 1 [or None], received 'abc' (str)"``.
    """
    if allow_none and v is None:
        return
    words = ["an int" if integer else "a finite number"]
    if low is not None:
        words.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        words.append(("and " if low is not None else "") + f"{'<' if high_open else '<='} {high}")
    expected = " ".join(words) + (" or None" if allow_none else "") + also
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise input_error(fn, name, expected, _received(v))
    if integer and not isinstance(v, int):
        raise input_error(fn, name, expected, _received(v))
    if isinstance(v, float) and not math.isfinite(v):
        raise input_error(fn, name, expected, _received(v))
    too_low = low is not None and (v <= low if low_open else v < low)
    too_high = high is not None and (v >= high if high_open else v > high)
    if too_low or too_high:
        raise input_error(fn, name, expected, _received(v))


def check_int(
    fn: str, name: str, v: Any, *, low: int | None = None, high: int | None = None, allow_none: bool = False
) -> None:
    """:func:`check_number` for an ``int`` in ``[low, high]`` (not a bool, not a float, not a str)."""
    check_number(fn, name, v, integer=True, low=low, high=high, allow_none=allow_none)


def check_float(
    fn: str,
    name: str,
    v: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
) -> None:
    """:func:`check_number` for a finite real number (an int is fine) in the given range."""
    check_number(fn, name, v, low=low, high=high, low_open=low_open, high_open=high_open, allow_none=allow_none)


def check_bool(fn: str, name: str, v: Any, *, allow_none: bool = False) -> None:
    """``v`` is a real ``bool`` (``"yes"``, ``0``, ``1`` refused), or None when ``allow_none``."""
    if (allow_none and v is None) or isinstance(v, bool):
        return
    raise input_error(fn, name, "a bool" + (" or None" if allow_none else ""), _received(v))
