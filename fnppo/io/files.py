"""Reading the files checkpoints and adapters are made of: JSON (a checkpoint's ``manifest.json``, a
Hugging Face ``config.json`` and ``model.safetensors.index.json``, PEFT's ``adapter_config.json``) and
safetensors (headers, metadata, tensors).

Every reader of such a file goes through these helpers, so a file that cannot be read or parsed
(no permission, truncated by a killed copy, corrupt, not UTF-8, not JSON, not safetensors) is one
:class:`~fnppo.core.errors.CheckpointError` in the standard format, naming the file and the cause
(``<fn>: argument '<arg>' expected <what>, received '<path>', which is not valid JSON (truncated or
corrupt: Expecting ',' delimiter: line 3 column 1 (char 17))``), never a raw ``JSONDecodeError``,
``SafetensorError`` or ``AttributeError``. What the parsed contents mean is each reader's own check.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fnppo.core.errors import checkpoint_error

__all__ = ["read_json", "read_json_object", "json_kind", "open_safetensors", "load_safetensors"]


def json_kind(value: Any) -> str:
    """How JSON names the type of a parsed value: object, array, string, number, boolean, null."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


def _unreadable(fn: str, arg: str, expected: str, path: Path, err: OSError) -> Exception:
    why = err.strerror or str(err)
    return checkpoint_error(fn, arg, expected, f"{str(path)!r}, which cannot be read ({type(err).__name__}: {why})")


def read_json(fn: str, arg: str, path: str | os.PathLike, expected: str | None = None) -> Any:
    """The JSON value in the file ``path``.

    Raises:
        CheckpointError: the file cannot be read (missing, a directory, no permission), is empty, is
            not UTF-8 text or not JSON (truncated, corrupt), naming ``path`` and the cause.
    """
    path = Path(path)
    expected = expected or f"a readable JSON file ({path.name})"
    try:
        data = path.read_bytes()
    except OSError as err:
        raise _unreadable(fn, arg, expected, path, err) from None
    if not data.strip():
        raise checkpoint_error(fn, arg, expected, f"{str(path)!r}, which is not valid JSON (an empty file)")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise checkpoint_error(
            fn, arg, expected, f"{str(path)!r}, which is not valid JSON (not UTF-8 text: {err})"
        ) from None
    except json.JSONDecodeError as err:
        raise checkpoint_error(
            fn, arg, expected, f"{str(path)!r}, which is not valid JSON (truncated or corrupt: {err})"
        ) from None
    except RecursionError:
        raise checkpoint_error(
            fn, arg, expected, f"{str(path)!r}, which is not valid JSON (nested too deeply)"
        ) from None


def read_json_object(fn: str, arg: str, path: str | os.PathLike, expected: str | None = None) -> dict[str, Any]:
    """The JSON object (a dict) in the file ``path``: :func:`read_json`, and a value of another JSON
    type (an array, a string, ...) refused the same way."""
    path = Path(path)
    expected = expected or f"a JSON object in {path.name}"
    value = read_json(fn, arg, path, expected)
    if not isinstance(value, dict):
        raise checkpoint_error(fn, arg, expected, f"{str(path)!r}, which holds a JSON {json_kind(value)}")
    return value


def _safetensors_problem(fn: str, arg: str, path: Path, err: Exception) -> Exception:
    expected = f"a readable safetensors file ({path.name})"
    if isinstance(err, OSError):
        return _unreadable(fn, arg, expected, path, err)
    return checkpoint_error(
        fn, arg, expected, f"{str(path)!r}, which is not a whole safetensors file (truncated or corrupt: {err})"
    )


@contextlib.contextmanager
def open_safetensors(fn: str, arg: str, path: str | os.PathLike) -> Iterator[Any]:
    """``safetensors.safe_open(path)`` (PyTorch tensors on the CPU) for the ``with`` body; its header is
    read and checked when it opens.

    Raises:
        CheckpointError: the file cannot be read, or its header is not a whole safetensors header
            (truncated, corrupt, not safetensors), naming ``path`` and the cause.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as err:
        raise _safetensors_problem(fn, arg, path, err) from None
    with handle:
        yield handle


def load_safetensors(fn: str, arg: str, path: str | os.PathLike) -> dict[str, Any]:
    """Every tensor of the safetensors file ``path`` (``safetensors.torch.load_file``), refused as
    :func:`open_safetensors` refuses."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise _safetensors_problem(fn, arg, path, err) from None
