"""The CUDA batch-invariant mode's fast path, in the parts that run without a GPU.

The mode on CUDA keeps the library kernels and shapes their inputs instead (docs/batch-invariance.md):
each packed sequence starts at a multiple of the flex-attention block and every micro-batch has at
least :data:`~fnppo.core.ops.batch_invariant.CUDA_MIN_ROWS` tokens (:mod:`fnppo.steps.plan`), and the
choice of kernels is made once per model. The bits on a GPU are measured by
``benchmarks/batch_invariance.py``; here: the micro-batch shaping keeps every sample's values where
they were, and the kernel choice.
"""

from __future__ import annotations

import torch

import fnppo
from fnppo.core.batching.collate import collate_microbatch, unpack_per_sample
from fnppo.core.ops.batch_invariant import invariant_kernels
from fnppo.steps.plan import min_tokens


def test_micro_batches_are_padded_to_the_minimum_without_moving_a_sample():
    g = torch.Generator().manual_seed(1)
    samples = [
        fnppo.Sample.from_lists(
            torch.randint(0, 50, (3 + i,), generator=g), torch.randint(0, 50, (4,), generator=g), advantages=float(i)
        )
        for i in range(3)
    ]
    for layout, multiple in (("packed", 8), ("padded", 8)):
        mb = collate_microbatch(samples, layout=layout, pad_to_multiple_of=multiple)
        out = min_tokens(mb, 100, multiple)
        rows, length = out.input_ids.shape
        assert rows * length >= 100 and length % multiple == 0, (layout, tuple(out.input_ids.shape))
        assert float(out.loss_mask.sum()) == float(mb.loss_mask.sum())
        for a, c in zip(unpack_per_sample(mb.advantages, mb), unpack_per_sample(out.advantages, out), strict=True):
            assert torch.equal(a, c)
        assert min_tokens(mb, 1, multiple) is mb  # already large enough: unchanged


def test_the_kernel_choice_is_made_once_per_model(monkeypatch):
    monkeypatch.delenv("FNPPO_BATCH_INVARIANT_KERNELS", raising=False)
    assert invariant_kernels(cuda=False) == "torch"
    assert invariant_kernels(cuda=True) == "fast"
    monkeypatch.setenv("FNPPO_BATCH_INVARIANT_KERNELS", "torch")
    assert invariant_kernels(cuda=True) == "torch"
    monkeypatch.setenv("FNPPO_BATCH_INVARIANT_KERNELS", "megatron")
    assert invariant_kernels(cuda=True) == "megatron"
    monkeypatch.setenv("FNPPO_BATCH_INVARIANT_KERNELS", "tiles")
    try:
        invariant_kernels(cuda=True)
    except fnppo.InputError as e:
        assert "FNPPO_BATCH_INVARIANT_KERNELS" in str(e) and "'tiles'" in str(e)
    else:
        raise AssertionError("accepted an unknown kernel set")
