"""Optional Triton kernels (CUDA only), imported lazily.

Importing this package never imports Triton: the CPU path, CI and users without Triton need
nothing from it. :func:`triton_available` says whether the kernels can be used, and
:func:`logprob_kernels`, :func:`linear_logprob_kernels` and :func:`rope_kernels` return the kernel
modules (importing Triton on first use).

Set ``TRITON_INTERPRET=1`` before the first import to run the kernels in Triton's interpreter on
CPU tensors (slow; for checking the kernels without a GPU).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

__all__ = [
    "triton_available",
    "triton_interpreting",
    "logprob_kernels",
    "linear_logprob_kernels",
    "distill_kernels",
    "rope_kernels",
]


def triton_interpreting() -> bool:
    """Whether Triton's CPU interpreter is requested (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (it is not needed on CPU)."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # noqa: BLE001 - any import failure means "no Triton"
        return False
    return True


def logprob_kernels() -> ModuleType:
    """The Triton log-prob/entropy kernels (imports Triton; raise ImportError where it is absent)."""
    return importlib.import_module("fnppo.core.kernels.logprob_triton")


def linear_logprob_kernels() -> ModuleType:
    """The Triton kernels of the fused output layer (imports Triton; raise ImportError where it is absent)."""
    return importlib.import_module("fnppo.core.kernels.linear_logprob_launch")


def distill_kernels() -> ModuleType:
    """The Triton kernels of the fused output layer with a divergence to a teacher (imports Triton; raise
    ImportError where it is absent)."""
    return importlib.import_module("fnppo.core.kernels.linear_distill_triton")


def rope_kernels() -> ModuleType:
    """The Triton rotary-embedding kernels (imports Triton; raise ImportError where it is absent)."""
    return importlib.import_module("fnppo.core.kernels.rope_triton")
