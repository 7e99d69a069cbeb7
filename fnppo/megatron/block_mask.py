"""Flex-attention ``BlockMask``\\ s of packed micro-batches, built from block counts (no compile).

A ``BlockMask`` lists, for each block of 128 queries, the key blocks it must visit: those partly
allowed (the kernel evaluates the rule inside them) and those wholly allowed (no rule evaluated).
torch's ``create_block_mask`` finds them by evaluating the rule on the full ``[T, T]`` grid
(``T^2`` booleans at once), or by compiling that evaluation with ``torch.compile`` -- a compile
for every micro-batch, because the rule closes over that micro-batch's segment ids (measured on
one H100 at Qwen2.5-1.5B widths: tens of seconds per micro-batch, five micro-batches in 280 s).

:func:`block_mask` evaluates the same rule one chunk of query blocks at a time (at most
:data:`CHUNK_ELEMENTS` mask entries alive), counts each block's allowed entries, and hands the
counts to ``BlockMask.from_kv_blocks`` in the order torch's own constructor uses (key blocks in
ascending order, wholly allowed blocks kept apart), so the kernel visits the same blocks in the
same order as with ``create_block_mask``. Reference: PyTorch's FlexAttention
(arXiv:2412.05496), section 3 (block sparsity).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask

from fnppo.core.errors import describe, input_error
from fnppo.core.typing import Int, Tensor, typechecked

__all__ = ["BLOCK", "CHUNK_ELEMENTS", "block_mask", "document_causal_block_mask", "prefix_tree_block_mask"]

BLOCK = 128
"""Query and key block size (torch's default ``BLOCK_SIZE``)."""

CHUNK_ELEMENTS = 1 << 24
"""Mask entries evaluated at once (16M booleans: 16 MiB)."""

MaskMod = Callable[[Any, Any, Tensor, Tensor], Tensor]


def block_mask(mask_mod: MaskMod, total: int, device: torch.device) -> BlockMask:
    """The ``BlockMask`` of ``mask_mod(b, h, q_idx, kv_idx)`` over ``total`` queries and keys.

    Block ``(i, j)`` is *full* if all ``128 x 128`` of its entries (inside ``total``) are allowed,
    *partial* if some but not all are; entries at or beyond ``total`` count as not allowed, as in
    ``create_block_mask``. Each row's partial and full key blocks are listed in ascending order.
    ``mask_mod`` is called with ``b = h = None`` on index tensors clamped to ``[0, total)``.
    """
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise input_error("fnppo.megatron.block_mask.block_mask", "total", "an int >= 1 (tokens)", repr(total))
    blocks = -(-total // BLOCK)
    span = blocks * BLOCK
    kv = torch.arange(span, device=device)
    kv_in = kv < total
    kv_c = kv.clamp_max(total - 1)
    per_chunk = max(1, CHUNK_ELEMENTS // (BLOCK * span))  # query blocks per chunk
    counts = []
    for first in range(0, blocks, per_chunk):
        q = torch.arange(first * BLOCK, min(blocks, first + per_chunk) * BLOCK, device=device)
        allowed = mask_mod(None, None, q.clamp_max(total - 1)[:, None], kv_c[None, :])
        allowed = allowed & (q < total)[:, None] & kv_in[None, :]
        counts.append(allowed.view(-1, BLOCK, blocks, BLOCK).sum(dim=(1, 3), dtype=torch.int32))
    count = torch.cat(counts)[None, None]  # [1, 1, q blocks, kv blocks]
    full = count == BLOCK * BLOCK
    partial = (count > 0) & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(total, total)
    )


def _ordered(present: Tensor) -> tuple[Tensor, Tensor]:
    """``(count, indices)`` per query block: how many key blocks are present, and their indices
    first, ascending (a stable descending sort of the 0/1 flags, as torch orders them)."""
    flags = present.to(torch.int32)
    num = flags.sum(dim=-1).to(torch.int32)
    idx = torch.argsort(flags, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


@typechecked
def document_causal_block_mask(seg: Int[Tensor, " tokens"]) -> BlockMask:
    """``allowed[i, j] = seg(i) == seg(j) and j <= i``: causal attention inside each packed
    sequence of segment ids ``seg`` (arXiv:2107.02027)."""

    def document_causal(b: Any, h: Any, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (seg[q_idx] == seg[kv_idx]) & (q_idx >= kv_idx)

    if seg.numel() == 0:
        raise input_error(
            "fnppo.megatron.block_mask.document_causal_block_mask", "seg", "at least one token", describe(seg)
        )
    return block_mask(document_causal, seg.numel(), seg.device)


@typechecked
def prefix_tree_block_mask(branch: Int[Tensor, " tokens"], root: Int[Tensor, " tokens"]) -> BlockMask:
    """``allowed[i, j] = j <= i and branch(j) in {branch(i), root(i)}``: a segment sees its
    document's prefix and itself, causally (:mod:`fnppo.core.batching.prefix`)."""

    def prefix_tree(b: Any, h: Any, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= kv_idx) & ((branch[kv_idx] == branch[q_idx]) | (branch[kv_idx] == root[q_idx]))

    if branch.numel() == 0:
        raise input_error(
            "fnppo.megatron.block_mask.prefix_tree_block_mask", "branch", "at least one token", describe(branch)
        )
    return block_mask(prefix_tree, branch.numel(), branch.device)
