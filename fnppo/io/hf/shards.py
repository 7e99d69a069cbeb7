"""Reading a Hugging Face safetensors checkpoint: its files (one ``model.safetensors``, or the shards
of ``model.safetensors.index.json``), the names, shapes and dtypes of its tensors from the headers
alone, and slices of one tensor at a time (``safe_open(...).get_slice``), so host memory never holds
more than one parameter beyond the model itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from fnppo.core.errors import checkpoint_error, input_error
from fnppo.core.typing import Tensor
from fnppo.io.files import open_safetensors, read_json_object

FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

Reader = Callable[[str, "tuple[slice, ...] | None"], Tensor]
"""``read(name, index)``: the stored tensor ``name``, whole (``index=None``) or the slice ``index``."""


def shard_files(fn: str, path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``path`` itself (a file), the shards its index lists, or
    its ``model.safetensors``."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise input_error(fn, "path", "a local checkpoint directory or a .safetensors file", repr(str(path)))
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(fn, "path", index).get("weight_map", {})
        if not (isinstance(weight_map, dict) and all(isinstance(f, str) and f for f in weight_map.values())):
            raise checkpoint_error(
                fn,
                "path",
                f"a 'weight_map' of tensor names to shard files in {INDEX_FILE}",
                f"{str(index)!r}, whose 'weight_map' is {json.dumps(weight_map)[:60]}",
            )
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (path / f).is_file():
                raise input_error(fn, "path", f"the shard {f!r} listed in {INDEX_FILE}", "no such file")
        return [path / f for f in files]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise input_error(fn, "path", f"a directory holding {SINGLE_FILE} or {INDEX_FILE}", f"{str(path)!r} without them")


def open_shards(fn: str, files: Sequence[Path], stack: ExitStack) -> tuple[dict[str, tuple[int, ...]], Reader]:
    """Open every shard (closed with ``stack``) and read its header: the shape of every stored tensor,
    and a :data:`Reader` of them.

    Raises:
        InputError: a tensor stored in two shards, or a tensor of a non-floating dtype (naming it).
        CheckpointError: a shard that cannot be read or is no whole safetensors file (truncated, corrupt).
    """
    where: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        handle = stack.enter_context(open_safetensors(fn, "path", f))  # CheckpointError: a damaged file
        for name in handle.keys():
            if name in where:
                raise input_error(fn, "path", "each tensor stored once", f"{name!r} in two shards")
            sl = handle.get_slice(name)
            dtype = sl.get_dtype()
            if dtype not in FLOAT_DTYPES:
                raise input_error(
                    fn, f"checkpoint[{name!r}]", f"a floating dtype ({', '.join(sorted(FLOAT_DTYPES))})", dtype
                )
            where[name] = handle
            shapes[name] = tuple(int(s) for s in sl.get_shape())

    def read(name: str, index: tuple[slice, ...] | None) -> Tensor:
        sl = where[name].get_slice(name)
        return sl[:] if index is None else sl[index]

    return shapes, read
