"""Typed tensors: jaxtyping aliases and the call-time checker used by every public function.

Every public tensor function in fnppo is decorated with :func:`typechecked`. At call time the
jaxtyping annotations are checked by beartype: rank, named dimensions (consistent across all
arguments of one call) and dtype. A violation raises :class:`ShapeError`, whose message names the
function, the argument, the expected type and the received value (dtype and shape). The error
types and the value checks a type cannot say live in :mod:`fnppo.core.errors`.

Checking is on by default. Turn it off for production runs, where the shapes are known to be right
and the few microseconds per call matter, with either

* the environment variable ``FNPPO_TYPECHECK=0`` (read at import), or
* ``fnppo.core.typing.set_typechecking(False)`` / the context manager ``fnppo.core.typing.typechecking(False)``.

``benchmarks/typecheck_overhead.py`` prints the overhead per call.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import typing
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from beartype import beartype
from beartype.roar import BeartypeCallHintViolation
from jaxtyping import Bool, Float, Float32, Int, Int32, Integer, Shaped, TypeCheckError, jaxtyped

from fnppo.core.errors import ShapeError, describe

__all__ = [
    "ShapeError",
    "typechecked",
    "set_typechecking",
    "typechecking",
    "typechecking_enabled",
    "Tensor",
    "TokenIds",
    "TokenMask",
    "TokenFloat",
    "TokenLogProbs",
    "VocabLogits",
    "PaddedIds",
    "PaddedMask",
    "PaddedFloat",
    "CuSeqlens",
    "Scalar",
]

Tensor = torch.Tensor

# ---------------------------------------------------------------------------------------------
# Aliases. "*tok" is any number of leading token dimensions: [batch, seq] for the padded layout,
# [1, total] for the packed (THD) layout, [tokens] for flat tensors. Within one call every
# argument annotated with "*tok" must have the same leading shape.
# ---------------------------------------------------------------------------------------------
TokenIds = Integer[Tensor, "*tok"]
"""Token ids (any integer dtype), one per token position."""
TokenMask = Shaped[Tensor, "*tok"]
"""A per-token 0/1 mask (bool, integer or floating); values are validated where used."""
TokenFloat = Float[Tensor, "*tok"]
"""A floating value per token (advantages, log-probs in any float dtype)."""
TokenLogProbs = Float32[Tensor, "*tok"]
"""fp32 per-token log-probabilities."""
VocabLogits = Float[Tensor, "*tok vocab_shard"]
"""Vocab-parallel logits: each tensor-parallel rank holds a contiguous shard of the vocabulary."""
PaddedIds = Int[Tensor, "batch seq"]
"""Token ids in the padded layout ``[batch, seq]`` (packed: ``[1, total]``)."""
PaddedMask = Shaped[Tensor, "batch seq"]
"""A 0/1 mask in the padded layout."""
PaddedFloat = Float[Tensor, "batch seq"]
"""A floating value per token in the padded layout."""
CuSeqlens = Int32[Tensor, "nseq_plus_1"]
"""Cumulative sequence lengths of a packed (THD) batch: ``[0, l0, l0+l1, ...]``, int32."""
Scalar = Float[Tensor, ""]
"""A 0-dim floating tensor."""

# Re-exported so that modules write ``from fnppo.core.typing import Float, Int, ...``.
__all__ += ["Bool", "Float", "Float32", "Int", "Int32", "Integer", "Shaped"]


def _env_default() -> bool:
    return os.environ.get("FNPPO_TYPECHECK", "1").strip().lower() not in ("0", "false", "off", "no")


class _Switch:
    """The one process-wide switch (a documented configuration knob, like ``jax.config``)."""

    __slots__ = ("enabled",)

    def __init__(self) -> None:
        self.enabled = _env_default()


_SWITCH = _Switch()


def set_typechecking(enabled: bool) -> bool:
    """Turn call-time shape/dtype checking on or off; returns the previous setting."""
    previous = _SWITCH.enabled
    _SWITCH.enabled = bool(enabled)
    return previous


def typechecking_enabled() -> bool:
    """Whether call-time checking is on."""
    return _SWITCH.enabled


@contextlib.contextmanager
def typechecking(enabled: bool) -> Iterator[None]:
    """Context manager: ``with typechecking(False): ...`` runs the block unchecked."""
    previous = set_typechecking(enabled)
    try:
        yield
    finally:
        set_typechecking(previous)


F = TypeVar("F", bound=Callable[..., Any])


def typechecked(fn: F) -> F:
    """Check ``fn``'s jaxtyping annotations with beartype on every call (while enabled).

    Errors are raised as :class:`ShapeError` (a ``TypeError``) naming the function, the argument,
    the expected type and the received value.
    """
    checked = jaxtyped(typechecker=beartype)(fn)
    name = f"{fn.__module__}.{fn.__qualname__}"

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _SWITCH.enabled:
            return fn(*args, **kwargs)
        try:
            return checked(*args, **kwargs)
        except ShapeError:
            raise
        except Exception as err:  # jaxtyping.TypeCheckError / beartype violations
            if _is_type_violation(err):
                raise ShapeError(_shape_message(name, fn, args, kwargs, err)) from None
            raise

    wrapper.__wrapped_unchecked__ = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


FULL_REPORT_ENV = "FNPPO_FULL_TYPE_ERRORS"
"""Set to 1 to append the checker's full report (every argument and annotation) to a ShapeError."""


def _shape_message(name: str, fn: Callable[..., Any], args: tuple, kwargs: dict, err: BaseException) -> str:
    """First line: the mismatch in words (which dimension, which arguments, both sizes); then the
    checker's full report if ``FNPPO_FULL_TYPE_ERRORS=1``, else a one-line hint how to get it."""
    try:
        first = _diagnose(fn, args, kwargs)
    except Exception:  # the diagnosis is a convenience: never hide the original error
        first = None
    if first is None:
        first = _summarize_report(str(err))
    if os.environ.get(FULL_REPORT_ENV, "0").strip().lower() in ("1", "true", "on", "yes"):
        return f"{name}: {first}\n{err}"
    return f"{name}: {first}\n(set {FULL_REPORT_ENV}=1 for the full type-check report)"


def _summarize_report(report: str) -> str:
    """One line from jaxtyping's report: ``argument 'x' expected <type>, received <value>``."""
    arg = re.search(r"typechecking parameter '([^']+)'", report)
    got = re.search(r"Actual value: (.+)", report)
    want = re.search(r"Expected type: <class '(.+)'>\.?$|Expected type: (.+?)\.?$", report, re.MULTILINE)
    if arg and got and want:
        expected = (want.group(1) or want.group(2)).replace("jaxtyping.", "")
        received = got.group(1).strip().removesuffix("(torch)")
        return f"argument '{arg.group(1)}' expected {expected}, received {received}"
    lines = [ln for ln in report.strip().splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else "type check failed"


def _array_annotation(hint: Any) -> Any:
    """The jaxtyping array type inside ``hint`` (``X`` or ``X | None``), else None (also for a union
    of several array types, which the summary of the checker's report describes instead)."""
    if hasattr(hint, "dim_str") and hasattr(hint, "dims"):
        return hint
    members = [m for m in getattr(hint, "__args__", ()) or () if hasattr(m, "dim_str") and hasattr(m, "dims")]
    return members[0] if len(members) == 1 else None


def _split_dims(dims: tuple, shape: tuple[int, ...]) -> list[tuple[str, Any]] | str:
    """Pair each named dimension with its size(s) in ``shape``; a string describes a rank mismatch."""
    kinds = [type(d).__name__ for d in dims]
    n_var = sum(k in ("_NamedVariadicDim", "_AnonymousVariadicDim") for k in kinds)
    fixed = len(dims) - n_var
    if (n_var == 0 and len(shape) != fixed) or len(shape) < fixed:
        return f"{len(shape)} dimension(s), expected {'at least ' if n_var else ''}{fixed}"
    out: list[tuple[str, Any]] = []
    i = 0
    for d, kind in zip(dims, kinds, strict=True):
        if kind in ("_NamedVariadicDim", "_AnonymousVariadicDim"):
            take = len(shape) - fixed
            if kind == "_NamedVariadicDim":
                out.append(("*" + d.name, tuple(shape[i : i + take])))
            i += take
        else:
            if kind == "_NamedDim":
                out.append((d.name, shape[i]))
            elif kind == "_FixedDim" and d.size != shape[i]:
                return f"size {shape[i]} at dimension {i}, expected {d.size}"
            i += 1
    return out


def _shape_str(t: torch.Tensor) -> str:
    return "[" + ",".join(str(int(n)) for n in t.shape) + "]"


def _diagnose(fn: Callable[..., Any], args: tuple, kwargs: dict) -> str | None:
    """Walk the tensor arguments in order, binding named dimensions; describe the first conflict."""
    hints = typing.get_type_hints(fn)
    bound = inspect.signature(fn).bind(*args, **kwargs)
    seen: dict[str, tuple[Any, str, torch.Tensor]] = {}  # dim -> (size, argument, tensor)
    for arg, value in bound.arguments.items():
        if not isinstance(value, torch.Tensor):
            continue
        ann = _array_annotation(hints.get(arg))
        if ann is None:
            if hasattr(hints.get(arg), "__args__"):
                return None  # a union of array types: dimensions cannot be bound unambiguously
            continue
        optional = type(None) in (getattr(hints.get(arg), "__args__", ()) or ())
        expected = f"{getattr(ann, '__name__', ann.dim_str)}{' | None' if optional else ''}"
        tail = f"; expected {expected}, received {describe(value)}"
        pairs = _split_dims(ann.dims, tuple(value.shape))
        if isinstance(pairs, str):
            return f"argument '{arg}' has {pairs} for dims '{ann.dim_str}' (shape {_shape_str(value)}){tail}"
        for dim, size in pairs:
            if dim in seen and seen[dim][0] != size:
                prev_size, prev_arg, prev = seen[dim]
                return (
                    f"argument '{arg}' has {dim}={_size_str(size)}, "
                    f"but '{prev_arg}' bound {dim}={_size_str(prev_size)} "
                    f"(shapes {_shape_str(value)} vs {_shape_str(prev)}){tail}"
                )
            seen.setdefault(dim, (size, arg, value))
        dtypes = getattr(ann, "dtypes", None)
        if isinstance(dtypes, (list, tuple)) and str(value.dtype).replace("torch.", "") not in dtypes:
            return f"argument '{arg}' has the wrong dtype{tail}"
    return None


def _size_str(size: Any) -> str:
    return "[" + ",".join(str(n) for n in size) + "]" if isinstance(size, tuple) else str(size)


def _is_type_violation(err: BaseException) -> bool:
    return isinstance(err, (TypeCheckError, BeartypeCallHintViolation))
