"""The base model under a LoRA checkpoint: :func:`base_record` (saved in the manifest) and
:func:`base_problem` (the refusal of a checkpoint saved on another base).

A LoRA checkpoint leaves the frozen base weights out (parameters tagged ``fnppo_lora_base``): its
adapters mean something only on the base they were trained on. The record holds

* ``arch``: the base's architecture as :func:`fnppo.io.hf.peft.base_fingerprint` writes it for PEFT
  adapter files (family, sizes, biases, tying, MoE layout), when the model has a Hugging Face
  family's layout (``None`` otherwise);
* ``dtype``: the base weights' dtype;
* ``tensors``: for every non-expert base parameter (by its 1-rank name), digests of one slice that a
  single rank holds whole under every layout: index 0 along its tensor-parallel split (a row of a
  column-parallel weight or of the vocabulary, a column of a row-parallel weight), the whole tensor
  if it is replicated and 1-D (norms), its first row if replicated and 2-D. Megatron keeps weights in
  one global order whatever the layout, so the slice has the same bytes under any TP/PP/VPP/EP/CP
  layout. Two digests each (sha256, 16 hex digits): of the float32 values (compared when the dtypes
  agree: bit for bit) and of the values rounded to bfloat16 (compared across dtypes, so the same
  base held in fp32 and in bf16 agrees).

Expert weights are left out (their number would make the manifest large); the router, attention,
dense MLPs, norms and embeddings identify a base.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fnppo.core.errors import InputError
from fnppo.io.hf.arch import model_arch
from fnppo.io.hf.peft import base_fingerprint
from fnppo.megatron.parallel import current_layout
from fnppo.megatron.unwrap import unwrap_model
from fnppo.megatron.weights import global_name, is_expert, tp_of

__all__ = ["base_record", "base_problem"]


def _digest(t: Tensor) -> str:
    data = t.detach().to("cpu").contiguous()
    raw = data.view(torch.int16) if data.dtype == torch.bfloat16 else data.view(torch.int32)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]


def _slice(param: Tensor) -> Tensor:
    """The slice one rank holds whole under every layout (module docstring)."""
    if getattr(param, "tensor_model_parallel", False):
        return param.narrow(int(param.partition_dim), 0, 1)
    return param if param.dim() == 1 else param[0]


def _local_digests(model_chunks: Sequence[nn.Module]) -> dict[str, list[str]]:
    layout = current_layout()
    out: dict[str, list[str]] = {}
    for chunk in model_chunks:
        core = unwrap_model(chunk)
        tied = bool(getattr(core, "share_embeddings_and_output_weights", False))
        for name, param in core.named_parameters():
            if not getattr(param, "fnppo_lora_base", False) or is_expert(param):
                continue
            gname = global_name(core, name, layout)
            if tied and gname.endswith("output_layer.weight"):
                continue  # the embedding's copy on the last stage (PP > 1 only)
            if getattr(param, "tensor_model_parallel", False) and tp_of(param, layout)[1] != 0:
                continue
            s = _slice(param).to(torch.float32)
            out[gname] = [_digest(s), _digest(s.to(torch.bfloat16))]
    return out


def _dtype(model_chunks: Sequence[nn.Module]) -> str | None:
    for chunk in model_chunks:
        for p in unwrap_model(chunk).parameters():
            if getattr(p, "fnppo_lora_base", False):
                return str(p.dtype).replace("torch.", "")
    return None


def _arch(model_chunks: Sequence[nn.Module]) -> dict[str, Any] | None:
    try:
        return base_fingerprint(model_arch("fnppo.checkpoint.save_checkpoint", model_chunks))
    except InputError:  # not a Hugging Face family's layout: the tensors still identify the base
        return None


def base_record(model_chunks: Sequence[nn.Module]) -> dict[str, Any] | None:
    """The record of the base model under ``model_chunks``' LoRA adapters (module docstring); ``None``
    when no parameter is a frozen base weight. Collective over the whole world (every rank gets the
    same record)."""
    local = _local_digests(model_chunks)
    dtype = _dtype(model_chunks)
    parts: list[Any] = [(local, dtype)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (local, dtype))
    tensors: dict[str, list[str]] = {}
    for digests, _ in parts:
        tensors.update(digests)
    dtypes = sorted({d for _, d in parts if d is not None})
    if not dtypes:
        return None
    return {"arch": _arch(model_chunks), "dtype": dtypes[0], "tensors": dict(sorted(tensors.items()))}


def base_problem(saved: Mapping[str, Any] | None, mine: Mapping[str, Any] | None) -> str | None:
    """What differs between the base a checkpoint was saved on (``saved``) and this model's (``mine``),
    or ``None``: the same base, or a checkpoint without a record (no adapters, or saved before records).

    Names the architecture entries that differ (up to four) or the first base tensors whose digests
    differ (up to three, of how many)."""
    if saved is None:
        return None
    if mine is None:
        return "a model without LoRA adapters (the checkpoint holds adapters and no base weights)"
    a, b = saved.get("arch"), mine.get("arch")
    if a is not None and b is not None and a != b:
        keys = ["family", *(k for k in b if k != "family")]
        differ = [f"{k}={a.get(k)!r} (this model's {b[k]!r})" for k in keys if a.get(k) != b[k]]
        return "a base model of another architecture (the checkpoint's base has " + ", ".join(differ[:4]) + ")"
    which = 0 if saved.get("dtype") == mine.get("dtype") else 1
    theirs, ours = saved.get("tensors") or {}, mine.get("tensors") or {}
    differ = [n for n in ours if n in theirs and theirs[n][which] != ours[n][which]]
    if not differ:
        return None
    how = "bit for bit" if which == 0 else f"rounded to bfloat16 ({saved.get('dtype')} saved, {mine.get('dtype')} now)"
    names = ", ".join(differ[:3]) + (", ..." if len(differ) > 3 else "")
    return f"another base model: {len(differ)} of {len(ours)} base weights differ {how} ({names})"
