"""Grouped matrix product: rows sorted by group, one weight matrix per group, one kernel.

:func:`grouped_matmul` is the product of Mixture-of-Experts layers after token permutation: the
rows of ``x`` are sorted by expert, ``group_ends`` holds the cumulative row counts, and expert
``g``'s rows are multiplied by ``weight[g]``'s transpose. It runs as one grouped GEMM
(``torch._grouped_mm``: CUTLASS on Hopper GPUs, a loop inside one call on CPU), differentiable in
``x`` and ``weight``, without a host synchronization; where that operator cannot take the
operands (float64, sizes not a multiple of 16 bytes, an older torch) a loop of ``matmul`` over the
groups gives the same product (it reads ``group_ends`` on the host).
"""

from __future__ import annotations

import torch

from fnppo.core.errors import describe, input_error
from fnppo.core.typing import Float, Int, Tensor, typechecked

__all__ = ["grouped_matmul", "grouped_mm_supported"]

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(x: Tensor, weight: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands (dtype, 16-byte aligned rows, device)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in _GROUPED_MM_DTYPES or weight.dtype != x.dtype:
        return False
    if x.device.type not in ("cpu", "cuda"):
        return False
    per_16_bytes = 16 // x.element_size()
    return x.shape[-1] % per_16_bytes == 0 and weight.shape[-2] % per_16_bytes == 0


def _loop(x: Tensor, weight: Tensor, group_ends: Tensor) -> Tensor:
    ends = group_ends.tolist()
    starts = [0, *ends[:-1]]
    parts = [x[s:e] @ weight[g].transpose(0, 1) for g, (s, e) in enumerate(zip(starts, ends, strict=True))]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[-2])


@typechecked
def grouped_matmul(
    x: Float[Tensor, "rows k"],
    weight: Float[Tensor, "groups n k"],
    group_ends: Int[Tensor, "groups"],  # noqa: F821
) -> Float[Tensor, "rows n"]:
    """``y[r] = x[r] @ weight[g(r)].T`` where row ``r`` belongs to group ``g(r)``.

    Group ``g`` holds rows ``group_ends[g-1] .. group_ends[g] - 1`` (``group_ends[-1]`` is the
    number of rows; a group may be empty). This is the expert computation of a Mixture-of-Experts
    layer (Shazeer et al., 2017, arXiv:1701.06538; the grouped GEMM of MegaBlocks, Gale et al.,
    2022, arXiv:2211.15841): ``weight`` stacks each expert's ``[out, in]`` matrix as in
    ``torch.nn.Linear``. The gradient of an expert that received no rows is zero.

    Raises:
        InputError: ``x`` and ``weight`` of different dtypes or devices; ``group_ends`` not
            ending at the number of rows is not checked on the GPU path (reading it would
            synchronize the host), so callers pass the cumulative sums of their own counts.
    """
    fn = "fnppo.ops.grouped_matmul"
    if x.dtype != weight.dtype or x.device != weight.device:
        raise input_error(fn, "weight", f"a {x.dtype} tensor on {x.device} (as x)", describe(weight))
    if grouped_mm_supported(x, weight):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=group_ends.to(device=x.device, dtype=torch.int32))
    return _loop(x, weight, group_ends)
