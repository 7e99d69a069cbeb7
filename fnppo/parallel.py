"""The parallel layout: initialise Megatron's process groups (CPU with gloo or CUDA) and read them.
Implementation: :mod:`fnppo.megatron.parallel`."""

from __future__ import annotations

from fnppo.megatron.parallel import ParallelLayout as ParallelLayout
from fnppo.megatron.parallel import current_layout as current_layout
from fnppo.megatron.parallel import destroy_parallel as destroy_parallel
from fnppo.megatron.parallel import init_parallel as init_parallel
from fnppo.megatron.parallel import is_rank_zero as is_rank_zero

__all__ = [
    "ParallelLayout",
    "init_parallel",
    "current_layout",
    "destroy_parallel",
    "is_rank_zero",
]
