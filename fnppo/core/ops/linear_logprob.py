"""Log-probs and entropy straight from hidden states and the output weight, never materializing the logits.

:func:`linear_logprob_and_entropy` computes what :func:`fnppo.logprob_and_entropy` computes from
``hidden @ weight.T``, but block by block over the vocabulary: no ``[tokens, vocab]`` tensor is
stored in the forward or in the backward. The forward keeps, per token, a running maximum, the
rescaled sum of exponentials and the entropy sum (an online log-sum-exp); the backward recomputes
each block of logits from ``hidden`` and ``weight``, turns it into the block of logit gradients
and immediately contracts that block into the gradients of ``hidden`` and ``weight``.

For a Qwen-size vocabulary (151,936) and 8,192 tokens this frees the 2.3 GiB bf16 logits and the
2.3 GiB of their gradient per micro-batch.

Plain torch, no Megatron import: pass the tensor-parallel ``torch.distributed`` process group. On
CUDA the blocks run in Triton kernels (:mod:`fnppo.core.kernels.linear_logprob_triton`, imported on
first use); elsewhere a chunked PyTorch path gives the same results. The cache of static buffers and
CUDA graphs for the backward, :class:`~fnppo.core.ops.linear_logprob_graphs.BackwardGraphs`, is its own
module; the blocks it runs are this module's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fnppo.core.errors import describe, input_error
from fnppo.core.kernels import linear_logprob_kernels
from fnppo.core.ops.linear_logprob_graphs import BackwardGraphs
from fnppo.core.ops.logprob import (
    _FLOAT_DTYPES,
    LOGPROB_IMPLS,
    _check_labels,
    _check_labels_and_options,
    _check_optional_sizes,
    _check_vocab_bound,
    _combine,
    _group_size_rank,
    _resolve_impl,
)
from fnppo.core.typing import Float, Tensor, TokenIds, TokenLogProbs, typechecked, typechecking_enabled

__all__ = ["linear_logprob_and_entropy", "LINEAR_LOGPROB_IMPLS"]

_FN = "fnppo.linear_logprob_and_entropy"
LINEAR_LOGPROB_IMPLS = LOGPROB_IMPLS
"""Values of ``impl``: those of
:data:`fnppo.core.ops.logprob.LOGPROB_IMPLS`."""

# Memory budget of the backward, as fractions of one [tokens, vocab_shard] logits tensor in the
# inputs' dtype: the fp32 accumulator of the hidden-state gradient, and the block of logit gradients.
_DH_BUDGET = 0.03
_BLOCK_BUDGET = 0.045


@typechecked
def linear_logprob_and_entropy(
    hidden: Float[Tensor, "*tok hidden"],
    weight: Float[Tensor, "vocab_shard hidden"],
    labels: TokenIds,
    *,
    tp_group: Any = None,
    temperature: float | int = 1.0,
    with_entropy: bool = True,
    vocab_size: int | None = None,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    impl: str | None = None,
    graphs: Any = None,  # a BackwardGraphs or None, checked in the body (InputError)
) -> tuple[TokenLogProbs, TokenLogProbs | None]:
    r"""Log-prob of each label and entropy of each token, from hidden states and the output-weight shard.

    The same values as ``logprob_and_entropy(hidden @ weight.T, labels, ...)``, without the
    logits. With ``x = hidden @ weight.T`` over the full vocabulary (the concatenation of the TP
    shards, columns at or beyond ``vocab_size`` left out) and ``z = x / T``::

        logprobs[t] = z[t, label_t] - logsumexp_j z[t, j]
        entropy[t]  = -sum_j p[t, j] log p[t, j],      p = softmax(z)
                    = log s - (1/s) sum_j e^{z_j - m} (z_j - m),   m = max_j z_j,  s = sum_j e^{z_j - m}

    computed over blocks of vocabulary columns with running ``(m, s, w)`` that are rescaled
    exactly when a block raises the maximum (the online softmax of Milakov & Gimelshein 2018,
    "Online normalizer calculation for softmax"; for fused output layers, Wijmans et al. 2024,
    "Cut Your Losses in Large-Vocabulary Language Models"). The backward recomputes each block and
    contracts the block of logit gradients

        dz[t, j] = ( g_lp[t] (1[j = label_t] - p[t, j]) - g_H[t] p[t, j] (log p[t, j] + H[t]) ) / T

    at once into ``d hidden = dz @ weight`` and ``d weight = dz.T @ hidden`` (``dz`` never exists
    beyond one block). Nothing flows to ``labels``.

    Tensor parallelism (``tp_group``): ``weight`` is this rank's contiguous vocabulary shard
    (Megatron's ``ColumnParallelLinear`` layout: rank ``r`` holds rows ``r * vocab_shard ...``) and
    ``hidden`` is the full hidden state, the same on every rank. The forward runs two collectives,
    each moving O(tokens) values: an all-reduce MAX of the per-token maxima, then one all-reduce SUM
    of ``[tokens, 3]`` values (rescaled sum of exponentials, entropy sum, and the label's logit,
    which only the rank holding the label contributes; ``[tokens, 2]`` without entropy). The
    backward runs none. As for ``hidden @ weight.T``, the gradient of ``hidden`` on each rank is
    this rank's share ``dz_r @ weight_r``; the caller sums it over the group, e.g. by passing
    ``megatron.core.tensor_parallel.copy_to_tensor_model_parallel_region(hidden)``, which is what
    Megatron's output layer does (and :func:`fnppo.megatron.forward.forward_hidden`). Sequence-parallel callers
    gather the hidden states over the sequence first (``gather_from_sequence_parallel_region``):
    every rank needs every token's hidden state.

    Precision: logits are accumulated in fp32 from the inputs' dtype (never rounded to bf16, unlike
    materialized bf16 logits) and all statistics are fp32, so values agree with an fp64 reference
    to ~1e-6 (relative) and with ``logprob_and_entropy`` on bf16 logits within bf16 rounding of the
    logits. Gradients are returned in the inputs' dtypes.

    Memory: saved for backward are the inputs as given (no copy) and two fp32 values per token
    (``logsumexp`` and the entropy). On CUDA (Triton) the forward needs O(tokens) extra memory and
    the backward one block of logit gradients (``chunk_tokens x chunk_vocab`` in the inputs' dtype)
    plus an fp32 accumulator of one token group's hidden gradient, together at most 4.5% of one
    ``[tokens, vocab_shard]`` logits tensor in the inputs' dtype by default (measured on an H200:
    BENCHMARKS.md). The token group is the whole batch unless its fp32 accumulator would exceed 3%
    (``4 * hidden / (itemsize * vocab_shard) > 0.03``, e.g. hidden 4,096 with a 151,936 vocabulary);
    with several groups the weight gradient is accumulated over the groups in the weight's dtype.
    The PyTorch path (CPU, CI) works on fp32 blocks of about 1/16 of the logits and keeps fp32
    accumulators for both gradients.

    Never writes to ``hidden``, ``weight`` or ``labels``.

    Args:
      hidden: ``[*tok, hidden]`` hidden states (the final norm's output), fp32, bf16, fp16 or fp64.
      weight: ``[vocab_shard, hidden]`` this rank's rows of the output weight (the embedding when
        tied), same dtype and device as ``hidden``.
      labels: ``[*tok]`` global token ids in ``[0, vocab_size)``, any integer dtype.
      tp_group: the tensor-parallel process group, or None for an unsharded weight.
      temperature: ``T > 0``; the logits are divided by it.
      with_entropy: if False, no entropy work is done and ``None`` is returned for it.
      vocab_size: the model's real global vocabulary size; columns with global index
        ``>= vocab_size`` (the padding rows of a padded vocabulary) are left out of the softmax and
        get a zero weight gradient. Default: ``vocab_shard * tp_size`` (nothing left out).
      chunk_tokens: tokens per group of the backward (and of the PyTorch path's blocks).
      chunk_vocab: vocabulary rows per block.
      impl: ``"auto"`` (the default: Triton on CUDA when available, else PyTorch), ``"triton"`` or ``"torch"``.
      graphs: a :class:`BackwardGraphs` cache: the backward runs from static buffers and, on CUDA,
        is replayed as a CUDA graph (one launch instead of three per vocabulary block), for steps
        whose host time binds. Same values; costs the cache's buffers (see there).

    Returns:
      ``(logprobs, entropy)``: fp32 ``[*tok]`` tensors (``entropy`` is None without entropy).

    Raises:
      InputError: bad dtypes, devices, shapes, temperature, ``vocab_size`` or chunk sizes; labels
        outside ``[0, vocab_size)`` (while call-time checking is on: one device-to-host sync; with
        it off such a label gets a NaN log-prob).
      ShapeError: the annotations above are violated (call-time checking on).
    """
    temperature = _check_args(hidden, weight, labels, tp_group, temperature, vocab_size, chunk_tokens, chunk_vocab)
    if graphs is not None and not isinstance(graphs, BackwardGraphs):
        raise input_error(_FN, "graphs", "a fnppo.ops.BackwardGraphs or None", describe(graphs))
    impl = _resolve_impl(_FN, impl, hidden, "inputs")
    tp_size, tp_rank = _group_size_rank(tp_group)
    shard = weight.shape[0]
    vocab_total = shard * tp_size if vocab_size is None else vocab_size
    if typechecking_enabled():
        _check_labels(_FN, labels, vocab_total)
    vocab_start = tp_rank * shard
    n_valid = max(0, min(shard, vocab_total - vocab_start))  # this shard's real (unpadded) rows
    cfg = _Cfg(
        1.0 / float(temperature),
        bool(with_entropy),
        tp_group,
        tp_size,
        vocab_start,
        n_valid,
        vocab_total,
        impl,
        chunk_tokens,
        chunk_vocab,
        graphs,
    )
    out = _LinearLogprobEntropy.apply(hidden, weight, labels, cfg)
    if with_entropy:
        return out[0], out[1]
    return out, None


class _Cfg:
    """Non-tensor arguments of the autograd function."""

    __slots__ = (
        "inv_t",
        "with_entropy",
        "group",
        "tp_size",
        "vocab_start",
        "n_valid",
        "vocab_total",
        "impl",
        "chunk_tokens",
        "chunk_vocab",
        "graphs",
    )

    def __init__(self, *values: Any) -> None:
        for name, value in zip(self.__slots__, values, strict=True):
            setattr(self, name, value)


# ---------------------------------------------------------------------------------------------
# Validation (the label, option and TP checks: fnppo.core.ops.logprob)
# ---------------------------------------------------------------------------------------------
def _check_args(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    tp_group: Any,
    temperature: Any,
    vocab_size: Any,
    chunk_tokens: Any,
    chunk_vocab: Any,
) -> float:
    # These repeat what the annotations say, so that they hold with call-time checking off too.
    if not isinstance(hidden, torch.Tensor) or hidden.dtype not in _FLOAT_DTYPES or hidden.dim() < 1:
        raise input_error(
            _FN, "hidden", "a floating [*tok, hidden] tensor (fp32, bf16, fp16 or fp64)", describe(hidden)
        )
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != hidden.dtype:
        raise input_error(
            _FN,
            "weight",
            f"a [vocab_shard, hidden] tensor of the hidden states' dtype {describe(hidden)}",
            describe(weight),
        )
    if weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0 or hidden.shape[-1] == 0:
        raise input_error(
            _FN,
            "weight",
            f"shape [vocab_shard > 0, {hidden.shape[-1]}] (hidden size of 'hidden' {describe(hidden)})",
            describe(weight),
        )
    if weight.device != hidden.device:
        raise input_error(
            _FN, "weight", f"a tensor on the hidden states' device {hidden.device}", f"one on {weight.device}"
        )
    t = _check_labels_and_options(
        _FN,
        labels,
        hidden,
        "hidden",
        "the hidden states'",
        temperature,
        tp_group,
        chunk_tokens=chunk_tokens,
        chunk_vocab=chunk_vocab,
    )
    if vocab_size is not None:
        _check_optional_sizes(_FN, vocab_size=vocab_size)
        tp_size, _ = _group_size_rank(tp_group)
        _check_vocab_bound(_FN, vocab_size, weight.shape[0], tp_size, "rows of all 'weight' shards")
    return t


# ---------------------------------------------------------------------------------------------
# The autograd function
# ---------------------------------------------------------------------------------------------
class _LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, cfg: _Cfg) -> Any:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        h2 = _rows(hidden)
        lab = labels.reshape(-1)
        w_valid = weight[: cfg.n_valid]
        if cfg.impl == "triton":
            m, s, w, zl = linear_logprob_kernels().forward_stats(
                h2, w_valid, lab, cfg.vocab_start, cfg.inv_t, cfg.with_entropy
            )
        else:
            rows, cols = _torch_chunks(h2.shape[0], cfg.n_valid, h2.element_size(), cfg)
            m, s, w, zl = _forward_stats_torch(
                h2, w_valid, lab, cfg.vocab_start, cfg.inv_t, cfg.with_entropy, rows, cols
            )
        logp, entropy, lse = _combine(m, s, w, zl, lab, cfg.group, cfg.tp_size, cfg.vocab_total)
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.cfg = cfg
        logp = logp.view(labels.shape)
        if cfg.with_entropy:
            return logp, entropy.view(labels.shape)
        return logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        cfg: _Cfg = ctx.cfg
        g_lp = grads[0]
        g_h = grads[1] if cfg.with_entropy else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_h is None) or not (need_h or need_w):
            return None, None, None, None
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        h2 = _rows(hidden)
        g_lp = None if g_lp is None else g_lp.reshape(-1)
        g_h = None if g_h is None else g_h.reshape(-1)
        out = None
        if cfg.graphs is not None:
            out = cfg.graphs._backward(
                h2,
                weight,
                labels.reshape(-1),
                (g_lp, g_h, entropy, lse),
                cfg,
                need_h,
                need_w,
                grads=_grads,
                chunks=_backward_chunks,
            )
        if out is None:
            dw = None
            if need_w:
                dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
                dw[cfg.n_valid :].zero_()  # padding rows beyond the real vocabulary
            sizes = _backward_chunks(h2.shape[0], weight.shape[0], h2.shape[1], h2.element_size(), cfg)
            dh = _grads(
                h2,
                weight[: cfg.n_valid],
                labels.reshape(-1),
                (g_lp, g_h, entropy, lse),
                cfg,
                need_h,
                None if dw is None else dw[: cfg.n_valid],
                sizes,
            )
            out = (dh, dw)
        dh, dw = out
        return (None if dh is None else dh.view(hidden.shape)), dw, None, None


def _grads(
    h2: Tensor,
    w_valid: Tensor,
    labels: Tensor,
    per_token: tuple[Tensor | None, ...],
    cfg: _Cfg,
    need_h: bool,
    dw: Tensor | None,
    chunks: dict[str, int],
    spaces: dict[str, Tensor] | None = None,
) -> Tensor | None:
    """The backward's body: per-token coefficients, then the blocks (Triton or PyTorch).

    ``per_token = (g_lp, g_h, entropy, lse)`` (``[tokens]``; the gradients may be None). Returns
    ``dh`` (or None) and writes the valid rows' weight gradient into ``dw``. ``spaces``: the
    preallocated buffers of :func:`fnppo.core.kernels.linear_logprob_triton.backward_grads`.
    """
    g_lp, g_h, entropy, lse = per_token
    zeros = torch.zeros(h2.shape[0], dtype=torch.float32, device=h2.device)
    a = zeros if g_lp is None else g_lp.to(torch.float32)
    b = zeros if g_h is None else g_h.to(torch.float32)
    # dz = p (c - b log p) + a 1[j = label] (times 1/T), with c = -a - b H.
    c = -a - (b * entropy if g_h is not None else zeros)
    coef = (a.contiguous(), b.contiguous(), c.contiguous(), lse)
    args = (h2, w_valid, labels, coef, g_h is not None, cfg, need_h, dw)
    if cfg.impl == "triton":
        return linear_logprob_kernels().backward_grads(*args, **chunks, **(spaces or {}))
    dh = _backward_torch(*args)
    if dh is not None and spaces is not None and "dh_out" in spaces:
        return spaces["dh_out"].copy_(dh)
    return dh


def _rows(hidden: Tensor) -> Tensor:
    """``[tokens, hidden]`` with unit stride along hidden (a view whenever possible)."""
    h2 = hidden.reshape(-1, hidden.shape[-1])
    return h2 if h2.stride(-1) == 1 else h2.contiguous()


# ---------------------------------------------------------------------------------------------
# Statistics (combined over the TP group by fnppo.core.ops.logprob._combine)
# ---------------------------------------------------------------------------------------------
def _merge_stats(m: Tensor, s: Tensor, w: Tensor | None, dim: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """Merge partial ``(m, s, w)`` along ``dim`` (the partial sums are relative to their own max).

    ``S = sum_k s_k e^{m_k - M}``, ``W = sum_k e^{m_k - M} (w_k + s_k (m_k - M))``, ``M = max_k m_k``;
    parts with ``m_k = -inf`` (no finite logit) contribute nothing.
    """
    big = m.amax(dim=dim, keepdim=True)
    shift = torch.where(big == float("-inf"), torch.zeros_like(big), big)
    a = torch.exp(m - shift)
    s_tot = (s * a).sum(dim)
    w_tot = None
    if w is not None:
        rel = torch.where(s > 0, s * (m - shift), torch.zeros_like(s))
        w_tot = (a * (w + rel)).sum(dim)
    return big.squeeze(dim), s_tot, w_tot


# ---------------------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------------------
def _torch_chunks(n: int, n_valid: int, elem: int, cfg: _Cfg) -> tuple[int, int]:
    """Rows and columns of the PyTorch path's fp32 blocks: about 1/16 of the logits, at least 16 x 128."""
    rows = cfg.chunk_tokens or n
    cols = cfg.chunk_vocab or max(128, (max(n, 1) * max(n_valid, 1) * elem // 16) // (4 * max(rows, 1)))
    return max(1, min(rows, max(n, 1))), max(1, min(cols, max(n_valid, 1)))


def _backward_chunks(n: int, shard: int, hidden: int, elem: int, cfg: _Cfg) -> dict[str, int]:
    """Token-group and vocabulary-block sizes of the Triton path's backward (see the module docs).

    The fp32 hidden-gradient accumulator of a group (``4 * group * hidden`` bytes) stays within 3% of
    the logits (``elem * n * shard`` bytes), the block of logit gradients within the rest of 4.5%.
    """
    groups = cfg.chunk_tokens and max(1, math.ceil(n / cfg.chunk_tokens))
    if not groups:
        groups = max(1, math.ceil(4 * hidden / (elem * shard * _DH_BUDGET)))
    group = max(1, math.ceil(n / groups))
    left = _BLOCK_BUDGET - 4 * group * hidden / (elem * max(n, 1) * shard)
    cols = cfg.chunk_vocab or max(256, int(left * max(n, 1) * shard / max(group, 1)) // 256 * 256)
    return {"group_tokens": group, "block_vocab": max(1, min(cols, max(cfg.n_valid, 1)))}


# ---------------------------------------------------------------------------------------------
# The PyTorch path (CPU, CI; any device)
# ---------------------------------------------------------------------------------------------
def _block_logits(h32: Tensor, w_block: Tensor, inv_t: float) -> Tensor:
    """``z = (h @ w_block.T) / T`` in fp32 (our own temporary)."""
    return torch.mm(h32, w_block.to(torch.float32).t()).mul_(inv_t)


def _forward_stats_torch(
    h2: Tensor,
    w_valid: Tensor,
    labels: Tensor,
    vocab_start: int,
    inv_t: float,
    with_entropy: bool,
    rows: int,
    cols: int,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    n = h2.shape[0]
    f32 = dict(dtype=torch.float32, device=h2.device)
    m = torch.full((n,), float("-inf"), **f32)
    s = torch.zeros(n, **f32)
    w = torch.zeros(n, **f32) if with_entropy else None
    zl = torch.zeros(n, **f32)
    n_valid = w_valid.shape[0]
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        h32 = h2[r0:r1].to(torch.float32)
        loc = labels[r0:r1].to(torch.int64) - vocab_start
        for c0 in range(0, n_valid, cols):
            z = _block_logits(h32, w_valid[c0 : c0 + cols], inv_t)
            inside = (loc >= c0) & (loc < c0 + z.shape[1])
            picked = z.gather(1, (loc - c0).clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
            zl[r0:r1] += torch.where(inside, picked, torch.zeros_like(picked))
            mb = z.amax(dim=1)
            z.sub_(mb.unsqueeze(1))  # d = z - max of this block
            e = torch.exp(z)
            sb = e.sum(dim=1)
            wb = (e * z).sum(dim=1) if with_entropy else None
            parts = [torch.stack([m[r0:r1], mb], 1), torch.stack([s[r0:r1], sb], 1)]
            wparts = torch.stack([w[r0:r1], wb], 1) if with_entropy else None
            m[r0:r1], s[r0:r1], wm = _merge_stats(parts[0], parts[1], wparts, 1)
            if with_entropy:
                w[r0:r1] = wm
    return m, s, w, zl


def _block_grad(z: Tensor, loc: Tensor, c0: int, coef: tuple[Tensor, ...], has_gh: bool, inv_t: float) -> Tensor:
    """The block of logit gradients ``dz`` (fp32) from the block of scaled logits ``z`` (overwritten)."""
    a, b, c, lse = coef
    logp = z.sub_(lse.unsqueeze(1))
    p = torch.exp(logp)
    if has_gh:
        dz = logp.mul_(-b.unsqueeze(1)).add_(c.unsqueeze(1)).mul_(p)
    else:
        dz = p.mul_(c.unsqueeze(1))
    inside = (loc >= c0) & (loc < c0 + dz.shape[1])
    add = torch.where(inside, a, torch.zeros_like(a))
    dz.scatter_add_(1, (loc - c0).clamp(0, dz.shape[1] - 1).unsqueeze(1), add.unsqueeze(1))
    return dz.mul_(inv_t)


def _backward_torch(
    h2: Tensor,
    w_valid: Tensor,
    labels: Tensor,
    coef: tuple[Tensor, ...],
    has_gh: bool,
    cfg: _Cfg,
    need_h: bool,
    dw: Tensor | None,
) -> Tensor | None:
    """Vocabulary blocks outside, token blocks inside; fp32 accumulators for both gradients.

    Returns ``dh`` (or None) and writes the weight gradient of the valid rows into ``dw``.
    """
    n, hid = h2.shape
    rows, cols = _torch_chunks(n, cfg.n_valid, h2.element_size(), cfg)
    dh_acc = torch.zeros((n, hid), dtype=torch.float32, device=h2.device) if need_h else None
    for c0 in range(0, cfg.n_valid, cols):
        wb32 = w_valid[c0 : c0 + cols].to(torch.float32)
        dw_acc = torch.zeros(wb32.shape, dtype=torch.float32, device=h2.device) if dw is not None else None
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            h32 = h2[r0:r1].to(torch.float32)
            loc = labels[r0:r1].to(torch.int64) - cfg.vocab_start
            z = _block_logits(h32, wb32, cfg.inv_t)
            dz = _block_grad(z, loc, c0, tuple(t[r0:r1] for t in coef), has_gh, cfg.inv_t)
            if dh_acc is not None:
                dh_acc[r0:r1].addmm_(dz, wb32)
            if dw_acc is not None:
                dw_acc.addmm_(dz.t(), h32)
        if dw is not None:
            dw[c0 : c0 + cols].copy_(dw_acc)
    return None if dh_acc is None else dh_acc.to(h2.dtype)
