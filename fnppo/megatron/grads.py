"""Gradient finalization: Megatron's ``finalize_model_grads`` plus one global grad norm.

The data-parallel reduction of gradients is the step most easily lost in a refactor: Megatron's
schedule calls ``config.finalize_model_grads_func`` only if it is set, and silently skips it
otherwise. In fnppo the schedule is driven by :func:`fnppo.steps.train.train_step`, which installs
:func:`finalize_grads` itself and raises :class:`FinalizeNotCalledError` if the schedule returns
without having called it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads
from torch import nn

from fnppo.core.errors import InputError, input_error
from fnppo.megatron.parallel import ParallelLayout, current_layout

__all__ = ["GradStats", "finalize_grads", "grad_norm", "FinalizeNotCalledError"]


class FinalizeNotCalledError(RuntimeError):
    """Megatron's schedule returned without reducing gradients (``finalize_model_grads`` not run)."""


@dataclass(frozen=True)
class GradStats:
    """Result of :func:`finalize_grads`.

    ``grad_norm``: global L2 norm of the finalized (reduced, scaled) gradients, counting every unique
    parameter once: tensor-parallel duplicates (e.g. norms) once per TP group, the tied output
    embedding once. ``finite``: whether it is finite (a non-finite norm means some gradient is
    NaN/inf, and the optimizer step must be skipped).
    """

    grad_norm: torch.Tensor
    finite: bool


def _param_is_unique(param: torch.nn.Parameter, tp_rank: int) -> bool:
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def _buffer_sq_sum(buffer, distributed: bool, rank_for_unique: int) -> torch.Tensor | None:
    """Sum of squared grads of the unique params this rank holds in one DDP grad buffer."""
    # Shard bounds per bucket (buffer coordinates); param positions from the buffer's own
    # index map (it includes the alignment padding that bucket-local offsets ignore).
    bounds = []
    for bucket in buffer.buckets:
        n = bucket.grad_data.numel()
        if distributed:
            size = buffer.data_parallel_world_size
            rank = dist.get_rank(buffer.data_parallel_group)
            bounds.append((bucket.offset + rank * (n // size), bucket.offset + (rank + 1) * (n // size)))
        else:
            bounds.append((bucket.offset, bucket.offset + n))
    total = None
    for param, (a, b, bucket_id) in buffer.param_index_map.items():
        if not _param_is_unique(param, rank_for_unique):
            continue
        lo, hi = bounds[bucket_id]
        a2, b2 = max(a, lo), min(b, hi)
        if a2 >= b2:
            continue
        sq = buffer.grad_data[a2:b2].float().square().sum()
        total = sq if total is None else total + sq
    return total


def grad_norm(model_chunks: Sequence[nn.Module], *, layout: ParallelLayout | None = None) -> torch.Tensor:
    r"""Global gradient L2 norm over unique parameters of DDP-wrapped Megatron model chunks.

    .. math:: \|g\|_2 = \sqrt{\sum_{p\ \text{unique}} \sum_i g_{p,i}^2}

    Reads the DDP grad buffers (``main_grad``). With the distributed optimizer each data-parallel
    rank holds only its reduced shard of every bucket, so each rank sums its shard and the squares are
    summed over the whole world; otherwise every rank holds the full reduced gradient and the sum
    runs over the model-parallel group only. Same rule as Megatron's optimizer
    (``get_grad_norm_fp32``), computed once. Collective; returns an fp32 0-dim tensor on every rank.

    Mixture-of-Experts weights live in the chunks' expert buffers: the experts of different
    expert-parallel ranks are different parameters, so their squares are summed over the expert grid
    (expert-TP x EP x PP; the whole world with the distributed optimizer, each expert-data-parallel
    rank holding its shard), never deduplicated across EP ranks; parameters replicated over expert
    TP count on expert-TP rank 0 only.
    """
    layout = layout or current_layout()
    tp_rank, etp_rank = layout.tp_rank, layout.etp_rank
    distributed = False
    dense = expert = None
    for chunk in model_chunks:
        ddp_cfg = getattr(chunk, "ddp_config", None)
        if ddp_cfg is None:
            raise _not_wrapped("grad_norm", chunk)
        distributed = distributed or ddp_cfg.use_distributed_optimizer
        for buffer in chunk.buffers:
            sq = _buffer_sq_sum(buffer, ddp_cfg.use_distributed_optimizer, tp_rank)
            dense = sq if dense is None else dense if sq is None else dense + sq
        for buffer in chunk.expert_parallel_buffers:
            sq = _buffer_sq_sum(buffer, ddp_cfg.use_distributed_optimizer, etp_rank)
            expert = sq if expert is None else expert if sq is None else expert + sq
    device = model_chunks[0].buffers[0].grad_data.device if model_chunks and model_chunks[0].buffers else "cpu"
    zero = torch.zeros((), dtype=torch.float32, device=device)
    sums = torch.stack([zero if dense is None else dense.to(device), zero if expert is None else expert.to(device)])
    if distributed:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    else:
        dense_part, expert_part = sums[:1].clone(), sums[1:].clone()
        dist.all_reduce(dense_part, op=dist.ReduceOp.SUM, group=layout.mp_group)
        dist.all_reduce(expert_part, op=dist.ReduceOp.SUM, group=layout.etmp_group)
        sums = torch.cat([dense_part, expert_part])
    return sums.sum().sqrt()


class NotWrappedError(InputError, TypeError):
    """Model chunks not wrapped by ``fnppo.wrap_ddp``: an :class:`~fnppo.core.errors.InputError` (the
    documented type), and a ``TypeError`` as before, so that ``except TypeError`` still catches it."""


def _not_wrapped(fn: str, chunk: nn.Module) -> NotWrappedError:
    expected = "Megatron DistributedDataParallel chunks (fnppo.wrap_ddp)"
    return NotWrappedError(str(input_error(fn, "model_chunks", expected, type(chunk).__name__)))


def finalize_grads(
    model_chunks: Sequence[nn.Module], *, num_tokens: torch.Tensor | None = None, layout: ParallelLayout | None = None
) -> GradStats:
    """Finalize gradients after the backward passes of a step, and measure them.

    Calls Megatron's ``finalize_model_grads``: the data-parallel reduction (all-reduce, or
    reduce-scatter with the distributed optimizer), the all-reduce of tied-embedding and
    position-embedding grads across pipeline stages, TP-replicated layer-norm grads, and, when
    ``num_tokens`` is given, division of all grads by the global token count; for MoE models the
    expert weights' reduction over the expert-data-parallel group and the update of the routers'
    expert bias (aux-loss-free balancing). Then computes the
    global grad norm once over unique parameters (:func:`grad_norm`).

    Reference: Megatron-LM ``megatron/core/distributed/finalize_model_grads.py``.
    """
    for chunk in model_chunks:
        if getattr(chunk, "ddp_config", None) is None:
            raise _not_wrapped("finalize_grads", chunk)
    finalize_model_grads(list(model_chunks), num_tokens=num_tokens)
    norm = grad_norm(model_chunks, layout=layout)
    return GradStats(grad_norm=norm, finite=bool(torch.isfinite(norm).item()))
