"""Context parallelism (CP) for packed micro-batches: the load-balanced token sharding and exact attention.

Sharding (Megatron's / Transformer Engine's THD layout for CP). Every packed segment ``k`` of a
micro-batch (``cu_seqlens[k] .. cu_seqlens[k+1]``, a length ``L_k`` divisible by ``2*cp``) is cut
into ``2*cp`` chunks of ``c_k = L_k / (2*cp)`` tokens; CP rank ``r`` holds chunks ``r`` and
``2*cp-1-r`` of every segment, in segment order::

    local(r) = concat_k [ cu[k] + r*c_k + (0..c_k-1),  cu[k] + (2cp-1-r)*c_k + (0..c_k-1) ]

so every rank holds ``T / cp`` tokens and the same amount of causal attention work (an early and a
late chunk). ``cu_seqlens`` stays global (the rank's own segment ``k`` has ``L_k / cp`` tokens):
Megatron's RoPE for THD (``_apply_rotary_pos_emb_thd`` with the CP group) reads exactly this layout
and rotates every token with its true position. Every per-token field of a
:class:`~fnppo.core.batching.sample.Microbatch` is sharded the same way (:func:`shard_microbatch`), so per-token
functions (log-probs, entropy, loss terms) run unchanged on the shard.

Attention (:func:`context_parallel_attention`): each rank all-gathers the keys and values of the
whole micro-batch over the CP group (one all-gather per layer and tensor), puts them in global
order and computes document-causal attention of its own queries against them,

    out_i = sum_j softmax_j(scale * q_i . k_j + M_ij) v_j,  M_ij = 0 iff seg(pos_i) == seg(j), j <= pos_i

(``pos_i`` the global position of local query ``i``). Exact (the same formula as the dense path).
Backward: the gradient of the gathered keys/values is summed over the CP group and each rank keeps
its own rows (one reduce-scatter per tensor; gloo and NCCL both have it).
Memory: every rank holds the full K/V of the micro-batch per layer while it is in use, ``2 * T *
groups_per_tp_rank * head_dim`` elements (and saves it for backward), i.e. ``cp`` times the local
K/V; queries, scores and everything else stay local (``T / cp`` rows). A ring exchange would
bound K/V at ``2 / cp`` of that; not implemented.

Batch-invariant mode (:func:`context_parallel_sequence_attention`): the same gathered keys and
values, and each rank's rows computed in the query blocks of
:func:`fnppo.core.kernels.invariant.sequence_attention` that hold them, with the shapes they have on
one process, so a token's output has the bits of ``cp = 1`` (``docs/batch-invariance.md``).

Reference: Megatron-LM context parallelism (load-balanced chunks ``r`` and ``2cp-1-r``); Ring
Attention, arXiv:2310.01889 (Liu et al.); packed sequences, arXiv:2107.02027.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fnppo.core.batching.sample import Microbatch
from fnppo.core.errors import input_error
from fnppo.core.kernels.invariant import DEFAULT_BLOCK, sequence_attention_rows
from fnppo.core.typing import Float, Tensor, typechecked

__all__ = [
    "cp_token_index",
    "shard_tokens",
    "unshard_tokens",
    "shard_microbatch",
    "all_gather_tokens",
    "gather_tokens",
    "context_parallel_attention",
    "context_parallel_sequence_attention",
    "gather_per_sample",
]

_PER_TOKEN = (
    "input_ids",
    "position_ids",
    "labels",
    "loss_mask",
    "old_logprobs",
    "advantages",
    "ref_logprobs",
    "rollout_logprobs",
    "seq_ids",
    "values",
    "returns",
    "routed_experts",
    "staleness",
    "teacher_topk_ids",
    "teacher_topk_logprobs",
    "ce_mask",
)


def _boundaries(cu_seqlens: Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]


def cp_token_index(cu_seqlens: Tensor | Sequence[int], cp: int, rank: int, *, device: Any = None) -> Tensor:
    """Global positions of the tokens CP rank ``rank`` holds, in its local order (int64 ``[T / cp]``).

    For segment ``k`` of length ``L_k`` (``c_k = L_k / (2 cp)``): ``cu[k] + r c_k + (0..c_k-1)``,
    then ``cu[k] + (2cp-1-r) c_k + (0..c_k-1)``; segments in order (see the module docstring).

    Raises:
        InputError: ``cp`` or ``rank`` out of range, a segment length not divisible by ``2*cp``,
            ``cu_seqlens`` not non-decreasing from 0.
    """
    fn = "fnppo.core.batching.context_parallel.cp_token_index"
    if not isinstance(cp, int) or cp < 1:
        raise input_error(fn, "cp", "an int >= 1", repr(cp))
    if not isinstance(rank, int) or not 0 <= rank < cp:
        raise input_error(fn, "rank", f"an int in [0, {cp})", repr(rank))
    cu = _boundaries(cu_seqlens)
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise input_error(fn, "cu_seqlens", "non-decreasing cumulative lengths from 0", repr(cu)[:200])
    parts = []
    for k, (a, b) in enumerate(zip(cu, cu[1:])):
        if (b - a) % (2 * cp):
            raise input_error(fn, f"cu_seqlens (segment {k})", f"a length divisible by 2*cp = {2 * cp}", str(b - a))
        c = (b - a) // (2 * cp)
        parts += [
            torch.arange(a + rank * c, a + (rank + 1) * c),
            torch.arange(a + (2 * cp - 1 - rank) * c, a + (2 * cp - rank) * c),
        ]
    out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return out.to(device) if device is not None else out


def shard_tokens(x: Tensor, cu_seqlens: Tensor | Sequence[int], cp: int, rank: int, *, dim: int = -1) -> Tensor:
    """``x`` restricted to rank ``rank``'s tokens along ``dim`` (``index_select`` with :func:`cp_token_index`)."""
    idx = cp_token_index(cu_seqlens, cp, rank, device=x.device)
    if x.shape[dim] != (_boundaries(cu_seqlens)[-1]):
        raise input_error(
            "fnppo.core.batching.context_parallel.shard_tokens",
            "x",
            f"size {_boundaries(cu_seqlens)[-1]} along dim {dim} (cu_seqlens[-1])",
            str(tuple(x.shape)),
        )
    return x.index_select(dim, idx)


def unshard_tokens(shards: Sequence[Tensor], cu_seqlens: Tensor | Sequence[int], *, dim: int = -1) -> Tensor:
    """The inverse of :func:`shard_tokens`: the ``cp = len(shards)`` shards (rank order) in global order."""
    cp = len(shards)
    cat = torch.cat(list(shards), dim=dim)
    return cat.index_select(dim, _inverse_order(cu_seqlens, cp, cat.device))


def _inverse_order(cu_seqlens: Tensor | Sequence[int], cp: int, device: Any) -> Tensor:
    """``perm`` with ``concat_r(local(r))[perm] = 0..T-1``: rank-ordered gathered tokens -> global order."""
    order = torch.cat([cp_token_index(cu_seqlens, cp, r) for r in range(cp)])
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    return inv.to(device)


def shard_microbatch(mb: Microbatch, cp: int, rank: int) -> Microbatch:
    """The CP rank's share of a packed micro-batch: per-token fields sharded, the rest unchanged.

    ``input_ids``, ``position_ids`` (global positions kept), ``labels``, ``loss_mask``, log-probs,
    ``advantages`` and ``seq_ids`` become ``[1, T / cp]`` (``routed_experts`` ``[1, T / cp, layers, topk]``:
    each token keeps its route); ``cu_seqlens``, ``max_seqlen``, the
    static lengths and multi-modal fields stay those of the whole micro-batch. ``cp == 1``: ``mb``.

    Raises:
        InputError: a padded-layout micro-batch (CP needs the packed layout), or a segment length
            not divisible by ``2*cp`` (pad with :func:`fnppo.core.batching.sample.padding_multiple`).
    """
    if cp == 1:
        return mb
    if not mb.is_packed or mb.cu_seqlens is None:
        raise input_error(
            "fnppo.core.batching.context_parallel.shard_microbatch",
            "mb",
            "a packed micro-batch (context parallelism needs layout='packed')",
            f"layout={mb.layout!r}",
        )
    cu = _boundaries(mb.cu_seqlens)
    idx = cp_token_index(cu, cp, rank, device=mb.input_ids.device)
    changes = {name: getattr(mb, name).index_select(1, idx) for name in _PER_TOKEN if getattr(mb, name) is not None}
    return dataclasses.replace(mb, **changes)


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (rank order); backward: the summed gradient's own rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather(list(out.chunk(size)), x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        size = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def all_gather_tokens(x: Tensor, group: Any) -> Tensor:
    """Differentiable all-gather of ``x`` along dim 0 over ``group`` (rank order).

    Backward: the gradients of all ranks summed, this rank's rows (a reduce-scatter).
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllGather.apply(x, group)


def gather_tokens(x: Tensor, cu_seqlens: Tensor | Sequence[int], group: Any, *, dim: int = 0) -> Tensor:
    """Every CP rank's shard of ``x`` (tokens along ``dim``), gathered and put in global token order."""
    cp = 1 if group is None else dist.get_world_size(group)
    if cp == 1:
        return x
    moved = x.movedim(dim, 0)
    full = all_gather_tokens(moved, group).index_select(0, _inverse_order(cu_seqlens, cp, x.device))
    return full.movedim(0, dim)


def _cp_mask(cu: list[int], cp: int, rank: int, device: Any) -> Tensor:
    """``[T / cp, T]`` boolean mask, True where local query ``i`` may attend to global key ``j``."""
    total = cu[-1]
    bounds = torch.tensor(cu[1:], dtype=torch.int64, device=device)
    pos = cp_token_index(cu, cp, rank, device=device)
    keys = torch.arange(total, device=device)
    seg_q = torch.searchsorted(bounds, pos, right=True)
    seg_k = torch.searchsorted(bounds, keys, right=True)
    return (seg_q[:, None] == seg_k[None, :]) & (keys[None, :] <= pos[:, None])


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens: Tensor,
    group: Any,
    *,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Exact document-causal attention of this CP rank's queries over the whole micro-batch.

    ``query [T/cp, heads, d]``, ``key``/``value [T/cp, groups, d]`` hold this rank's tokens in the
    layout of :func:`cp_token_index`; ``cu_seqlens`` is the global segmentation. Keys and values are
    gathered over ``group`` (:func:`gather_tokens`, differentiable) and
    ``out_i = sum_j softmax_j(scale q_i.k_j + M_ij) v_j`` with ``M_ij = 0`` iff key ``j`` lies in the
    segment of query ``i``'s global position ``pos_i`` and ``j <= pos_i`` (else ``-inf``); GQA as
    in :func:`fnppo.megatron.packed_attention.packed_causal_attention`. Kernel: SDPA with the ``[T/cp, T]`` mask.

    Returns:
        ``[T/cp, heads, d_v]``, this rank's outputs in its local order.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    cu = _boundaries(cu_seqlens)
    if query.shape[0] * cp != cu[-1]:
        raise input_error(
            "fnppo.core.batching.context_parallel.context_parallel_attention",
            "query",
            f"{cu[-1] // cp} tokens (cu_seqlens[-1] / cp)",
            str(tuple(query.shape)),
        )
    k_full = gather_tokens(key, cu, group)
    v_full = gather_tokens(value, cu, group)
    mask = _cp_mask(cu, cp, rank, query.device)
    scale = 1.0 / math.sqrt(query.shape[-1]) if softmax_scale is None else float(softmax_scale)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, k_full, v_full))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.squeeze(0).transpose(0, 1)


@typechecked
def context_parallel_sequence_attention(
    query: Float[Tensor, "local heads head_dim"],
    key: Float[Tensor, "local groups head_dim"],
    value: Float[Tensor, "local groups v_dim"],
    cu_seqlens: Tensor,
    group: Any,
    *,
    softmax_scale: float | None = None,
    block: int = DEFAULT_BLOCK,
) -> Float[Tensor, "local heads v_dim"]:
    """Batch-invariant attention of this CP rank's queries: the bits of the unsharded micro-batch.

    The same formula as :func:`context_parallel_attention`,
    ``out_i = sum_{j <= pos_i, seg(j) = seg(pos_i)} softmax_j(scale q_i . k_j) v_j``, computed as
    :func:`fnppo.core.kernels.invariant.sequence_attention` computes it on one process: keys and
    values are gathered over ``group`` (:func:`gather_tokens`), this rank's queries are put at their
    global positions in a zero ``[T, heads, d]`` tensor, and for every segment the query blocks of
    ``block`` tokens that hold one of this rank's tokens run as one product each, of the shape they
    have without context parallelism (:func:`~fnppo.core.kernels.invariant.sequence_attention_rows`);
    this rank's rows are kept, in its local order. A row's bits depend on its query, its keys and
    values and the block's shape only (not on the other query rows of the block, zeros here), so
    they are those of ``cp = 1``. Cost: the blocks that straddle two ranks' chunks run on both.
    Backward: exact (the gathered keys' and values' gradients are reduce-scattered; the zeros
    get none). References: Megatron-LM context parallelism; Thinking Machines Lab, "Defeating
    Nondeterminism in LLM Inference" (2025).

    Returns:
        ``[T/cp, heads, d_v]``, this rank's outputs in its local order.
    """
    fn = "fnppo.core.batching.context_parallel.context_parallel_sequence_attention"
    cp = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    cu = _boundaries(cu_seqlens)
    if query.shape[0] * cp != cu[-1]:
        raise input_error(fn, "query", f"{cu[-1] // cp} tokens (cu_seqlens[-1] / cp)", str(tuple(query.shape)))
    pos = cp_token_index(cu, cp, rank, device=query.device)
    k_full = gather_tokens(key, cu, group)
    v_full = gather_tokens(value, cu, group)
    q_full = query.new_zeros(cu[-1], *query.shape[1:]).index_copy(0, pos, query)
    return sequence_attention_rows(q_full, k_full, v_full, cu, pos, softmax_scale=softmax_scale, block=block)


def gather_per_sample(values: Tensor, mb: Microbatch, group: Any) -> list[Tensor]:
    """Per-response-token values of every sample from this CP rank's shard ``values [1, T/cp]``.

    Gathers the shards over ``group`` into global order and returns, for sample ``i`` (prompt
    ``P_i``, response ``R_i``, segment offset ``o_i``), ``full[0, o_i + P_i - 1 : o_i + P_i - 1 + R_i]``
    (as :func:`fnppo.core.batching.collate.unpack_per_sample` on the unsharded micro-batch); the same on every CP rank.
    """
    full = gather_tokens(values, mb.cu_seqlens, group, dim=1)
    out, offset = [], 0
    for p, r, seg in zip(mb.prompt_lens, mb.response_lens, mb.segment_lens, strict=True):
        out.append(full[0, offset + p - 1 : offset + p - 1 + r])
        offset += seg
    return out
