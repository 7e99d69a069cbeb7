"""The batch-invariant mode's kernels as one value: :class:`InvariantKernels`, chosen once.

``ModelConfig(batch_invariant=...)`` takes ``True`` (the platform's default: :data:`InvariantKernels.FAST`
on CUDA, :data:`InvariantKernels.TORCH` elsewhere; :func:`resolve_kernels`) or an :class:`InvariantKernels`
record. The record is chosen when Megatron's config is built
(:func:`fnppo.megatron.megatron_config.transformer_config`), stored on it as one attribute and read
back by one function, :func:`kernels_of`; every place the mode changes (the layer spec's experts, the
attention, the MoE router, the numerics around the schedule, the micro-batch shaping) reads the field
of the record that says what to do, never a name. No environment variable is read here: a script
that wants one as its default turns it into a record itself (:func:`kernels_named`).

A new kernel path is a new record (its fields say which behaviours it takes), or a new field read in
the one place that implements it (CONTRIBUTING.md, "Add a kernel path").
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from fnppo.core.errors import check_bool_fields, check_positive_int, input_error

__all__ = ["InvariantKernels", "CUDA_MIN_ROWS", "resolve_kernels", "kernels_of", "kernels_named", "KERNELS_ATTRIBUTE"]

CUDA_MIN_ROWS = 2048
"""The fewest tokens a micro-batch has with :data:`InvariantKernels.FAST` (fnppo's steps pad it). On one H200 (bf16, the
Qwen2.5-1.5B widths and vocabulary), cuBLAS gave a row other bits than in a 16,384-row product only at 333
rows or fewer (the ``fc2`` product, K = 8,960: split-K), and torch's row reductions over the vocabulary
likewise; from 1,000 rows on every product and reduction gave the same bits (``benchmarks/batch_invariance.py
--probe``)."""

KERNELS_ATTRIBUTE = "fnppo_invariant_kernels"
"""The attribute of Megatron's ``TransformerConfig`` that holds the record (None outside the mode)."""


@dataclasses.dataclass(frozen=True)
class InvariantKernels:
    """Which kernels the batch-invariant mode runs: each field one behaviour, read where it is implemented.

    Attributes:
        name: how messages and docs name the record.
        tiles: the schedule runs inside fnppo's fixed-tile torch kernels
            (:func:`fnppo.core.ops.batch_invariant.batch_invariant`: products, norms, softmaxes, reductions).
        megatron_products: the matrix products run in Megatron-core's persistent Triton matmul
            (with Transformer Engine's GEMM / RMSNorm patches where it is installed) instead of the tiles;
            CUDA only.
        min_rows: the steps pad every micro-batch to at least this many tokens (None: as collated);
            the library kernels keep a row's bits from this many rows on.
        flex_attention: the attention runs in one flex-attention launch over sequences that the steps
            start at multiples of its key block (CUDA; elsewhere the per-sequence kernel
            :func:`fnppo.core.kernels.invariant.sequence_attention`).
        stacked_experts: an MoE model computes its experts as one grouped GEMM per projection
            (``moe_experts="stacked"``; else ``"sequential"``, whose products the tiles take).
        router_tiles: an MoE router computes its logits in fixed row tiles
            (:func:`fnppo.megatron.moe.invariant_router_logits`).
        fusions: Megatron's fused element-wise kernels stay on by default (off when the tiles' torch
            function mode must see the plain element-wise ops).
        context_parallel: context parallelism keeps the bits of one process (the per-sequence attention
            computes a rank's rows in their one-process query blocks); False: refused by name.
    """

    name: str
    tiles: bool
    megatron_products: bool = False
    min_rows: int | None = None
    flex_attention: bool = False
    stacked_experts: bool = False
    router_tiles: bool = False
    fusions: bool = False
    context_parallel: bool = True

    FAST: ClassVar[InvariantKernels]
    TORCH: ClassVar[InvariantKernels]
    MEGATRON: ClassVar[InvariantKernels]

    def __post_init__(self) -> None:
        fn = "fnppo.models.InvariantKernels"
        if not isinstance(self.name, str) or not self.name:
            raise input_error(fn, "name", "a non-empty str", repr(self.name))
        check_bool_fields(fn, self)
        check_positive_int(fn, "min_rows", self.min_rows, allow_none=True)
        if self.tiles and self.stacked_experts:  # the grouped GEMM is neither the tiles' nor Megatron's product
            raise input_error(fn, "stacked_experts", "False with tiles=True (experts 'sequential')", "True")
        if self.megatron_products and not self.tiles:
            raise input_error(fn, "megatron_products", "False with tiles=False (the tiles take the rest)", "True")


InvariantKernels.FAST = InvariantKernels(
    name="fast",
    tiles=False,
    min_rows=CUDA_MIN_ROWS,
    flex_attention=True,
    stacked_experts=True,
    router_tiles=True,
    fusions=True,
    context_parallel=False,
)
"""CUDA: the library's own kernels, forward and backward at full speed, on micro-batches the steps shape."""
InvariantKernels.TORCH = InvariantKernels(name="torch", tiles=True)
"""fnppo's fixed-tile torch kernels (any device; the CPU's only choice); context parallelism included."""
InvariantKernels.MEGATRON = InvariantKernels(name="megatron", tiles=True, megatron_products=True)
"""Megatron-core's Triton matmul (and Transformer Engine patches) for the products, the tiles for the rest (CUDA)."""


def resolve_kernels(batch_invariant: Any, *, cuda: bool) -> InvariantKernels | None:
    """The record a ``ModelConfig.batch_invariant`` value stands for on a model built for CUDA or not:
    None for False, the platform's default for True (:data:`InvariantKernels.FAST` on CUDA,
    :data:`InvariantKernels.TORCH` elsewhere), the record itself otherwise.

    Raises:
        InputError: anything but a bool or an :class:`InvariantKernels`.
    """
    if isinstance(batch_invariant, InvariantKernels):
        return batch_invariant
    if not isinstance(batch_invariant, bool):
        raise input_error(
            "ModelConfig", "batch_invariant", "a bool or an fnppo.models.InvariantKernels", repr(batch_invariant)
        )
    if not batch_invariant:
        return None
    return InvariantKernels.FAST if cuda else InvariantKernels.TORCH


def kernels_of(config: Any) -> InvariantKernels | None:
    """The batch-invariant kernels recorded on a Megatron config (:data:`KERNELS_ATTRIBUTE`; None outside
    the mode): the one reader of the choice."""
    kernels = getattr(config, KERNELS_ATTRIBUTE, None)
    return kernels if isinstance(kernels, InvariantKernels) else None


def kernels_named(name: str) -> InvariantKernels:
    """The built-in record called ``name`` (``"fast"``, ``"torch"`` or ``"megatron"``): for scripts that take
    the choice from a command line or an environment variable.

    Raises:
        InputError: another name.
    """
    records = (InvariantKernels.FAST, InvariantKernels.TORCH, InvariantKernels.MEGATRON)
    for record in records:
        if record.name == name:
            return record
    raise input_error("kernels_named", "name", f"one of {[r.name for r in records]}", repr(name))
