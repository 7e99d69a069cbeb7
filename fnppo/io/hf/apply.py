"""The receiving end of a delta weight stream (:func:`apply_hf_deltas`): the new weights rebuilt
from the weights a receiver holds and the records of :func:`fnppo.io.hf.delta.stream_hf_deltas`,
every changed tensor checked against its SHA-256 digest before any is used.

An inference engine (or a test) that holds the weights of one snapshot in a dict of Hugging Face
names calls ``weights, held = apply_hf_deltas(weights, stream, held)`` per update; nothing it is
given is changed, and a refused stream leaves it with what it had.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fnppo.core.errors import input_error
from fnppo.core.typing import Tensor
from fnppo.io.hf.snapshot import (
    DeltaEnd,
    DeltaHeader,
    TensorDelta,
    WeightSnapshot,
    bits_view,
    describe_snapshot,
    rows_per_block,
    snapshot_id,
    tensor_digest,
)

__all__ = ["apply_hf_deltas"]

_FN = "fnppo.hf.apply_hf_deltas"


def apply_hf_deltas(
    weights: Mapping[str, Tensor], stream: Iterable[Iterable[Any]], held: WeightSnapshot | None
) -> tuple[dict[str, Tensor], WeightSnapshot]:
    """The weights after a delta stream, and the snapshot they are at: ``(new_weights, new_held)``.

    ``weights``: Hugging Face name -> tensor, the receiver's weights at ``held`` (the snapshot
    returned by the previous call; None before the first stream, which must be a full one,
    ``since=None``). ``stream``: the buckets of :func:`~fnppo.io.hf.delta.stream_hf_deltas` as they
    came (the whole stream; it is read to its end first). Every record is checked and every changed
    tensor rebuilt out of place (bits copied, never rounded) and its SHA-256
    :func:`~fnppo.io.hf.snapshot.tensor_digest` compared with the record's before anything is
    returned; then the new weights are ``weights`` with the changed tensors replaced (new tensors on
    the device of the ones they replace; the others are the same objects), and ``new_held`` a
    :class:`WeightSnapshot` of their digests (no block digests, no bits).

    Raises:
        InputError: naming what is wrong, with nothing changed: a stream that does not start with its
            :class:`DeltaHeader` or does not end with its :class:`DeltaEnd` (truncated), or holds fewer
            or other records than its end says; a delta of another model or format than ``held``, or
            against another snapshot or step than ``held``; a record for a tensor the receiver lacks,
            of another shape or dtype, against other bits than the receiver's (its ``base`` digest),
            with out-of-range indices; a rebuilt tensor whose digest is not the record's; a full
            stream that leaves the snapshot incomplete.
    """
    if held is not None and not isinstance(held, WeightSnapshot):
        raise input_error(_FN, "held", "None or a WeightSnapshot", describe_snapshot(held))
    if not isinstance(weights, Mapping):
        raise input_error(_FN, "weights", "a mapping of Hugging Face names to tensors", type(weights).__name__)
    header, records, end = _read(stream)
    digests = _check_base(header, held)
    if end.count != len(records):
        raise input_error(_FN, "stream", f"{end.count} tensor records (its DeltaEnd)", f"{len(records)} (truncated)")
    names = [r.name for r in records]
    if len(set(names)) != len(names):
        raise input_error(_FN, "stream", "each tensor at most once", f"{len(names) - len(set(names))} repeated")
    new: dict[str, Tensor] = {}
    for r in records:
        new[r.name] = _rebuild(r, weights, digests if header.base is not None else None)
        digests[r.name] = r.digest
    got = snapshot_id(header.model, header.format, header.step, digests)
    if got != end.snapshot:
        raise input_error(
            _FN, "stream", f"records that bring the weights to snapshot {end.snapshot[:16]}", f"snapshot {got[:16]}"
        )
    snapshot = WeightSnapshot(model=header.model, format=header.format, step=header.step, digests=digests)
    return {**weights, **new}, snapshot


def _read(stream: Iterable[Iterable[Any]]) -> tuple[DeltaHeader, list[TensorDelta], DeltaEnd]:
    """The header, records and end of a stream, in order (refused if out of order or truncated)."""
    items = [item for bucket in stream for item in bucket]
    if not items or not isinstance(items[0], DeltaHeader):
        first = type(items[0]).__name__ if items else "nothing"
        raise input_error(_FN, "stream", "a stream starting with its DeltaHeader", first)
    if not isinstance(items[-1], DeltaEnd):
        raise input_error(
            _FN,
            "stream",
            "a stream ending with its DeltaEnd",
            f"one ending with {type(items[-1]).__name__} (truncated)",
        )
    records = items[1:-1]
    bad = [type(r).__name__ for r in records if not isinstance(r, TensorDelta)]
    if bad:
        raise input_error(_FN, "stream", "TensorDelta records between the header and the end", f"a {bad[0]}")
    return items[0], records, items[-1]


def _check_base(header: DeltaHeader, held: WeightSnapshot | None) -> dict[str, str]:
    """The digests the records apply to: ``held``'s, once the header is a delta against it (none for a full stream)."""
    if header.base is None:
        return {}
    if held is None:
        raise input_error(_FN, "held", f"the snapshot the delta applies to (step {header.base_step})", "None")
    if held.model != header.model:
        raise input_error(_FN, "stream", f"a delta of the held model {held.model}", f"one of model {header.model}")
    if held.format != header.format:
        raise input_error(_FN, "stream", f"a delta in the held format {held.format!r}", f"format {header.format!r}")
    if header.base_step != held.step or header.base != held.id:
        raise input_error(
            _FN,
            "stream",
            f"a delta against the held snapshot (step {held.step}, {held.id[:16]})",
            f"one against step {header.base_step} ({str(header.base)[:16]})",
        )
    return dict(held.digests)


def _rebuild(r: TensorDelta, weights: Mapping[str, Tensor], base: dict[str, str] | None) -> Tensor:
    """The new tensor of record ``r``, checked against its digest."""
    if not isinstance(r.values, torch.Tensor) or r.encoding not in ("full", "blocks", "elements"):
        raise input_error(_FN, f"stream[{r.name!r}]", "a full, blocks or elements record", repr(r.encoding))
    if r.encoding == "full":
        if tuple(r.values.shape) != tuple(r.shape) or r.values.dtype != r.dtype:
            raise input_error(_FN, f"stream[{r.name!r}]", f"{r.dtype} of shape {r.shape}", _desc(r.values))
        new = r.values
    else:
        old = weights.get(r.name)
        if old is None:
            raise input_error(_FN, "weights", f"a tensor {r.name!r} (the delta changes it)", "none")
        if tuple(old.shape) != tuple(r.shape) or old.dtype != r.dtype:
            raise input_error(_FN, f"weights[{r.name!r}]", f"{r.dtype} of shape {r.shape}", _desc(old))
        if base is None or base.get(r.name) != r.base:
            raise input_error(
                _FN, f"stream[{r.name!r}]", "a delta against the held tensor's digest", f"base {str(r.base)[:16]}"
            )
        new = _patched(r, old)
    got = tensor_digest(new, r.block_bytes)
    if got != r.digest:
        raise input_error(
            _FN,
            f"stream[{r.name!r}]",
            f"a rebuilt tensor of digest {r.digest[:16]} (SHA-256)",
            f"digest {got[:16]} (the receiver's weights or the record differ from the sender's)",
        )
    return new


def _patched(r: TensorDelta, old: Tensor) -> Tensor:
    """``old`` with the record's blocks or elements written in, out of place, as bits."""
    flat = bits_view(old.contiguous())
    values = bits_view(r.values.to(old.device).contiguous())
    index = r.index
    if index is None or index.dtype not in (torch.int32, torch.int64) or index.dim() != 1:
        raise input_error(
            _FN, f"stream[{r.name!r}].index", "a 1-D int32 or int64 tensor", "None" if index is None else _desc(index)
        )
    index = index.to(device=old.device, dtype=torch.int64)
    if r.encoding == "elements":
        if index.numel() != values.numel() or (index.numel() and (index.min() < 0 or index.max() >= flat.numel())):
            raise input_error(
                _FN, f"stream[{r.name!r}].index", f"{values.numel()} indices in [0, {flat.numel()})", _desc(index)
            )
        out = flat.index_copy(0, index, values)
    else:
        rows = old.shape[0] if old.dim() else 1
        rpb = rows_per_block(tuple(old.shape), old.element_size(), r.block_bytes)
        nblocks = -(-rows // rpb)
        if index.numel() and (index.min() < 0 or index.max() >= nblocks):
            raise input_error(_FN, f"stream[{r.name!r}].index", f"block ids in [0, {nblocks})", _desc(index))
        row_ids = [i for k in index.tolist() for i in range(k * rpb, min(rows, (k + 1) * rpb))]
        per_row = flat.numel() // max(1, rows)
        if values.numel() != len(row_ids) * per_row:
            raise input_error(_FN, f"stream[{r.name!r}].values", f"{len(row_ids) * per_row} elements", _desc(values))
        ids = torch.tensor(row_ids, dtype=torch.int64, device=old.device)
        out = flat.reshape(rows, per_row).index_copy(0, ids, values.reshape(-1, per_row))
    return out.reshape(-1).view(old.dtype).reshape(old.shape)


def _desc(t: Any) -> str:
    return f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
