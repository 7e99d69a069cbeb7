"""fnppo.megatron.block_mask: the chunked constructor lists the blocks torch's ``create_block_mask``
lists, in the same order, for packed and shared-prefix layouts (torch's evaluation on the full
grid is the reference), and flex attention through it equals a dense masked softmax."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from fnppo.core.errors import InputError, ShapeError
from fnppo.megatron import block_mask as bm


def _segments(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])


def _valid(indices: torch.Tensor, num: torch.Tensor) -> list[list[int]]:
    """Each query block's listed key blocks (the first ``num`` of its indices)."""
    return [row[: int(n)].tolist() for row, n in zip(indices[0, 0], num[0, 0], strict=True)]


def _same_blocks(ours, theirs) -> None:
    assert torch.equal(ours.kv_num_blocks, theirs.kv_num_blocks)
    assert _valid(ours.kv_indices, ours.kv_num_blocks) == _valid(theirs.kv_indices, theirs.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)
    assert _valid(ours.full_kv_indices, ours.full_kv_num_blocks) == _valid(
        theirs.full_kv_indices, theirs.full_kv_num_blocks
    )
    assert ours.seq_lengths == theirs.seq_lengths


CASES = [[5], [128], [300, 7, 129, 1, 400], [1000, 24], [1, 1, 1, 256, 255, 3]]


@pytest.mark.parametrize("lengths", CASES)
def test_document_causal_blocks_are_torchs(lengths, monkeypatch):
    monkeypatch.setattr(bm, "CHUNK_ELEMENTS", 3 * bm.BLOCK * bm.BLOCK)  # several chunks, a ragged last one
    seg = _segments(lengths)
    total = seg.numel()

    def rule(b, h, q, kv):
        return (seg[q] == seg[kv]) & (q >= kv)

    theirs = create_block_mask(rule, None, None, total, total, device="cpu")
    _same_blocks(bm.document_causal_block_mask(seg), theirs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_tree_blocks_are_torchs(seed, monkeypatch):
    monkeypatch.setattr(bm, "CHUNK_ELEMENTS", 5 * bm.BLOCK * bm.BLOCK)
    g = torch.Generator().manual_seed(seed)
    branch, root, run = [], [], 0
    for _ in range(3):  # documents: a prefix run, then segment runs pointing at it
        prefix = run
        branch += [prefix] * int(torch.randint(1, 300, (), generator=g))
        root += [prefix] * (len(branch) - len(root))
        run += 1
        for _ in range(int(torch.randint(1, 5, (), generator=g))):
            n = int(torch.randint(1, 200, (), generator=g))
            branch += [run] * n
            root += [prefix] * n
            run += 1
    branch_t, root_t = torch.tensor(branch), torch.tensor(root)
    total = branch_t.numel()

    def rule(b, h, q, kv):
        return (q >= kv) & ((branch_t[kv] == branch_t[q]) | (branch_t[kv] == root_t[q]))

    theirs = create_block_mask(rule, None, None, total, total, device="cpu")
    _same_blocks(bm.prefix_tree_block_mask(branch_t, root_t), theirs)


def test_flex_attention_through_the_mask_equals_a_dense_masked_softmax():
    seg = _segments([70, 200, 3, 150])
    total, heads, dim = seg.numel(), 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, total, dim, generator=g, dtype=torch.float64) for _ in range(3))
    out = flex_attention(q, k, v, block_mask=bm.document_causal_block_mask(seg))
    idx = torch.arange(total)
    allowed = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(dim)
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("total", [0, -3, 2.0, True, "128"])
def test_total_must_be_a_positive_int(total):
    with pytest.raises(
        InputError,
        match=rf"block_mask: argument 'total' expected an int >= 1 \(tokens\), received {re.escape(repr(total))}",
    ):
        bm.block_mask(lambda b, h, q, kv: q >= kv, total, torch.device("cpu"))


def test_bad_segment_ids_are_refused_by_name():
    with pytest.raises(InputError, match="argument 'seg' expected at least one token"):
        bm.document_causal_block_mask(torch.zeros(0, dtype=torch.int32))
    with pytest.raises(InputError, match="argument 'branch' expected at least one token"):
        bm.prefix_tree_block_mask(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ShapeError, match="argument 'seg' has the wrong dtype"):  # float ids: the annotation's check
        bm.document_causal_block_mask(torch.zeros(4))
    with pytest.raises(ShapeError, match="root"):  # another length than branch
        bm.prefix_tree_block_mask(torch.zeros(4, dtype=torch.int64), torch.zeros(5, dtype=torch.int64))
