"""The CUDA batch-invariant mode's fast path, in the parts that run without a GPU.

The mode on CUDA keeps the library kernels and shapes their inputs instead (docs/batch-invariance.md):
each packed sequence starts at a multiple of the flex-attention block and every micro-batch has at
least :data:`~fnppo.megatron.config.CUDA_MIN_ROWS` tokens (:mod:`fnppo.steps.plan`), and the
choice of kernels is made once per model. The bits on a GPU are measured by
``benchmarks/batch_invariance.py``; here: the micro-batch shaping keeps every sample's values where
they were, and the kernel choice.
"""

from __future__ import annotations

import torch

import fnppo
from fnppo.core.batching.collate import collate_microbatch, unpack_per_sample
from fnppo.megatron.config import InvariantKernels, kernels_named, resolve_kernels
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


def test_the_kernel_choice_is_one_value_chosen_once(monkeypatch):
    """``True`` is the platform's record, a record is itself, anything else is refused by name; no
    environment variable changes the choice (scripts turn a name into a record with ``kernels_named``)."""
    monkeypatch.setenv("FNPPO_BATCH_INVARIANT_KERNELS", "torch")  # read by no library code
    assert resolve_kernels(True, cuda=False) is InvariantKernels.TORCH
    assert resolve_kernels(True, cuda=True) is InvariantKernels.FAST
    assert resolve_kernels(False, cuda=True) is None
    assert resolve_kernels(InvariantKernels.MEGATRON, cuda=True) is InvariantKernels.MEGATRON
    assert kernels_named("torch") is InvariantKernels.TORCH
    for bad in ("fast", 1, None):
        try:
            resolve_kernels(bad, cuda=True)
        except fnppo.InputError as e:
            assert "batch_invariant" in str(e) and repr(bad) in str(e)
        else:
            raise AssertionError(f"accepted {bad!r}")
    for call, arg in (
        (lambda: kernels_named("tiles"), "name"),
        (
            lambda: fnppo.ModelConfig(
                num_layers=1,
                hidden_size=8,
                num_attention_heads=2,
                ffn_hidden_size=8,
                vocab_size=8,
                max_seq_len=8,
                batch_invariant="yes",
            ),
            "batch_invariant",
        ),
        (lambda: InvariantKernels(name="x", tiles="no"), "tiles"),
        (lambda: InvariantKernels(name="x", tiles=True, stacked_experts=True), "stacked_experts"),
        (lambda: InvariantKernels(name="x", tiles=False, megatron_products=True), "megatron_products"),
        (lambda: InvariantKernels(name="x", tiles=False, min_rows=0), "min_rows"),
        (lambda: InvariantKernels(name="", tiles=False), "name"),
    ):
        try:
            call()
        except fnppo.InputError as e:
            assert f"'{arg}'" in str(e), str(e)
        else:
            raise AssertionError(f"accepted a bad {arg}")
