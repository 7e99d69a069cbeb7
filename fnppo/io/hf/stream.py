"""Streaming a model's weights to an inference engine in Hugging Face names (:func:`stream_hf_weights`):
each full tensor assembled from its TP/PP/EP shards on the one rank that sends them, converted to
Hugging Face names and layouts, and handed over in buckets of a given byte size, never the whole model
at once. Engines take exactly this: vLLM's ``model.load_weights(weights)`` (an iterable of
``(name, tensor)``), SGLang's ``update_weights_from_tensor``, or a transformers model's
``load_state_dict(dict(bucket), strict=False)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fnppo.core.errors import check_positive_int, input_error
from fnppo.core.typing import Tensor
from fnppo.io.hf.arch import Arch, expected_hf_shapes, model_arch
from fnppo.io.hf.checks import check_weight_dtype
from fnppo.io.hf.export import check_config_matches
from fnppo.io.hf.fp8 import FP8Blocks, check_fp8_shapes, to_fp8
from fnppo.io.hf.layouts import split_dim, to_hf
from fnppo.io.hf.sources import ExportParam, export_params, local_weight, place_shard
from fnppo.megatron.parallel import ParallelLayout, current_layout
from fnppo.megatron.unwrap import unwrap_model
from fnppo.megatron.weights import is_gated_fc1, tp_of

Bucket = list[tuple[str, Tensor]]
"""One bucket of :func:`stream_hf_weights`: ``(Hugging Face name, full tensor)`` pairs."""


class StreamEntry(NamedTuple):
    """One Megatron parameter of the whole model, as every rank plans to move it."""

    gname: str
    kind: str
    names: tuple[str, ...]
    sources: tuple[int, ...]  # the global rank sending TP shard r, for r in range(len(sources))
    dim: int  # partition dim (0 when not split)
    gated: bool
    shard_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.shard_shape)
        shape[self.dim] *= len(self.sources)
        return tuple(shape)


def stream_hf_weights(
    model_chunks: Sequence[nn.Module],
    *,
    bucket_bytes: int = 512 * 2**20,
    dst_rank: int = 0,
    hf_config: Any = None,
    dtype: torch.dtype | None = None,
    fp8: FP8Blocks | None = None,
) -> Iterator[Bucket]:
    """The model's weights in Hugging Face names and layouts, in buckets, on rank ``dst_rank``.

    Collective over the whole world: call it on every rank and exhaust the iterator on every rank
    (a ``for`` loop does; on ranks other than ``dst_rank`` it yields nothing and only sends their
    shards). The call itself checks the arguments and agrees on a plan with one
    ``all_gather_object`` of names and shapes; iterating moves the tensors, one Megatron parameter
    at a time in the model's layer order: its tensor-parallel shards (expert TP for experts) go from
    one replica's ranks (``dst_rank``'s own when it holds one) to ``dst_rank`` by point-to-point
    ``send``/``recv``, where they are placed into the full tensor and converted as
    :func:`export_hf_weights` converts them (fused QKV split per group, ``[gate; up]`` split,
    vocabulary padding dropped; a tied output layer is only ``model.embed_tokens.weight``). Pipeline
    stages and expert-parallel ranks send what they hold; nothing is all-gathered.

    Each bucket is a list of ``(name, tensor)`` pairs of at most ``bucket_bytes`` (a tensor larger
    than that comes alone); the tensors are fresh (never the parameters' storage), on the
    parameters' device, in ``dtype`` (default: the parameters'). Feed each bucket to an engine
    as it comes: vLLM ``model.load_weights(bucket)`` (or all at once, lazily:
    ``model.load_weights(itertools.chain.from_iterable(stream_hf_weights(chunks)))``); a
    transformers model ``model.load_state_dict(dict(bucket), strict=False)``.

    Memory: ``dst_rank`` holds the bucket it is filling (below ``bucket_bytes``: a bucket is handed
    over before a tensor that would overflow it is assembled) and one full tensor being assembled
    (with one received shard, or its query/key/value split), so its extra memory stays below
    ``max(bucket_bytes, T) + T`` for the largest full tensor ``T`` once the caller lets go of the
    buckets it was given; the other ranks allocate nothing (they send their parameters' storage).
    ``hf_config`` (a dict, a transformers config or a ``config.json`` path, as for
    :func:`export_hf_weights`): checked against the model, and its ``vocab_size`` drops the
    vocabulary padding (default: the model's padded vocabulary). ``fp8`` (an
    :class:`~fnppo.io.hf.fp8.FP8Blocks`): every projection weight comes as its E4M3 codes and its
    ``weight_scale_inv`` (:mod:`fnppo.io.hf.fp8`), the other tensors in ``dtype``.

    Raises:
        InputError: ``bucket_bytes`` not an int >= 1, ``dst_rank`` not a rank of the world, a model
            these families cannot hold, an ``hf_config`` that does not describe it, or ``fp8`` with a
            block that does not divide a projection weight (naming it).
    """
    fn = "fnppo.io.hf.stream_hf_weights"
    a = model_arch(fn, model_chunks)
    check_positive_int(fn, "bucket_bytes", bucket_bytes)
    check_weight_dtype(fn, dtype)
    layout = current_layout()
    if isinstance(dst_rank, bool) or not isinstance(dst_rank, int) or not 0 <= dst_rank < layout.world_size:
        raise input_error(fn, "dst_rank", f"an int in [0, {layout.world_size}) (a rank of the world)", repr(dst_rank))
    vocab = (
        a.padded_vocab
        if hf_config is None
        else check_config_matches(fn, unwrap_model(model_chunks[0]), a, hf_config)[0]
    )
    if fp8 is not None:
        check_fp8_shapes(fn, expected_hf_shapes(a, vocab), fp8)
    mine = {p.gname: p for p in export_params(fn, a, model_chunks)}
    plan = stream_plan(fn, a, mine, layout, dst_rank, vocab)
    return _stream(a, plan, mine, layout.rank, dst_rank, bucket_bytes, dtype, vocab, fp8)


def stream_plan(
    fn: str, a: Arch, mine: dict[str, ExportParam], layout: ParallelLayout, dst: int, vocab: int
) -> list[StreamEntry]:
    """Every rank's parameters (one ``all_gather_object``), each with the ranks that send its shards,
    in layer order; the same list on every rank, checked to hold every Hugging Face tensor once."""
    local = []
    for p in mine.values():
        tp, tp_rank = tp_of(p.param, layout)
        dim, n = split_dim(p.param, tp)
        order = (p.chunk, layout.pp_rank, p.index)  # virtual stage c * pp + pp_rank holds the later layers
        gated = dim is not None and is_gated_fc1(p.core, p.name)
        shape = tuple(p.param.shape)
        local.append(
            (order, p.gname, p.kind, p.names, tp_rank if n > 1 else 0, n, dim or 0, gated, shape, p.param.dtype)
        )
    everyone: list[Any] = [None] * layout.world_size
    dist.all_gather_object(everyone, local)
    holders: dict[str, dict[int, list[int]]] = {}
    info: dict[str, tuple] = {}
    for rank, items in enumerate(everyone):
        for order, gname, kind, names, r, n, dim, gated, shape, dt in items:
            holders.setdefault(gname, {}).setdefault(r, []).append(rank)
            prev = info.get(gname)
            info[gname] = (min(order, prev[0]) if prev else order, kind, names, n, dim, gated, shape, dt)
    plan = []
    for gname in sorted(info, key=lambda g: (info[g][0], g)):
        _, kind, names, n, dim, gated, shape, dt = info[gname]
        by_r = holders[gname]
        if sorted(by_r) != list(range(n)):
            raise AssertionError(f"{fn}: {gname!r} has TP shards {sorted(by_r)} of {n}")
        sources = tuple(dst if dst in by_r[r] else min(by_r[r]) for r in range(n))
        plan.append(StreamEntry(gname, kind, names, sources, dim, gated, shape, dt))
    streamed = sorted(n for e in plan for n in e.names)
    expected = sorted(expected_hf_shapes(a, vocab))
    if streamed != expected:  # every tensor exactly once (checked alike on every rank)
        raise AssertionError(f"{fn}: planned {len(streamed)} tensors, expected {len(expected)}")
    return plan


def _stream(
    a: Arch,
    plan: list[StreamEntry],
    mine: dict[str, ExportParam],
    rank: int,
    dst: int,
    bucket_bytes: int,
    dtype: torch.dtype | None,
    vocab: int,
    fp8: FP8Blocks | None = None,
) -> Iterator[Bucket]:
    """Move the planned tensors to ``dst`` (see :func:`stream_hf_weights`); yields only on ``dst``."""
    device = next(iter(mine.values())).param.device if mine else torch.device("cpu")
    bucket: Bucket = []
    held = 0
    with torch.no_grad():
        for e in plan:
            if rank != dst:
                send_shards(e, mine, rank, dst)
                continue
            out = dtype or e.dtype
            size = torch.Size(e.full_shape).numel() * torch.empty((), dtype=out).element_size()
            if bucket and held + size > bucket_bytes:
                yield bucket
                bucket, held = [], 0
            full = full_tensor(e, mine, rank, out if fp8 is None else e.dtype, device)  # FP8 from the parameters
            for name, t in to_hf(a, e.kind, e.names, full, vocab).items():
                bucket.extend(to_fp8(name, t, fp8, out))
            held += size
            del full
        if bucket:
            yield bucket


def send_shards(e: StreamEntry, mine: dict[str, ExportParam], rank: int, dst: int) -> None:
    """On a rank other than ``dst``: send the TP shards of ``e`` this rank is the source of."""
    for src in e.sources:
        if src == rank:  # a rank may hold several shards of one tensor only as replicas: once each
            dist.send(local_weight(mine[e.gname]).contiguous(), dst)


def full_tensor(e: StreamEntry, mine: dict[str, ExportParam], rank: int, dtype: torch.dtype, device: Any) -> Tensor:
    """On the receiving rank: the full (1-rank) Megatron tensor of ``e``, a fresh buffer filled with
    each TP shard in turn (this rank's own through :func:`local_weight`, the others received into one
    shard-sized buffer) by :func:`place_shard`."""
    full = torch.empty(e.full_shape, dtype=dtype, device=device)
    buf = None
    for r, src in enumerate(e.sources):
        if src == rank:
            shard = local_weight(mine[e.gname])
        else:
            if buf is None:
                buf = torch.empty(e.shard_shape, dtype=e.dtype, device=device)
            dist.recv(buf, src)
            shard = buf
        place_shard(full, shard, r, e.dim, e.gated)
    return full
