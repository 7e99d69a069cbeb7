"""What a delta weight stream is computed against and made of: digests of Hugging Face tensors, the
:class:`WeightSnapshot` of a model's exported weights at one step, and the records of a delta stream
(:class:`DeltaHeader`, :class:`TensorDelta`, :class:`DeltaEnd`).

Digest of a tensor (:func:`tensor_digest`): SHA-256 (FIPS 180-4) in two levels. The tensor's bytes
(C order, the machine's byte order, little-endian on every platform torch ships for) are cut into
blocks of whole rows (the rows of dimension 0; a 0-D tensor is one row), ``rows_per_block =
max(1, block_bytes // row_bytes)`` rows each (the last block may be shorter); each block's bytes
get a SHA-256, and the tensor's digest is the SHA-256 of ``b"fnppo-tensor-v1|" + dtype + "|" +
shape + "|" + rows_per_block + "|"`` followed by the block digests in order (a one-level Merkle
tree). Why SHA-256: a receiver must be able to tell *any* change of a single bit, also ones no one
chose at random (a collision-resistant hash, not a checksum such as CRC32 or a sum), every receiver
has it (``hashlib``, any language, no extra package), and current server CPUs run it in hardware
(SHA extensions, about 2 GB/s a core), so hashing a model is one pass over its bytes. The block
digests are what the sender keeps (32 bytes per block, about 0.05% of the model at the default
64 KiB) to tell which blocks changed without holding the old weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

from fnppo.core.typing import Tensor
from fnppo.io.hf.arch import Arch

__all__ = [
    "WeightSnapshot",
    "DeltaHeader",
    "TensorDelta",
    "DeltaEnd",
    "tensor_digest",
    "block_digests",
    "rows_per_block",
    "snapshot_id",
    "model_fingerprint",
    "bits_view",
]

_DIGEST = 32  # bytes of one SHA-256
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_view(t: Tensor) -> Tensor:
    """``t`` (contiguous) viewed as integers of its element size: its bits, compared and copied exactly
    (also for dtypes without index kernels, such as ``float8_e4m3fn``)."""
    return t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def rows_per_block(shape: tuple[int, ...], itemsize: int, block_bytes: int) -> int:
    """Rows (of dimension 0) per block of a tensor of ``shape``: ``max(1, block_bytes // row_bytes)``."""
    row_elems = 1
    for s in shape[1:]:
        row_elems *= s
    return max(1, block_bytes // max(1, row_elems * itemsize))


def block_digests(t: Tensor, block_bytes: int) -> bytes:
    """The SHA-256 of each block of whole rows of ``t`` (module docstring), concatenated."""
    cpu = t.detach().to("cpu").contiguous()
    raw = bits_view(cpu).view(torch.uint8).numpy()
    rows = cpu.shape[0] if cpu.dim() else 1
    row_bytes = raw.size // max(1, rows)
    step = rows_per_block(tuple(cpu.shape), cpu.element_size(), block_bytes) * row_bytes
    if raw.size == 0:
        return hashlib.sha256(b"").digest()
    return b"".join(hashlib.sha256(raw[i : i + step]).digest() for i in range(0, raw.size, step))


def _root(dtype: torch.dtype, shape: tuple[int, ...], rpb: int, blocks: bytes) -> str:
    head = f"fnppo-tensor-v1|{dtype}|{list(shape)}|{rpb}|".encode()
    return hashlib.sha256(head + blocks).hexdigest()


def tensor_digest(t: Tensor, block_bytes: int = 64 * 2**10) -> str:
    """The hex SHA-256 digest of ``t``'s bits, dtype and shape (module docstring): what a delta stream
    records for every tensor and its receiver checks. Equal bits, dtype and shape give equal digests
    on every machine; any other tensor another digest."""
    rpb = rows_per_block(tuple(t.shape), t.element_size(), block_bytes)
    return _root(t.dtype, tuple(t.shape), rpb, block_digests(t, block_bytes))


def digest_of_blocks(dtype: torch.dtype, shape: tuple[int, ...], block_bytes: int, blocks: bytes) -> str:
    """:func:`tensor_digest` from the block digests (the sender hashes each tensor once)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return _root(dtype, shape, rows_per_block(shape, itemsize, block_bytes), blocks)


def model_fingerprint(a: Arch, vocab: int) -> str:
    """A short hex digest of a model's architecture (family, sizes, MoE layout, tying) and vocabulary:
    what a snapshot of its weights means only for."""
    record = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(a).items()}
    record["vocab"] = vocab
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def snapshot_id(model: str, fmt: str, step: int, digests: Mapping[str, str]) -> str:
    """The hex SHA-256 of a snapshot's identity and its tensors' digests (sorted by name)."""
    body = json.dumps([model, fmt, step, sorted(digests.items())]).encode()
    return hashlib.sha256(body).hexdigest()


@dataclasses.dataclass(frozen=True, eq=False)
class WeightSnapshot:
    """A model's exported weights at one step, as digests: the ``since`` of the next delta stream
    (:func:`fnppo.io.hf.delta.stream_hf_deltas` returns the new one) and what a receiver holds
    (:func:`fnppo.io.hf.apply.apply_hf_deltas`).

    ``model``: :func:`model_fingerprint`; ``format``: the exported layout (dtype, FP8 blocks,
    vocabulary, digest block size); ``step``: the caller's step number; ``digests``: Hugging Face
    name -> :func:`tensor_digest`; ``blocks``: name -> the block digests (the sender's, to find
    the changed blocks; None on a receiver); ``bits``: name -> a host copy of the tensor, on the
    sending rank of a stream with ``granularity="elements"`` only (``kept_bits`` says whether the
    stream kept them, alike on every rank; ``holder`` is the rank that has them).
    """

    model: str
    format: str
    step: int
    digests: Mapping[str, str]
    blocks: Mapping[str, bytes] | None = None
    bits: Mapping[str, Tensor] | None = None
    kept_bits: bool = False
    holder: int | None = None

    @property
    def id(self) -> str:
        """:func:`snapshot_id` of the snapshot (what a delta stream's header names as its base)."""
        return snapshot_id(self.model, self.format, self.step, self.digests)

    @property
    def host_bytes(self) -> int:
        """Host memory the snapshot holds: digests, block digests and kept bits."""
        n = sum(len(k) + 64 for k in self.digests)
        n += sum(len(b) for b in (self.blocks or {}).values())
        return n + sum(t.numel() * t.element_size() for t in (self.bits or {}).values())


@dataclasses.dataclass(frozen=True)
class DeltaHeader:
    """The first record of a delta stream: the model and format, the snapshot it applies to (``base``:
    its id, None for a stream of every tensor in full) and the step it brings the receiver to."""

    model: str
    format: str
    base: str | None
    base_step: int | None
    step: int


@dataclasses.dataclass(frozen=True)
class TensorDelta:
    """One changed tensor: ``encoding`` ``"full"`` (``values`` is the tensor), ``"blocks"`` (``index``:
    int64 ids of the changed blocks of :func:`rows_per_block` rows; ``values``: their elements in
    order, flat) or ``"elements"`` (``index``: flat indices of the changed elements, int32 for tensors
    of fewer than 2^31 elements, else int64; ``values``: their new values). ``digest``: :func:`tensor_digest` of the new tensor (with ``block_bytes``);
    ``base``: the digest of the tensor it applies to (None for ``"full"``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    encoding: str
    index: Tensor | None
    values: Tensor
    digest: str
    base: str | None
    block_bytes: int

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the record carries (its values and indices)."""
        n = self.values.numel() * self.values.element_size()
        return n + (0 if self.index is None else self.index.numel() * self.index.element_size())


@dataclasses.dataclass(frozen=True)
class DeltaEnd:
    """The last record: how many :class:`TensorDelta` records came and the id of the snapshot the
    receiver holds once they are applied (a stream without it, or with fewer records, is truncated)."""

    count: int
    snapshot: str


def describe_snapshot(s: Any) -> str:
    """A snapshot's identity for error messages."""
    if not isinstance(s, WeightSnapshot):
        return f"{type(s).__name__} {s!r:.60}"
    return f"a snapshot of model {s.model}, format {s.format!r}, step {s.step}"
