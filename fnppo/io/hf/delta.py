"""Delta weight streams (:func:`stream_hf_deltas`): only the Hugging Face tensors, blocks or elements
that changed since a :class:`~fnppo.io.hf.snapshot.WeightSnapshot`, each with the SHA-256 digest of
the new tensor, so that a receiver (:func:`fnppo.io.hf.apply.apply_hf_deltas`) rebuilds the new
weights bit for bit and can prove it.

The trainer's ranks move every shard to the sending rank as :func:`~fnppo.io.hf.stream.stream_hf_weights`
does (each full tensor is assembled there, in Hugging Face names and layouts, optionally FP8); the
sending rank copies the tensor to host memory, hashes it (block digests, :mod:`fnppo.io.hf.snapshot`)
and compares with the snapshot: an unchanged tensor is not sent; a changed one is sent in the
smallest of its encodings the snapshot allows:

* ``granularity="tensors"``: the whole tensor;
* ``"blocks"`` (default): the blocks of whole rows whose digests changed (the snapshot keeps 32 bytes
  per block, not the weights);
* ``"elements"``: the changed elements, as flat indices (int32 below 2^31 elements, else int64) and
  values; this needs the previous
  bits, so the snapshot keeps a host copy of every tensor on the sending rank (the model's size in
  host memory; nothing is kept on the GPU).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fnppo.core.errors import check_int, check_positive_int, input_error
from fnppo.core.typing import Tensor
from fnppo.io.hf.arch import expected_hf_shapes, model_arch
from fnppo.io.hf.checks import check_weight_dtype
from fnppo.io.hf.export import check_config_matches
from fnppo.io.hf.fp8 import FP8Blocks, check_fp8_shapes, to_fp8
from fnppo.io.hf.layouts import to_hf
from fnppo.io.hf.snapshot import (
    DeltaEnd,
    DeltaHeader,
    TensorDelta,
    WeightSnapshot,
    bits_view,
    block_digests,
    describe_snapshot,
    digest_of_blocks,
    model_fingerprint,
    rows_per_block,
)
from fnppo.io.hf.sources import export_params
from fnppo.io.hf.stream import full_tensor, send_shards, stream_plan
from fnppo.megatron.parallel import current_layout
from fnppo.megatron.unwrap import unwrap_model

__all__ = ["stream_hf_deltas", "DeltaStream", "GRANULARITIES"]

GRANULARITIES = ("tensors", "blocks", "elements")
DeltaBucket = list[Any]
"""One bucket of a delta stream: :class:`DeltaHeader` (first bucket), :class:`TensorDelta` records,
:class:`DeltaEnd` (last bucket)."""


class DeltaStream:
    """The buckets of one delta stream (iterate once, on every rank) and, once they are exhausted, the
    new :class:`WeightSnapshot` (``.snapshot``, the same digests on every rank): the ``since`` of the
    next stream."""

    def __init__(self, gen: Iterator[DeltaBucket], done: list[WeightSnapshot]) -> None:
        self._gen, self._done = gen, done

    def __iter__(self) -> Iterator[DeltaBucket]:
        return self._gen

    @property
    def snapshot(self) -> WeightSnapshot:
        if not self._done:
            raise input_error(
                "fnppo.hf.DeltaStream.snapshot",
                "self",
                "a stream iterated to its end on every rank",
                "one not exhausted",
            )
        return self._done[0]


def stream_hf_deltas(
    model_chunks: Sequence[nn.Module],
    since: WeightSnapshot | None,
    *,
    step: int,
    granularity: str = "blocks",
    bucket_bytes: int = 512 * 2**20,
    dst_rank: int = 0,
    hf_config: Any = None,
    dtype: torch.dtype | None = None,
    fp8: FP8Blocks | None = None,
    block_bytes: int = 64 * 2**10,
) -> DeltaStream:
    """The Hugging Face tensors that changed since ``since``, on rank ``dst_rank``, in buckets.

    Collective over the whole world, like :func:`~fnppo.io.hf.stream.stream_hf_weights` (same
    ``bucket_bytes``, ``dst_rank``, ``hf_config``, ``dtype``, ``fp8``): call it on every rank with the
    same arguments and iterate it to the end on every rank. The first bucket starts with a
    :class:`DeltaHeader` (the model, the format, the id and step of ``since`` and ``step``), the last
    ends with a :class:`DeltaEnd` (the number of records and the new snapshot's id); between them one
    :class:`TensorDelta` per changed tensor (module docstring: ``granularity``), in the model's layer
    order, with the SHA-256 :func:`~fnppo.io.hf.snapshot.tensor_digest` of the new tensor and of the
    one it applies to. ``since=None`` sends every tensor in full (the first sync). Once iterated,
    ``.snapshot`` is the new :class:`WeightSnapshot` at ``step``, the same digests on every rank (the
    sending rank broadcasts them; with ``"elements"`` only it keeps the bits). Record tensors are on
    the host. ``block_bytes``: the rows per digest block (:func:`~fnppo.io.hf.snapshot.rows_per_block`).

    Memory on the sending rank: the bucket being filled, one full tensor and its host copy, and the
    snapshot (digests: about 0.05% of the model; with ``"elements"`` a host copy of the model).

    Raises:
        InputError: before anything is sent, on every rank: ``since`` not a ``WeightSnapshot`` or None,
            or a snapshot of another model, another format (dtype, FP8 blocks, vocabulary, block
            size) or of a step not before ``step``; ``"elements"`` against a snapshot without the
            previous bits on ``dst_rank``; ``granularity`` not one of :data:`GRANULARITIES`; and
            everything :func:`stream_hf_weights` refuses.
    """
    fn = "fnppo.hf.stream_hf_deltas"
    a = model_arch(fn, model_chunks)
    check_positive_int(fn, "bucket_bytes", bucket_bytes)
    check_positive_int(fn, "block_bytes", block_bytes)
    check_int(fn, "step", step, low=0)
    check_weight_dtype(fn, dtype)
    if granularity not in GRANULARITIES:
        raise input_error(fn, "granularity", f"one of {GRANULARITIES}", repr(granularity))
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
    model = model_fingerprint(a, vocab)
    fmt = f"{'plain' if fp8 is None else fp8.name}|dtype={dtype}|vocab={vocab}|block_bytes={block_bytes}"
    _check_since(fn, since, model, fmt, step, granularity, dst_rank)
    mine = {p.gname: p for p in export_params(fn, a, model_chunks)}
    plan = stream_plan(fn, a, mine, layout, dst_rank, vocab)
    header = DeltaHeader(model, fmt, None if since is None else since.id, None if since is None else since.step, step)
    done: list[WeightSnapshot] = []
    ctx = (a, plan, mine, layout.rank, dst_rank, vocab, dtype, fp8, granularity, block_bytes)
    return DeltaStream(_deltas(ctx, since, header, bucket_bytes, done), done)


def _check_since(fn: str, since: Any, model: str, fmt: str, step: int, granularity: str, dst: int) -> None:
    """Refuse a snapshot this stream cannot be a delta against (the same checks on every rank)."""
    if since is None:
        return
    if not isinstance(since, WeightSnapshot):
        raise input_error(fn, "since", "None or a WeightSnapshot", describe_snapshot(since))
    if since.model != model:
        raise input_error(fn, "since", f"a snapshot of this model ({model})", describe_snapshot(since))
    if since.format != fmt:
        raise input_error(fn, "since", f"a snapshot in this stream's format {fmt!r}", describe_snapshot(since))
    if since.step >= step:
        raise input_error(fn, "since", f"a snapshot of a step before step={step}", describe_snapshot(since))
    if granularity == "elements" and not (since.kept_bits and since.holder == dst):
        raise input_error(
            fn,
            "since",
            f"a snapshot holding the previous bits on dst_rank={dst} (taken by a stream with granularity='elements' "
            "and this dst_rank)",
            f"{describe_snapshot(since)}, bits {'on rank ' + str(since.holder) if since.kept_bits else 'not kept'}",
        )


def _deltas(ctx: tuple, since: WeightSnapshot | None, header: DeltaHeader, bucket_bytes: int, done: list) -> Iterator:
    """The buckets (see :func:`stream_hf_deltas`); then the new snapshot, broadcast from the sender."""
    a, plan, mine, rank, dst, vocab, dtype, fp8, granularity, block_bytes = ctx
    device = next(iter(mine.values())).param.device if mine else torch.device("cpu")
    digests: dict[str, str] = {}
    blocks: dict[str, bytes] = {}
    bits: dict[str, Tensor] = {}
    bucket: DeltaBucket = [header] if rank == dst else []
    held, count = 0, 0
    with torch.no_grad():
        for e in plan:
            if rank != dst:
                send_shards(e, mine, rank, dst)
                continue
            full = full_tensor(e, mine, rank, (dtype or e.dtype) if fp8 is None else e.dtype, device)
            for hf_name, t in to_hf(a, e.kind, e.names, full, vocab).items():
                for name, out in to_fp8(hf_name, t, fp8, dtype):
                    host = out.detach().to("cpu", copy=True).contiguous()
                    record = _delta(name, host, since, granularity, block_bytes)
                    digests[name], blocks[name] = record[0], record[1]
                    if granularity == "elements":
                        bits[name] = host
                    if record[2] is None:
                        continue
                    if bucket and held + record[2].nbytes > bucket_bytes:
                        yield bucket
                        bucket, held = [], 0
                    bucket.append(record[2])
                    held += record[2].nbytes
                    count += 1
            del full
    snap = _share(header, digests, blocks, bits, granularity, rank, dst)
    if rank == dst:
        bucket.append(DeltaEnd(count, snap.id))
        yield bucket
    done.append(snap)


def _share(header: DeltaHeader, digests: dict, blocks: dict, bits: dict, granularity: str, rank: int, dst: int):
    """The new snapshot on every rank: the sender's digests broadcast (the bits stay on the sender)."""
    shared: list[Any] = [(digests, blocks)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(shared, src=dst)
    digests, blocks = shared[0]
    kept = granularity == "elements"
    return WeightSnapshot(
        model=header.model,
        format=header.format,
        step=header.step,
        digests=digests,
        blocks=blocks,
        bits=bits if kept and rank == dst else None,
        kept_bits=kept,
        holder=dst if kept else None,
    )


def _delta(
    name: str, new: Tensor, since: WeightSnapshot | None, granularity: str, block_bytes: int
) -> tuple[str, bytes, TensorDelta | None]:
    """(digest, block digests, the record or None when unchanged) of one tensor (on the host)."""
    blocks = block_digests(new, block_bytes)
    shape = tuple(new.shape)
    digest = digest_of_blocks(new.dtype, shape, block_bytes, blocks)
    base = None if since is None else since.digests.get(name)
    if base == digest:
        return digest, blocks, None

    def record(encoding: str, index: Tensor | None, values: Tensor) -> TensorDelta:
        return TensorDelta(name, new.dtype, shape, encoding, index, values, digest, base, block_bytes)

    best = record("full", None, new)
    if since is None or base is None:
        return digest, blocks, best
    old_blocks = (since.blocks or {}).get(name)
    if granularity != "tensors" and old_blocks is not None and len(old_blocks) == len(blocks):
        best = min(best, _changed_blocks(new, blocks, old_blocks, block_bytes, record), key=lambda r: r.nbytes)
    old = (since.bits or {}).get(name)
    if granularity == "elements" and old is not None and old.shape == new.shape and old.dtype == new.dtype:
        index = torch.nonzero(bits_view(new) != bits_view(old)).reshape(-1)
        small = new.numel() < 2**31  # int32 indices where they reach every element: 4 bytes each, not 8
        candidate = record("elements", index.to(torch.int32) if small else index, new.reshape(-1)[index])
        best = min(best, candidate, key=lambda r: r.nbytes)
    return digest, blocks, best


def _changed_blocks(new: Tensor, blocks: bytes, old: bytes, block_bytes: int, record: Any) -> TensorDelta:
    """The ``"blocks"`` record of ``new``: the blocks whose digests differ from ``old``'s."""
    n = len(blocks) // 32
    changed = [k for k in range(n) if blocks[32 * k : 32 * (k + 1)] != old[32 * k : 32 * (k + 1)]]
    rows = new.shape[0] if new.dim() else 1
    flat = new.reshape(rows, -1)
    rpb = rows_per_block(tuple(new.shape), new.element_size(), block_bytes)
    parts = [flat[k * rpb : min(rows, (k + 1) * rpb)].reshape(-1) for k in changed]
    values = torch.cat(parts) if parts else new.new_empty(0)
    return record("blocks", torch.tensor(changed, dtype=torch.int64), values)
