"""Batch-invariant numerics for a block of code: :class:`BatchInvariantOps`, :func:`batch_invariant`.

Inside ``with batch_invariant(True):`` the torch operations a transformer forward is made of run
as the batch-invariant kernels of :mod:`fnppo.core.kernels.invariant`: the bits of a token's
result depend on that token's inputs only, not on how many tokens run with it or where it sits
among them. The swap is a ``torch.overrides.TorchFunctionMode``: it lives on torch's own
(thread-local) mode stack for the duration of the block and is popped afterwards, also on an
exception; no module attribute and no global is changed, and code outside the block (or on other
threads) runs the ordinary kernels.

Swapped (any device):

* products with a weight or batched matrices: ``torch.matmul`` / ``@`` / ``mm`` / ``bmm`` /
  ``addmm`` / ``baddbmm`` / ``torch.nn.functional.linear`` (fixed row tiles);
* norms and softmaxes: ``rms_norm``, ``layer_norm``, ``softmax``, ``log_softmax`` (fixed row tiles);
* reductions over the last dimension of a tensor with rows: ``sum``, ``mean``, ``amax``,
  ``amin``, ``nansum``, ``logsumexp`` (fixed row tiles);
* element-wise kernels whose CPU vector and scalar paths round differently: ``silu``,
  ``sigmoid``, ``rsqrt``, ``gelu``, ``softplus`` (compositions of ``exp``/``sqrt``/``erf``).

Everything else passes through unchanged (indexing, element-wise arithmetic, ``exp``, ``sin``,
``cos``: checked to give a value the same bits at any offset). ``products=False`` leaves the
matrix products to another batch-invariant implementation (on CUDA, Megatron-core's persistent
Triton matmul: :func:`fnppo.megatron.numerics.batch_invariant_numerics`).

On CUDA the tiles are not needed (:data:`~fnppo.megatron.config.InvariantKernels.FAST`):
cuBLAS's GEMMs give a row the same bits whatever the number of rows once that number is large enough
for the library not to split the reduction (split-K), and row-wise reductions and norms run one program
per row at such sizes; so fnppo's steps give every micro-batch at least
:data:`~fnppo.megatron.config.CUDA_MIN_ROWS` tokens and
start every packed sequence at a multiple of the attention's key block
(:func:`fnppo.megatron.numerics.microbatch_shape`),
and the model runs its ordinary kernels, forward and backward.

Not covered (the results are batch-invariant, not invariant to these): a different tensor-,
context- or expert-parallel layout (other reduction orders), another device, dtype, torch or
library version, or thread count; and anything computed outside the block.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fnppo.core.kernels import invariant as inv

__all__ = ["BatchInvariantOps", "batch_invariant"]

_REDUCTIONS = {
    torch.sum: "sum",
    torch.Tensor.sum: "sum",
    torch.mean: "mean",
    torch.Tensor.mean: "mean",
    torch.amax: "amax",
    torch.Tensor.amax: "amax",
    torch.amin: "amin",
    torch.Tensor.amin: "amin",
    torch.nansum: "nansum",
    torch.Tensor.nansum: "nansum",
    torch.logsumexp: "logsumexp",
    torch.Tensor.logsumexp: "logsumexp",
}


def _last_dim_only(x: Any, dim: Any) -> bool:
    """A reduction over the last dimension alone of a tensor with rows."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
        return False
    if isinstance(dim, (tuple, list)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim % x.dim() == x.dim() - 1


class BatchInvariantOps(TorchFunctionMode):
    """The mode of :func:`batch_invariant`: torch functions -> batch-invariant kernels.

    Args:
        tile: rows per fixed tile (None: :data:`fnppo.core.kernels.invariant.DEFAULT_TILE_ROWS` by device).
        products: whether matrix products are swapped (False while Megatron's Triton matmul is on).
    """

    def __init__(self, tile: int | None = None, products: bool = True) -> None:
        super().__init__()
        self.tile = tile
        self.products = products
        self._table = self._build_table()

    def _build_table(self) -> dict[Callable, Callable]:
        t = self.tile
        table: dict[Callable, Callable] = {
            F.silu: lambda x, inplace=False: inv.invariant_silu(x),
            torch.sigmoid: inv.invariant_sigmoid,
            torch.Tensor.sigmoid: inv.invariant_sigmoid,
            F.sigmoid: inv.invariant_sigmoid,
            torch.rsqrt: inv.invariant_rsqrt,
            torch.Tensor.rsqrt: inv.invariant_rsqrt,
            F.gelu: lambda x, approximate="none": inv.invariant_gelu(x, approximate),
            F.softplus: lambda x, beta=1.0, threshold=20.0: inv.invariant_softplus(x, beta, threshold),
            F.rms_norm: lambda x, shape, weight=None, eps=None: self._norm(
                x, shape, lambda y: inv.invariant_rms_norm(y, weight, eps, tile=t), F.rms_norm, (shape, weight, eps)
            ),
            F.layer_norm: lambda x, shape, weight=None, bias=None, eps=1e-5: self._norm(
                x,
                shape,
                lambda y: inv.invariant_layer_norm(y, weight, bias, eps, tile=t),
                F.layer_norm,
                (shape, weight, bias, eps),
            ),
        }
        for f in (torch.softmax, torch.Tensor.softmax, F.softmax):
            table[f] = functools.partial(self._softmax, inv.invariant_softmax)
        for f in (torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax):
            table[f] = functools.partial(self._softmax, inv.invariant_log_softmax)
        if self.products:
            table.update(
                {
                    torch.matmul: self._matmul,
                    torch.Tensor.matmul: self._matmul,
                    torch.Tensor.__matmul__: self._matmul,
                    torch.mm: self._matmul,
                    torch.Tensor.mm: self._matmul,
                    torch.bmm: self._matmul,
                    torch.Tensor.bmm: self._matmul,
                    F.linear: lambda x, w, b=None: inv.invariant_linear(x, w, b, tile=t),
                    torch.addmm: self._addmm,
                    torch.baddbmm: self._addmm,
                    torch.Tensor.addmm: self._addmm,
                    torch.Tensor.baddbmm: self._addmm,
                }
            )
        return table

    def _matmul(self, a: torch.Tensor, b: torch.Tensor, *, out: Any = None) -> torch.Tensor:
        if out is not None:
            return torch.matmul(a, b, out=out)
        return inv.invariant_matmul(a, b, tile=self.tile)

    def _addmm(self, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> Any:
        prod = inv.invariant_matmul(a, b, tile=self.tile)
        if alpha != 1:
            prod = prod * alpha
        if beta == 0:
            return prod
        return c + prod if beta == 1 else c * beta + prod

    @staticmethod
    def _norm(x: torch.Tensor, shape: Any, impl: Callable, plain: Callable, rest: tuple) -> torch.Tensor:
        if len(tuple(shape)) != 1:  # a norm over several trailing dims: not a row-wise kernel here
            return plain(x, shape, *rest[1:])
        return impl(x)

    def _softmax(self, impl: Callable, x: torch.Tensor, dim: Any = None, *args: Any, dtype: Any = None, **kw: Any):
        if args and isinstance(args[0], torch.dtype):  # Tensor.softmax(dim, dtype)
            dtype = args[0]
        if dim is None:
            dim = -1
        return impl(x, dim, dtype=dtype, tile=self.tile)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        impl = self._table.get(func)
        if impl is not None:
            return impl(*args, **kwargs)
        op = _REDUCTIONS.get(func)
        if op is not None:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if _last_dim_only(args[0], dim) and "dtype" not in kwargs and "out" not in kwargs:
                keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
                return inv.invariant_row_reduce(op, args[0], keepdim=bool(keepdim), tile=self.tile)
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant(enabled: bool, *, tile: int | None = None, products: bool = True) -> Iterator[None]:
    """Run the block with batch-invariant kernels when ``enabled`` (see the module docstring);
    with ``enabled`` False nothing changes. ``tile`` and ``products`` as :class:`BatchInvariantOps`."""
    if not enabled:
        yield
        return
    with BatchInvariantOps(tile=tile, products=products):
        yield
