"""``read_checkpoint``: a checkpoint's contents in one process, without a model or a process group."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fnppo.io.checkpoint.content import quiet_checkpointing
from fnppo.io.checkpoint.manifest import checkpoint_error, verify_checkpoint

__all__ = ["read_checkpoint"]


def read_checkpoint(directory: str | os.PathLike) -> dict[str, Any]:
    """Everything the checkpoint in ``directory`` holds, for inspection (verified first, see
    :func:`verify_checkpoint`; call it outside ``torch.distributed``).

    Returns ``{"tensors": {sharded key: full tensor}, "objects": {key: bytes}, "common": dict,
    "manifest": dict}``: every tensor whole, under Megatron's sharded key (``decoder.layers.mlp.linear_fc1.weight``
    with the layers stacked on a first axis; ``optimizer.state.exp_avg.<key>`` for Adam's moments), the
    per-rank objects (each rank's RNG states, ``fnppo.rng/shard_<rank>_<world>``) as their serialized
    bytes, and the common state (step, ``extra``, train-state names, optimizer settings).
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise checkpoint_error("read_checkpoint", "directory", "a checkpoint directory path", repr(directory))
    path = Path(directory)
    manifest = verify_checkpoint(path)
    with tempfile.TemporaryDirectory() as tmp, quiet_checkpointing():
        dcp_to_torch_save(str(path), f"{tmp}/all.pt")
        flat = torch.load(f"{tmp}/all.pt", weights_only=False)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    objects = {k: v.getvalue() if isinstance(v, io.BytesIO) else v for k, v in flat.items() if k not in tensors}
    common = torch.load(path / "common.pt", weights_only=False)
    return {"tensors": tensors, "objects": objects, "common": common, "manifest": manifest}
