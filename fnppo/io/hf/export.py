"""Writing a model as a Hugging Face safetensors checkpoint (:func:`export_hf_weights`, the inverse of
:func:`fnppo.io.hf.load.load_hf_weights`): each tensor gathered over tensor parallelism, converted to
Hugging Face names and layouts, written in shards by one rank per pipeline stage (and per expert-
parallel rank), then named, indexed and given its ``config.json`` by rank 0.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fnppo.core.errors import check_positive_int, checkpoint_error, input_error
from fnppo.core.typing import Tensor
from fnppo.io.hf.arch import Arch, expected_hf_shapes, model_arch
from fnppo.io.hf.checks import check_hf_config, check_weight_dtype
from fnppo.io.hf.config import checked_hf_config, read_hf_config
from fnppo.io.hf.fp8 import FP8Blocks, check_fp8_shapes, fp8_tensor_shapes, quantization_config, to_fp8
from fnppo.io.hf.layouts import split_dim, to_hf
from fnppo.io.hf.shards import INDEX_FILE, SINGLE_FILE
from fnppo.io.hf.sources import ExportParam, export_params, local_weight, place_shard
from fnppo.io.hf.value_head import token_classification_config
from fnppo.megatron.parallel import ParallelLayout, current_layout
from fnppo.megatron.unwrap import unwrap_model
from fnppo.megatron.weights import (
    is_expert as _is_expert,
)
from fnppo.megatron.weights import (
    is_gated_fc1 as _is_gated_fc1,
)
from fnppo.megatron.weights import (
    tp_of as _tp_of,
)


def gather_tp(p: ExportParam, layout: ParallelLayout) -> Tensor:
    """The full (1-rank) Megatron tensor of ``p`` (:func:`local_weight` of every rank of its TP
    group, expert TP for experts, placed with :func:`place_shard`; collective over that group)."""
    t = local_weight(p)
    dim, n = split_dim(p.param, _tp_of(p.param, layout)[0])
    if dim is None:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=layout.etp_group if _is_expert(p.param) else layout.tp_group)
    shape = list(t.shape)
    shape[dim] *= n
    full = t.new_empty(shape)
    gated = _is_gated_fc1(p.core, p.name)
    for r, part in enumerate(parts):
        place_shard(full, part, r, dim, gated)
    return full


def _write_hf_config(path: Path, hf_config: Any, quantization: dict | None = None) -> None:
    """``config.json`` in ``path``: a transformers config saves itself, anything else as JSON (with
    ``quantization`` as its ``quantization_config``)."""
    if hasattr(hf_config, "save_pretrained") and quantization is None:
        hf_config.save_pretrained(str(path))
        return
    cfg = read_hf_config("fnppo.io.hf.export_hf_weights", "hf_config", hf_config)
    if quantization is not None:
        cfg = {**cfg, "quantization_config": quantization}
    with open(path / "config.json", "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
        fh.write("\n")


def check_config_matches(fn: str, core: nn.Module, a: Arch, hf_config: Any) -> tuple[int, Any]:
    """Check that ``hf_config`` describes the model; returns its vocabulary size and the config to
    write (for a value model: :func:`token_classification_config` of it)."""
    hf = read_hf_config(fn, "hf_config", hf_config)
    # read through its family's allow-list; another family than the model's is named by check_hf_config
    checked = checked_hf_config(fn, hf, "hf_config", head=False)[0] if hf.get("model_type") == a.family else hf
    described = check_hf_config(fn, core, a, checked, "hf_config", "in hf_config")
    vocab = checked["vocab_size"]
    if vocab > a.padded_vocab:
        raise input_error(fn, "hf_config.vocab_size", f"at most {a.padded_vocab} (the model's)", repr(vocab))
    return vocab, token_classification_config(a, hf, described) if a.value else hf_config


def export_hf_weights(
    model_chunks: Sequence[nn.Module],
    path: str | os.PathLike,
    *,
    hf_config: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    fp8: FP8Blocks | None = None,
) -> None:
    """Write the model as a Hugging Face safetensors checkpoint (the inverse of :func:`load_hf_weights`).

    Collective over the whole world (call on every rank). Each tensor is all-gathered over its
    tensor-parallel group and converted to HF names and layouts (QKV split per group, ``[gate; up]``
    split, vocabulary padding dropped); the first data-parallel replica's tensor-parallel rank 0 of
    every pipeline stage writes its stage's tensors, and for MoE experts the first
    expert-data-parallel replica's expert-TP rank 0 of every expert-parallel rank writes its experts
    (at most one shard of ``max_shard_bytes`` in host memory per writing rank). Rank 0 then names the
    shards ``model.safetensors`` (one file) or ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``, removes stale shards of that naming, and writes ``config.json``
    from ``hf_config`` (a dict, a transformers config, or a ``config.json`` path / directory; checked
    against the model) if given. ``path`` must be on a file system all writing ranks see. ``dtype``:
    the stored dtype (default: the parameters').
    Tied embeddings store only ``model.embed_tokens.weight``.

    ``fp8`` (an :class:`~fnppo.io.hf.fp8.FP8Blocks`): every projection weight is stored as E4M3 codes
    with its fp32 ``weight_scale_inv`` per block (:mod:`fnppo.io.hf.fp8`; quantized from the
    parameters' values), the embedding, ``lm_head``, norms, biases and router gates in ``dtype``, and
    ``config.json`` gets the ``quantization_config`` transformers' fine-grained FP8 loader, vLLM and
    SGLang read (:func:`~fnppo.io.hf.fp8.quantization_config`). A block that does not divide a
    projection weight is refused by name before anything is written.

    A value model (``head="value"``) is written as transformers' ``<Family>ForTokenClassification``
    with ``num_labels=1``: the trunk as above, ``score.weight`` ``[1, hidden]`` and ``score.bias``
    ``[1]`` from the value head (written by the last pipeline stage), and, from ``hf_config`` (the
    policy's or a value or reward model's config), a ``config.json`` naming that class with one
    label (``id2label``, ``label2id``, ``num_labels``) and ``token_classification_bias: true``:
    ``AutoModelForTokenClassification.from_pretrained(path)(ids).logits[..., 0]`` are the values.

    Raises a :class:`~fnppo.io.checkpoint.manifest.CheckpointError` on every rank when rank 0 fails to
    finish the files (naming the path and the cause, e.g. ``IsADirectoryError``).
    """
    fn = "fnppo.io.hf.export_hf_weights"
    a = model_arch(fn, model_chunks)
    check_positive_int(fn, "max_shard_bytes", max_shard_bytes)
    check_weight_dtype(fn, dtype)
    if fp8 is not None:
        check_fp8_shapes(fn, expected_hf_shapes(a, a.padded_vocab), fp8)
    if not isinstance(path, (str, os.PathLike)):
        raise input_error(fn, "path", "a directory path (str or os.PathLike)", f"{path!r}")
    if Path(path).exists() and not Path(path).is_dir():
        raise input_error(fn, "path", "a new or existing directory", f"{str(path)!r}, an existing file (not replaced)")
    vocab, written_config = (
        (a.padded_vocab, None)
        if hf_config is None
        else check_config_matches(fn, unwrap_model(model_chunks[0]), a, hf_config)
    )
    layout = current_layout()
    out = Path(path)
    # (gathers, writes) for dense tensors and for experts (expert parallelism splits the experts)
    role = {
        False: (layout.dp_rank == 0, layout.dp_rank == 0 and layout.tp_rank == 0),
        True: (layout.edp_rank == 0, layout.edp_rank == 0 and layout.etp_rank == 0),
    }
    writer = role[False][1] or (bool(a.moe_layers) and role[True][1])
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    shards = _ShardWriter(out, layout.rank, max_shard_bytes)
    if writer or role[False][0] or role[True][0]:
        _write_tensors(fn, a, model_chunks, layout, role, shards, dtype, vocab, fp8)
        if writer:
            shards.flush()
    parts = _all_parts(fn, a, layout, shards.written if writer else None, vocab, fp8)
    error: list[str | None] = [None]
    if layout.rank == 0:
        try:
            names = [n for _, ns, _ in parts for n in ns]
            quant = None if fp8 is None else quantization_config(names, fp8)
            _finalize_export(out, parts, written_config, quant)
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            error[0] = f"{type(err).__name__}: {err}"
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise checkpoint_error(
            fn, "path", "a directory rank 0 can write the weights into", f"{str(out)!r} ({error[0]})"
        )


_Part = tuple[str, list[str], int]  # (a written shard's temporary file name, its tensors' names, its bytes)


class _ShardWriter:
    """One writing rank's shards: tensors are buffered until the next one would pass ``max_bytes``,
    then saved under a temporary name (:func:`_finalize_export` gives the final ones)."""

    def __init__(self, out: Path, rank: int, max_bytes: int) -> None:
        from safetensors.torch import save_file

        self.save, self.out, self.rank, self.max_bytes = save_file, out, rank, max_bytes
        self.written: list[_Part] = []
        self.buffer: dict[str, Tensor] = {}
        self.buffered = 0

    def add(self, name: str, t: Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.buffer and self.buffered + size > self.max_bytes:
            self.flush()
        self.buffer[name] = t
        self.buffered += size

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f".fnppo-export-r{self.rank:05d}-{len(self.written):05d}.safetensors"
        self.save(self.buffer, str(self.out / name), metadata={"format": "pt"})
        self.written.append((name, sorted(self.buffer), self.buffered))
        self.buffer, self.buffered = {}, 0


def _write_tensors(
    fn: str,
    a: Arch,
    model_chunks: Sequence[nn.Module],
    layout: ParallelLayout,
    role: dict[bool, tuple[bool, bool]],
    shards: _ShardWriter,
    dtype: torch.dtype | None,
    vocab: int,
    fp8: FP8Blocks | None = None,
) -> None:
    """Gather every parameter this rank's role gathers (``role[is_expert] = (gathers, writes)``) and
    add the Hugging Face tensors of those it writes to ``shards`` (a tied output layer: none)."""
    for p in export_params(fn, a, model_chunks):
        gathers, writes = role[_is_expert(p.param)]
        if not gathers:
            continue
        full = gather_tp(p, layout)
        if not writes:
            continue
        for hf_name, t in to_hf(a, p.kind, p.names, full, vocab).items():
            for name, stored in to_fp8(hf_name, t.detach(), fp8, dtype):
                shards.add(name, stored.to(device="cpu").contiguous().clone())
        del full


def _all_parts(
    fn: str, a: Arch, layout: ParallelLayout, written: list[_Part] | None, vocab: int, fp8: FP8Blocks | None = None
) -> list[_Part]:
    """Every writing rank's shards (collective; ``written``: this rank's, ``None`` on the others), in
    (pipeline stage, rank) order, checked to hold every tensor of the checkpoint exactly once."""
    everyone: list[Any] = [None] * layout.world_size
    dist.all_gather_object(everyone, (layout.pp_rank, layout.rank, written) if written is not None else None)
    parts = [f for item in sorted((x for x in everyone if x is not None), key=lambda x: x[:2]) for f in item[2]]
    names = [n for _, ns, _ in parts for n in ns]
    expected = expected_hf_shapes(a, vocab)
    if fp8 is not None:
        expected = fp8_tensor_shapes(expected, fp8)
    if sorted(names) != sorted(expected):  # every tensor exactly once (checked alike on every rank)
        dup = sorted(n for n, c in Counter(names).items() if c > 1)
        raise AssertionError(f"{fn}: exported {len(names)} tensors, expected {len(expected)} (duplicates: {dup[:4]})")
    return parts


def _finalize_export(out: Path, parts: list[_Part], hf_config: Any, quantization: dict | None = None) -> None:
    """Rank 0: final shard names, the index, stale shards removed, config.json."""
    final = (
        [SINGLE_FILE]
        if len(parts) == 1
        else [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    )
    stale = [
        p
        for p in out.glob("model*.safetensors*")
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", p.name)
    ]
    for p in stale:
        p.unlink()
    weight_map: dict[str, str] = {}
    for (tmp, ns, _), dst in zip(parts, final):
        os.replace(out / tmp, out / dst)
        weight_map.update({n: dst for n in ns})
    if len(parts) > 1:
        index = {
            "metadata": {"total_size": sum(b for _, _, b in parts)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        with open(out / INDEX_FILE, "w", encoding="utf-8") as fh:
            json.dump(index, fh, indent=2)
            fh.write("\n")
    if hf_config is not None:
        _write_hf_config(out, hf_config, quantization)
