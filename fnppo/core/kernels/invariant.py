"""Batch-invariant kernels in plain torch: a row's result does not depend on the other rows.

A kernel is *batch-invariant* when the bits of the output for one row (one token) depend only on
that row's input, never on how many rows are computed with it, where it sits among them, or what
the other rows hold. Library kernels are not: a GEMM picks its tiling and split-K from the number
of rows (on CPU, MKL's float32 GEMM gives other bits for the same row when the row count changes;
on a GPU, cuBLAS and split-K reductions do), a reduction over a long row is split across threads
when there are few rows, and some vectorized element-wise kernels (``silu``, ``sigmoid``,
``rsqrt``, ``gelu``, ``softplus`` on CPU) compute the tail of a vector with a scalar formula that
rounds differently, so an element's bits depend on its offset in the tensor. Reference: H. He and
Thinking Machines Lab, "Defeating Nondeterminism in LLM Inference" (2025).

The kernels here remove those dependencies without custom device code:

* **fixed row tiles** (:func:`row_tiled`): a row-wise operation runs on slabs of exactly
  ``tile`` rows (the last one zero-padded), so every library call has one shape whatever the batch;
  a row's result then depends only on its own data and its position inside the tile, and the
  kernels used (GEMM rows, row reductions) compute every position of a tile the same way (checked
  by ``tests/test_batch_invariant.py`` on the machine that runs it);
* **element-wise compositions** of correctly rounded or offset-invariant primitives
  (``exp``, ``sqrt``, ``erf``, ``+ - * /``) instead of the offending fused kernels;
* **per-sequence block attention** (:func:`sequence_attention`): each sequence alone, query blocks
  of ``block`` rows against the keys of its own sequence from its first token, so a token's
  attention output has one shape of computation whatever the pack, the padding or the neighbours
  (and a NaN in one sequence cannot reach another); :func:`sequence_attention_rows` computes only
  the blocks that hold some rows, with the same bits (context parallelism).

Everything is differentiable through autograd (the backward is not claimed to be invariant: only
the forward values are). Cost on CPU: ``benchmarks/batch_invariance.py`` prints it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fnppo.core.errors import describe, input_error
from fnppo.core.typing import Float, Int, Tensor, typechecked

__all__ = [
    "DEFAULT_TILE_ROWS",
    "DEFAULT_BLOCK",
    "row_tiled",
    "invariant_linear",
    "invariant_matmul",
    "invariant_rms_norm",
    "invariant_layer_norm",
    "invariant_softmax",
    "invariant_log_softmax",
    "invariant_row_reduce",
    "invariant_silu",
    "invariant_sigmoid",
    "invariant_rsqrt",
    "invariant_gelu",
    "invariant_softplus",
    "sequence_attention",
    "sequence_attention_rows",
    "invariant_router_logits",
    "ROUTER_TILE_ROWS",
]

DEFAULT_TILE_ROWS = {"cpu": 64, "cuda": 128}
"""Rows per tile by device type (other devices: the CPU value)."""
DEFAULT_BLOCK = 64
"""Query rows per attention block (:func:`sequence_attention`)."""


def _tile_for(x: Tensor, tile: int | None) -> int:
    if tile is not None:
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
            raise input_error("fnppo.core.kernels.invariant", "tile", "an int >= 1", repr(tile))
        return tile
    return DEFAULT_TILE_ROWS.get(x.device.type, DEFAULT_TILE_ROWS["cpu"])


def row_tiled(fn: Callable[[Tensor], Tensor], x: Tensor, tile: int | None = None) -> Tensor:
    """``fn`` applied to the rows of ``x`` (``[*rows, C]``) in slabs of exactly ``tile`` rows.

    ``fn`` maps a ``[tile, C]`` tensor to ``[tile, *out]`` row by row (row ``r`` of the output
    depends on row ``r`` of the input only). The rows are flattened, zero-padded to a multiple of
    ``tile`` and cut into contiguous slabs; ``fn`` sees one shape on every call, so its row results
    do not depend on the number of rows. Returns ``[*rows, *out]``.
    """
    tile = _tile_for(x, tile)
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    pad = (-n) % tile
    if pad or n == 0:
        flat = torch.cat([flat, flat.new_zeros(pad if n else tile, flat.shape[-1])])
    flat = flat.contiguous()
    outs = [fn(flat[r : r + tile]) for r in range(0, flat.shape[0], tile)]
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out[:n].reshape(*lead, *out.shape[1:])


@typechecked
def invariant_linear(
    x: Float[Tensor, "*rows k"], weight: Float[Tensor, "n k"], bias: Tensor | None = None, *, tile: int | None = None
) -> Float[Tensor, "*rows n"]:
    """``y = x W^T (+ b)`` with every row computed in a fixed-shape GEMM (:func:`row_tiled`).

    ``y[r, j] = sum_k x[r, k] W[j, k] + b[j]``: the GEMM is always called on ``[tile, k] x [k, n]``,
    so the reduction order of row ``r`` is the one of its position in a tile, never a function of
    the number of rows (the row-count-dependent tiling of cuBLAS/MKL is what makes ordinary
    linear layers batch-variant).
    """
    if x.dtype != weight.dtype:
        raise input_error(
            "fnppo.core.kernels.invariant.invariant_linear", "weight", f"dtype {x.dtype}", describe(weight)
        )
    wt = weight.t()
    out = row_tiled(lambda t: torch.mm(t, wt), x, tile)
    return out if bias is None else out + bias


def invariant_matmul(a: Tensor, b: Tensor, *, tile: int | None = None) -> Tensor:
    """``a @ b`` (``torch.matmul`` semantics) with batch-invariant rows.

    A 2-D ``b`` (a weight): :func:`invariant_linear` over the rows of ``a``. Batched products
    (``b`` of 3 or more dims): each matrix of the batch by itself, its rows in fixed tiles. A 1-D
    operand: ``torch.matmul`` (a dot product or matrix-vector product has no row tiling).
    """
    if a.dim() < 2 or b.dim() < 2:
        return torch.matmul(a, b)
    if b.dim() == 2:
        return invariant_linear(a, b.t(), tile=tile)
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    aa = a.expand(*shape, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    bb = b.expand(*shape, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    outs = [invariant_linear(aa[i], bb[i].t(), tile=tile) for i in range(aa.shape[0])]
    out = torch.stack(outs) if outs else aa.new_zeros(0, a.shape[-2], b.shape[-1])
    return out.reshape(*shape, a.shape[-2], b.shape[-1])


def _upcast(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def invariant_row_reduce(op: str, x: Tensor, *, keepdim: bool = False, tile: int | None = None) -> Tensor:
    """A reduction over the last dimension (``op``: ``sum``, ``mean``, ``amax``, ``amin``,
    ``nansum``, ``logsumexp``) in fixed row tiles (a long row is otherwise split across threads
    when few rows are reduced)."""
    if op not in ("sum", "mean", "amax", "amin", "nansum", "logsumexp"):
        raise input_error("fnppo.core.kernels.invariant.invariant_row_reduce", "op", "a row reduction", repr(op))
    if x.dim() == 0:
        return getattr(torch, op)(x)
    out = row_tiled(lambda t: getattr(torch, op)(t, dim=-1, keepdim=True), x, tile)
    return out if keepdim else out.squeeze(-1)


def invariant_rms_norm(x: Tensor, weight: Tensor | None, eps: float | None, *, tile: int | None = None) -> Tensor:
    """RMSNorm over the last dimension, ``y = x / sqrt(mean(x^2) + eps) * w`` (arXiv:1910.07467).

    The mean in fixed row tiles, the reciprocal square root as ``1 / sqrt`` (the vectorized CPU
    ``rsqrt`` rounds differently from its scalar tail); half inputs are computed in fp32 and cast
    back. ``eps`` None: ``torch.finfo(dtype).eps`` (as ``torch.nn.functional.rms_norm``).
    """
    xf = _upcast(x)
    eps = torch.finfo(xf.dtype).eps if eps is None else float(eps)
    ms = invariant_row_reduce("mean", xf * xf, keepdim=True, tile=tile)
    y = xf / torch.sqrt(ms + eps)
    if weight is not None:
        y = y * _upcast(weight)
    return y.to(x.dtype)


def invariant_layer_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, *, tile: int | None = None
) -> Tensor:
    """LayerNorm over the last dimension, ``y = (x - mean) / sqrt(var + eps) * w + b``
    (arXiv:1607.06450; biased variance, as torch), reductions in fixed row tiles."""
    xf = _upcast(x)
    mu = invariant_row_reduce("mean", xf, keepdim=True, tile=tile)
    d = xf - mu
    var = invariant_row_reduce("mean", d * d, keepdim=True, tile=tile)
    y = d / torch.sqrt(var + float(eps))
    if weight is not None:
        y = y * _upcast(weight)
    if bias is not None:
        y = y + _upcast(bias)
    return y.to(x.dtype)


def _last_dim(fn: Callable[[Tensor], Tensor], x: Tensor, dim: int, tile: int | None) -> Tensor:
    dim = dim % max(1, x.dim())
    if x.dim() == 0:
        return fn(x)
    moved = x.movedim(dim, -1)
    return row_tiled(fn, moved, tile).movedim(-1, dim)


def invariant_softmax(x: Tensor, dim: int = -1, *, dtype: torch.dtype | None = None, tile: int | None = None) -> Tensor:
    """``softmax`` along ``dim`` in fixed row tiles."""
    return _last_dim(lambda t: torch.softmax(t, -1, dtype=dtype), x, dim, tile)


def invariant_log_softmax(
    x: Tensor, dim: int = -1, *, dtype: torch.dtype | None = None, tile: int | None = None
) -> Tensor:
    """``log_softmax`` along ``dim`` in fixed row tiles."""
    return _last_dim(lambda t: torch.log_softmax(t, -1, dtype=dtype), x, dim, tile)


# Element-wise: compositions of primitives whose vectorized and scalar CPU paths agree bit for bit.
def invariant_sigmoid(x: Tensor) -> Tensor:
    """``1 / (1 + exp(-x))``."""
    return 1.0 / (1.0 + torch.exp(-x))


def invariant_silu(x: Tensor) -> Tensor:
    """``x / (1 + exp(-x))`` (SiLU, arXiv:1702.03118)."""
    return x / (1.0 + torch.exp(-x))


def invariant_rsqrt(x: Tensor) -> Tensor:
    """``1 / sqrt(x)``."""
    return 1.0 / torch.sqrt(x)


def invariant_gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU (arXiv:1606.08415): ``x/2 (1 + erf(x / sqrt 2))``, or the tanh form for ``approximate="tanh"``."""
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def invariant_softplus(x: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """``log(1 + exp(beta x)) / beta``, linear above ``threshold`` (as torch)."""
    bx = x * beta
    return torch.where(bx > threshold, x, torch.log1p(torch.exp(bx)) / beta)


# ---------------------------------------------------------------------------------------------
# Attention, one sequence at a time
# ---------------------------------------------------------------------------------------------
def _one_sequence(q: Tensor, k: Tensor, v: Tensor, scale: float, block: int, blocks: list[int] | None = None) -> Tensor:
    """Causal attention of one sequence ``q [L, H, D]``, ``k/v [L, H, *]`` in query blocks.

    ``blocks`` None: every block, ``[L, H, Dv]``. Else only the query blocks listed (in that order),
    each computed exactly as in the full call: ``[len(blocks) * block, H, Dv]``, padding rows included.
    """
    length = q.shape[0]
    nb = -(-length // block)
    pad = nb * block - length
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    qh, kh, vh = (t.permute(1, 0, 2) for t in (q, k, v))  # [H, Lp, *]
    idx = torch.arange(nb * block, device=q.device)
    outs = []
    for i in range(nb) if blocks is None else blocks:
        end = (i + 1) * block
        qi = qh[:, i * block : end] * scale
        # einsum runs its product below any torch-function mode: one fixed shape per block index i
        scores = torch.einsum("hqd,hkd->hqk", qi, kh[:, :end])  # [H, block, end]
        allowed = idx[i * block : end, None] >= idx[None, :end]
        scores = scores.masked_fill(~allowed, float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)
        p = torch.exp(scores - m)
        denom = p.sum(dim=-1, keepdim=True)
        outs.append(torch.einsum("hqk,hkd->hqd", p, vh[:, :end]) / denom)
    out = torch.cat(outs, dim=1).permute(1, 0, 2)  # [blocks * block, H, Dv]
    return out[:length] if blocks is None else out


def _prepare(
    fn: str, query: Tensor, key: Tensor, value: Tensor, bounds: list[int], softmax_scale: float | None, block: int
) -> tuple[Tensor, Tensor, Tensor, float]:
    """Checked arguments of the sequence attentions: fp32 ``q``, ``k``, ``v`` (GQA groups repeated), the scale."""
    heads, groups = query.shape[1], key.shape[1]
    if groups == 0 or heads % groups:
        raise input_error(fn, "key", f"a number of key/value groups dividing the {heads} query heads", describe(key))
    total = query.shape[0]
    if not bounds or bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise input_error(fn, "bounds", f"non-decreasing boundaries from 0 to {total}", repr(bounds[:8]))
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise input_error(fn, "block", "an int >= 1", repr(block))
    scale = 1.0 / math.sqrt(query.shape[-1]) if softmax_scale is None else float(softmax_scale)
    rep = heads // groups
    k = key.repeat_interleave(rep, dim=1) if rep > 1 else key
    v = value.repeat_interleave(rep, dim=1) if rep > 1 else value
    return _upcast(query), _upcast(k), _upcast(v), scale


@typechecked
def sequence_attention(
    query: Float[Tensor, "tokens heads head_dim"],
    key: Float[Tensor, "tokens groups head_dim"],
    value: Float[Tensor, "tokens groups v_dim"],
    bounds: list[int],
    *,
    softmax_scale: float | None = None,
    block: int = DEFAULT_BLOCK,
) -> Float[Tensor, "tokens heads v_dim"]:
    """Causal attention of each sequence ``[bounds[s], bounds[s + 1])`` alone, batch-invariantly.

    ``out_i = sum_{j <= i, seg(j) = seg(i)} softmax_j(scale q_i . k_j) v_j`` (arXiv:2107.02027),
    computed per sequence: its tokens are zero-padded to a multiple of ``block``, and query block
    ``b`` (tokens ``[b*block, (b+1)*block)`` of the sequence) is scored against the keys
    ``[0, (b+1)*block)`` of the same sequence in one product whose shape depends on ``b`` only;
    scores in fp32, masked with ``-inf`` above the diagonal, max-shifted softmax. A token's output
    therefore has the same bits whatever the other sequences, its offset in the pack and the
    length it is padded to (the padded layout: one sequence per row, its padding after it, masked by
    causality). A NaN or inf in one sequence never enters another's computation. GQA: query head
    ``h`` uses group ``h // (heads // groups)``.

    ``bounds``: the sequence boundaries ``[0, l0, l0 + l1, ..., T]`` (host ints).
    """
    fn = "fnppo.core.kernels.invariant.sequence_attention"
    qf, kf, vf, scale = _prepare(fn, query, key, value, bounds, softmax_scale, block)
    pieces = [_one_sequence(qf[a:b], kf[a:b], vf[a:b], scale, block) for a, b in zip(bounds, bounds[1:]) if b > a]
    if not pieces:
        return query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
    return torch.cat(pieces).to(query.dtype)


@typechecked
def sequence_attention_rows(
    query: Float[Tensor, "tokens heads head_dim"],
    key: Float[Tensor, "tokens groups head_dim"],
    value: Float[Tensor, "tokens groups v_dim"],
    bounds: list[int],
    rows: Int[Tensor, " n"],
    *,
    softmax_scale: float | None = None,
    block: int = DEFAULT_BLOCK,
) -> Float[Tensor, "n heads v_dim"]:
    """The rows ``rows`` of :func:`sequence_attention` (same arguments), with the same bits, computing
    only the query blocks that hold them.

    ``out[n] = sequence_attention(query, key, value, bounds)[rows[n]]``: for each sequence, the query
    blocks ``b`` (tokens ``[b*block, (b+1)*block)`` of the sequence) that contain a requested row are
    computed as :func:`sequence_attention` computes them (one product of the same shape against the
    keys ``[0, (b+1)*block)``), the others are skipped. A row's bits depend only on its own query,
    its keys and values and the block's shape, never on the other query rows of its block, which may
    hold anything (context parallelism leaves other ranks' queries at zero there,
    :func:`fnppo.core.batching.context_parallel.context_parallel_sequence_attention`). Reference: per-sequence
    (packed) attention, arXiv:2107.02027; batch invariance, Thinking Machines Lab, "Defeating
    Nondeterminism in LLM Inference" (2025).

    ``rows``: int64 token indices in ``[0, tokens)`` (any order, host-synchronized once).
    """
    fn = "fnppo.core.kernels.invariant.sequence_attention_rows"
    total = query.shape[0]
    qf, kf, vf, scale = _prepare(fn, query, key, value, bounds, softmax_scale, block)
    want = rows.to("cpu", torch.int64)
    if want.numel() and (int(want.min()) < 0 or int(want.max()) >= total):
        raise input_error(fn, "rows", f"token indices in [0, {total})", f"[{int(want.min())}, {int(want.max())}]")
    ends = torch.tensor(bounds[1:], dtype=torch.int64)
    seq = torch.searchsorted(ends, want, right=True)  # the sequence of every requested row
    local = want - torch.tensor(bounds, dtype=torch.int64)[seq]
    where = torch.empty_like(want)  # each requested row's place in the concatenated computed blocks
    pieces, offset = [], 0
    for s in torch.unique(seq).tolist():
        mine = seq == s
        blocks = torch.unique(local[mine] // block)  # sorted
        a, b = bounds[s], bounds[s + 1]
        pieces.append(_one_sequence(qf[a:b], kf[a:b], vf[a:b], scale, block, blocks.tolist()))
        slot = torch.searchsorted(blocks, local[mine] // block)
        where[mine] = offset + slot * block + local[mine] % block
        offset += blocks.numel() * block
    if not pieces:
        return query.new_zeros(0, query.shape[1], value.shape[-1])
    return torch.cat(pieces).index_select(0, where.to(query.device)).to(query.dtype)


ROUTER_TILE_ROWS = 4096
"""Rows per product of :func:`invariant_router_logits`."""


class _FixedTileGating(torch.autograd.Function):
    """Forward: the router product in fixed row tiles; backward: the ordinary products (the gradient
    need not be batch-invariant), saving the inputs in their own dtype as Megatron's gating does."""

    @staticmethod
    def forward(ctx, inp, weight, bias, dtype, tile):  # noqa: ANN001, ANN205
        ctx.save_for_backward(inp, weight, bias)
        ctx.dtype = dtype
        w = weight.to(dtype).t()
        out = row_tiled(lambda t: torch.mm(t.to(dtype), w), inp.reshape(-1, inp.shape[-1]), tile)
        if bias is not None:
            out = out + bias.to(dtype)
        return out.reshape(*inp.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        inp, weight, bias = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(ctx.dtype)
        x = inp.reshape(-1, inp.shape[-1])
        grad_inp = (g @ weight.to(ctx.dtype)).to(inp.dtype).reshape(inp.shape) if ctx.needs_input_grad[0] else None
        grad_w = (g.t() @ x.to(ctx.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_inp, grad_w, grad_b, None, None


@typechecked
def invariant_router_logits(
    inp: Float[Tensor, "*tokens hidden"],
    weight: Float[Tensor, "experts hidden"],
    bias: Float[Tensor, " experts"] | None,
    dtype: torch.dtype,
    *,
    tile: int = ROUTER_TILE_ROWS,
) -> Float[Tensor, "*tokens experts"]:
    """The router's logits ``z = x W^T (+ b)`` in ``dtype``, each token's bits independent of the other tokens.

    ``z[t, e] = sum_h x[t, h] W[e, h] + b[e]``, computed as products of exactly ``tile`` rows
    (:func:`row_tiled`; the last tile zero-padded): a library GEMM
    with as few columns as a router has experts picks its reduction split from the number of rows,
    so the ordinary product gives a token other bits in another micro-batch. The backward runs the
    ordinary products (only the forward values must be batch-invariant). The gating of Megatron's
    ``TopKRouter`` (``router_gating_linear``) in fnppo's batch-invariant mode
    (:func:`fnppo.megatron.numerics.prepare_model`). Reference: H. He and Thinking
    Machines Lab, "Defeating Nondeterminism in LLM Inference" (2025).
    """
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise input_error("fnppo.core.kernels.invariant.invariant_router_logits", "tile", "an int >= 1", repr(tile))
    return _FixedTileGating.apply(inp, weight, bias, dtype, tile)
