"""Per-token log-probabilities and entropies of vocab-parallel logits, in one autograd function.

:func:`logprob_and_entropy` is what a policy-gradient loss needs from the logits: the log-prob of
each sampled token and (for entropy regularization) the entropy of each token's distribution over
the full vocabulary, under tensor parallelism (each rank holds a contiguous vocabulary shard).

It replaces the usual pair "Megatron ``vocab_parallel_cross_entropy`` + a separate vocab-parallel
entropy". That cross-entropy writes into its input (``logits -= max``, ``exp`` in place, softmax
stored over the logits); with fp32 logits (where ``.float()`` is a no-op) this silently changes
the caller's logits and breaks the backward of anything else computed from them, e.g. the entropy
("one of the variables needed for gradient computation has been modified by an inplace
operation"; NVIDIA/Megatron-LM PR #1594, verl PR #2484). The usual fix clones the logits first,
one more full ``[tokens, vocab]`` copy. Here nothing is written to the inputs, nothing of size
``[tokens, vocab]`` is saved but the logits themselves, and the only ``[tokens, vocab]`` tensor
created is the gradient.

Plain torch, no Megatron import: pass the tensor-parallel ``torch.distributed`` process group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fnppo.core.errors import describe, input_error
from fnppo.core.kernels import logprob_kernels, triton_available, triton_interpreting
from fnppo.core.typing import Tensor, TokenIds, TokenLogProbs, VocabLogits, typechecked, typechecking_enabled

__all__ = ["logprob_and_entropy", "LOGPROB_IMPLS"]

_FN = "fnppo.logprob_and_entropy"
LOGPROB_IMPLS = ("auto", "triton", "torch")
"""Values of ``impl``."""

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MIN_CHUNK_ROWS = 16


@typechecked
def logprob_and_entropy(
    logits: VocabLogits,
    labels: TokenIds,
    *,
    tp_group: Any = None,
    temperature: float | int = 1.0,
    with_entropy: bool = True,
    vocab_size: int | None = None,
    chunk_tokens: int | None = None,
    impl: str | None = None,
) -> tuple[TokenLogProbs, TokenLogProbs | None]:
    r"""Log-prob of each label and entropy of each token's distribution, from vocab-parallel logits.

    With :math:`z = x / T` over the full vocabulary (the concatenation of the TP shards)::

        logprobs[t] = z[t, label_t] - logsumexp_j z[t, j]
        entropy[t]  = -sum_j p[t, j] log p[t, j],      p = softmax(z)
                    = log s - (1/s) sum_j e^{z_j - m} (z_j - m),   m = max_j z_j,  s = sum_j e^{z_j - m}

    and the gradient of the logits, written once by the backward (nothing is recomputed by
    autograd)::

        dL/dx[t, j] = ( g_lp[t] (1[j = label_t] - p[t, j]) - g_H[t] p[t, j] (log p[t, j] + H[t]) ) / T

    Accumulation is fp32 for any input dtype. Under tensor parallelism (``tp_group`` given) the
    forward runs exactly two collectives over the group, each moving O(tokens) values and never
    the logits: an all-reduce MAX of the per-token shard maxima, then one all-reduce SUM of a
    ``[tokens, 3]`` tensor (the rescaled ``s`` and entropy sum, and the label's logit, which only
    the rank holding the label contributes; ``[tokens, 2]`` without entropy). The backward needs no
    collective: the gradient of each shard depends only on that shard and the two saved per-token
    values.

    Precision: values agree with an fp64 reference to ~1e-6; the gradient is the exact one rounded
    to the logits' dtype, except that for logits of magnitude ~1e4 the fp32 ``logsumexp`` carries
    an absolute rounding of ~5e-4 (relative 5e-4 in the gradient).

    Memory: saved for backward are the logits as given (no copy), the labels, and two fp32 values
    per token (``logsumexp`` and the entropy). On CUDA with Triton, one kernel reads the logits
    once in the forward and another reads them once and writes the gradient once in the backward
    (``fnppo.core.kernels``); elsewhere a PyTorch path over chunks of ``chunk_tokens`` rows gives the
    same results, with fp32 temporaries of about 1/8 of the logits (at least 16 rows).

    Never writes to ``logits`` or ``labels``.

    Padded vocabulary: with ``vocab_size`` (the real vocabulary, e.g. ``ModelConfig.vocab_size``)
    smaller than ``vocab_shard * tp_size`` (Megatron's ``make_vocab_size_divisible_by`` padding), the
    columns with global index ``>= vocab_size`` are not part of the distribution: the sums above run
    over ``j < vocab_size`` only, and their gradient is exactly 0, whatever those columns hold (an
    output layer loaded from a checkpoint has zero rows there, i.e. logits of 0, which would
    otherwise take probability mass). The rank holding them just reads fewer columns of its shard
    (a view, no masked copy); a rank holding only padding contributes nothing.

    Label validation: with call-time checking on (:func:`fnppo.core.typing.typechecking_enabled`, the
    default) labels outside ``[0, vocab_size)`` (``[0, vocab_shard * tp_size)`` without
    ``vocab_size``) raise :class:`~fnppo.core.errors.InputError`; this costs one device-to-host sync.
    With checking off there is no sync and no error: the log-prob of an out-of-range label is NaN
    (so the loss turns NaN instead of being silently wrong).

    Args:
      logits: ``[*tok, vocab_shard]`` logits (fp32, bf16, fp16 or fp64); with ``tp_group`` this
        rank's contiguous shard, which starts at ``rank_in_group * vocab_shard`` (Megatron's
        layout).
      labels: ``[*tok]`` global token ids in ``[0, vocab_size)``, any integer dtype.
      tp_group: the tensor-parallel process group, or None for unsharded logits.
      temperature: ``T > 0``; the logits are divided by it.
      with_entropy: if False, no entropy work is done and ``None`` is returned for it.
      vocab_size: the model's real vocabulary size (global, over all TP ranks), or None for
        ``vocab_shard * tp_size`` (no padding). Must satisfy ``vocab_size <= vocab_shard * tp_size``
        and, under TP, ``vocab_size > vocab_shard``: logits already gathered over TP would break
        the latter, and would otherwise give a loss off by ``log(tp_size)`` without any error.
      chunk_tokens: rows per chunk of the PyTorch path (default: from the memory budget above).
      impl: ``"auto"`` (the default: Triton on CUDA when available, else PyTorch), ``"triton"`` or
        ``"torch"`` (a step takes another through its stage, e.g.
        ``StepFns(logprob=functools.partial(logprob_and_entropy, impl="torch"))``).

    Returns:
      ``(logprobs, entropy)``: fp32 ``[*tok]`` tensors (``entropy`` is None without entropy).

    References: log-softmax/entropy gradients as in any softmax layer; the in-place issue in
    Megatron's cross-entropy: NVIDIA/Megatron-LM PR #1594 and verl PR #2484.
    """
    temperature = _check_args(logits, labels, tp_group, temperature, vocab_size, chunk_tokens)
    impl = _resolve_impl(_FN, impl, logits, "logits")
    tp_size, tp_rank = _group_size_rank(tp_group)
    shard = logits.shape[-1]
    vocab_total = shard * tp_size if vocab_size is None else vocab_size
    if typechecking_enabled():
        _check_labels(_FN, labels, vocab_total, vocab_size is not None)
    n_valid = max(0, min(shard, vocab_total - tp_rank * shard))  # this shard's real columns: [0, n_valid)
    out = _LogprobEntropy.apply(
        logits,
        labels,
        float(temperature),
        bool(with_entropy),
        tp_group,
        tp_size,
        tp_rank,
        impl,
        chunk_tokens,
        vocab_total,
        n_valid,
    )
    if with_entropy:
        return out[0], out[1]
    return out, None


# ---------------------------------------------------------------------------------------------
# Validation (the label, option and TP checks are shared with fnppo.core.ops.linear_logprob)
# ---------------------------------------------------------------------------------------------
def _check_args(
    logits: Tensor, labels: Tensor, tp_group: Any, temperature: Any, vocab_size: int | None, chunk_tokens: int | None
) -> float:
    # These repeat what the annotations say, so that they hold with call-time checking off too.
    if not isinstance(logits, torch.Tensor) or logits.dtype not in _FLOAT_DTYPES:
        raise input_error(_FN, "logits", "a floating tensor (fp32, bf16, fp16 or fp64)", describe(logits))
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise input_error(_FN, "logits", "a [*tok, vocab_shard] tensor with vocab_shard > 0", describe(logits))
    t = _check_labels_and_options(
        _FN, labels, logits, "logits", "the logits'", temperature, tp_group, chunk_tokens=chunk_tokens
    )
    if vocab_size is not None:
        tp_size, _ = _group_size_rank(tp_group)
        shard = logits.shape[-1]
        _check_optional_sizes(_FN, vocab_size=vocab_size)
        _check_vocab_bound(_FN, vocab_size, shard, tp_size, "the real vocabulary; the logits may hold a padded one")
        if tp_size > 1 and vocab_size <= shard:
            raise input_error(
                _FN,
                "logits",
                f"this rank's vocab shard: a last dimension below vocab_size={vocab_size} with tp_size={tp_size}",
                f"{describe(logits)} (these look like logits already gathered over tensor parallelism; pass this "
                "rank's shard. A vocabulary padded so much that one shard holds every real column is not "
                "supported: lower make_vocab_size_divisible_by)",
            )
    return t


def _check_labels_and_options(
    fn: str,
    labels: Any,
    source: Tensor,
    source_name: str,
    source_desc: str,
    temperature: Any,
    tp_group: Any,
    **sizes: Any,
) -> float:
    """The checks of the labels (against ``source``, the tensor whose leading dims they index), the
    temperature, the optional sizes and the TP group; returns the temperature as a float."""
    if (
        not isinstance(labels, torch.Tensor)
        or labels.is_floating_point()
        or labels.is_complex()
        or labels.dtype == torch.bool
    ):
        raise input_error(fn, "labels", "an integer tensor of token ids", describe(labels))
    if tuple(labels.shape) != tuple(source.shape[:-1]):
        raise input_error(
            fn,
            "labels",
            f"shape {tuple(source.shape[:-1])} ({source_desc} leading dims)",
            f"{describe(labels)} with {source_name} {describe(source)}",
        )
    if labels.device != source.device:
        raise input_error(fn, "labels", f"a tensor on {source_desc} device {source.device}", f"one on {labels.device}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise input_error(fn, "temperature", "a float > 0", repr(temperature))
    t = float(temperature)
    if not (t > 0.0) or t == float("inf"):
        raise input_error(fn, "temperature", "a finite float > 0", repr(temperature))
    _check_optional_sizes(fn, **sizes)
    if tp_group is not None and not dist.is_initialized():
        raise input_error(fn, "tp_group", "a process group of an initialized torch.distributed", repr(tp_group))
    return t


def _check_optional_sizes(fn: str, **sizes: Any) -> None:
    """Each of ``sizes`` is None or an int >= 1."""
    for name, v in sizes.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise input_error(fn, name, "None or an int >= 1", repr(v))


def _check_vocab_bound(fn: str, vocab_size: int, shard: int, tp_size: int, note: str) -> None:
    """``vocab_size <= shard * tp_size`` (the real vocabulary within the sharded one)."""
    if vocab_size > shard * tp_size:
        raise input_error(
            fn,
            "vocab_size",
            f"at most vocab_shard * tp_size = {shard} * {tp_size} = {shard * tp_size} ({note})",
            repr(vocab_size),
        )


def _check_labels(fn: str, labels: Tensor, vocab_total: int, real: bool = False) -> None:
    """Raise InputError for a label outside ``[0, vocab_total)`` (one device-to-host sync)."""
    if labels.numel() == 0:
        return
    bad = (labels < 0) | (labels >= vocab_total)
    if bool(bad.any()):
        first = labels[bad].flatten()[0].item()
        lo, hi = int(labels.min().item()), int(labels.max().item())
        raise input_error(
            fn,
            "labels",
            f"token ids in [0, {vocab_total})" + (" (vocab_size)" if real else ""),
            f"{describe(labels)} with values in [{lo}, {hi}] (first bad: {first})",
        )


def _group_size_rank(group: Any) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _resolve_impl(fn: str, impl: str | None, x: Tensor, fp64_inputs: str) -> str:
    """The implementation to run on ``x``: ``impl``, else ``"auto"``."""
    chosen = "auto" if impl is None else impl
    if chosen not in LOGPROB_IMPLS:
        raise input_error(fn, "impl", f"one of {LOGPROB_IMPLS}", repr(chosen))
    if chosen == "auto":
        return "triton" if x.is_cuda and x.dtype != torch.float64 and triton_available() else "torch"
    if chosen == "triton":
        if not triton_available():
            raise input_error(fn, "impl", "'torch' or 'auto' (Triton is not installed)", repr(chosen))
        if not (x.is_cuda or triton_interpreting()):
            raise input_error(fn, "impl", "'torch' or 'auto' for CPU tensors (unless TRITON_INTERPRET=1)", repr(chosen))
        if x.dtype == torch.float64:
            raise input_error(fn, "impl", f"'torch' or 'auto' for fp64 {fp64_inputs}", repr(chosen))
    return chosen


# ---------------------------------------------------------------------------------------------
# The autograd function
# ---------------------------------------------------------------------------------------------
class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        labels: Tensor,
        temperature: float,
        with_entropy: bool,
        group: Any,
        tp_size: int,
        tp_rank: int,
        impl: str,
        chunk_tokens: int | None,
        vocab_total: int,
        n_valid: int,
    ) -> Any:
        ctx.set_materialize_grads(False)
        shard = logits.shape[-1]
        x2 = logits.reshape(-1, shard)  # a view whenever the leading dims can be merged
        lab = labels.reshape(-1)
        vocab_start = tp_rank * shard
        inv_t = 1.0 / temperature
        if n_valid == 0:  # a shard of padding only: no column of the distribution
            m, s, w, zl = _empty_stats(x2.shape[0], with_entropy, x2.device)
        elif impl == "triton":
            m, s, w, zl = logprob_kernels().forward_stats(x2, lab, vocab_start, inv_t, with_entropy, n_valid)
        else:
            m, s, w, zl = _forward_stats_torch(x2[:, :n_valid], lab, vocab_start, inv_t, with_entropy, chunk_tokens)
        logp, entropy, lse = _combine(m, s, w, zl, lab, group, tp_size, vocab_total)
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.cfg = (inv_t, vocab_start, impl, chunk_tokens, with_entropy, n_valid)
        logp = logp.view(labels.shape)
        if with_entropy:
            return logp, entropy.view(labels.shape)
        return logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        inv_t, vocab_start, impl, chunk_tokens, with_entropy, n_valid = ctx.cfg
        g_lp = grads[0]
        g_h = grads[1] if with_entropy else None
        nones = (None,) * 10
        if (g_lp is None and g_h is None) or not ctx.needs_input_grad[0]:
            return (None, *nones)
        logits, labels, lse, entropy = ctx.saved_tensors
        shard = logits.shape[-1]
        x2 = logits.reshape(-1, shard)
        lab = labels.reshape(-1)
        g_lp = None if g_lp is None else g_lp.reshape(-1).to(torch.float32).contiguous()
        g_h = None if g_h is None else g_h.reshape(-1).to(torch.float32).contiguous()
        if n_valid == 0:
            grad = torch.zeros_like(x2)
        elif impl == "triton":
            grad = logprob_kernels().backward_grad(x2, lab, lse, entropy, g_lp, g_h, vocab_start, inv_t, n_valid)
        else:
            grad = _backward_grad_torch(x2, lab, lse, entropy, g_lp, g_h, vocab_start, inv_t, chunk_tokens, n_valid)
        return (grad.view(logits.shape), *nones)


# ---------------------------------------------------------------------------------------------
# Per-shard statistics and their combination over the TP group (shared with fnppo.core.ops.linear_logprob)
# ---------------------------------------------------------------------------------------------
def _combine(
    m: Tensor, s: Tensor, w: Tensor | None, zl: Tensor, labels: Tensor, group: Any, tp_size: int, vocab_total: int
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Per-token ``(logprob, entropy, logsumexp)`` from this shard's ``(m, s, w, zl)``.

    ``s`` and ``w`` are relative to the shard max ``m``; with TP they are rescaled to the global
    max (collective 1: an all-reduce MAX of ``m``) and summed with the label logit ``zl``, which is
    0 on the ranks not holding the label (collective 2: one all-reduce SUM).
    """
    if tp_size > 1:
        m_g = m.clone()
        dist.all_reduce(m_g, op=dist.ReduceOp.MAX, group=group)
        shift = torch.where(m_g == float("-inf"), torch.zeros_like(m_g), m_g)
        a = torch.exp(m - shift)  # 0 for a shard without a finite logit on this row
        parts = [s * a]
        if w is not None:
            parts.append(a * (w + torch.where(s > 0, s * (m - shift), torch.zeros_like(s))))
        parts.append(zl)
        packed = torch.stack(parts, dim=-1)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        s, zl, m = packed[:, 0], packed[:, -1], shift
        w = packed[:, 1] if w is not None else None
    log_s = torch.log(s)
    logp = (zl - m) - log_s
    bad = (labels < 0) | (labels >= vocab_total)  # only reachable with call-time checking off
    logp = torch.where(bad, torch.full_like(logp, float("nan")), logp)
    lse = m + log_s
    entropy = None if w is None else log_s - w / s
    return logp.contiguous(), (None if entropy is None else entropy.contiguous()), lse.contiguous()


def _empty_stats(n: int, with_entropy: bool, device: torch.device) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """``(m, s, w, zl)`` of a shard without columns: max -inf, empty sums 0."""
    zeros = torch.zeros(n, dtype=torch.float32, device=device)
    return torch.full_like(zeros, float("-inf")), zeros, (zeros.clone() if with_entropy else None), zeros.clone()


def _chunk_rows(x2: Tensor, chunk_tokens: int | None) -> int:
    n, v = x2.shape
    if chunk_tokens is not None:
        return max(1, chunk_tokens)
    # Two fp32 [rows, v] temporaries at a time: keep them within 1/8 of the logits.
    budget = (n * v * x2.element_size()) // 8
    return max(_MIN_CHUNK_ROWS, budget // max(1, 8 * v))


def _forward_stats_torch(
    x2: Tensor, labels: Tensor, vocab_start: int, inv_t: float, with_entropy: bool, chunk_tokens: int | None
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    n, v = x2.shape
    f32 = dict(dtype=torch.float32, device=x2.device)
    m = torch.empty(n, **f32)
    s = torch.empty(n, **f32)
    w = torch.empty(n, **f32) if with_entropy else None
    zl = torch.empty(n, **f32)
    rows = _chunk_rows(x2, chunk_tokens)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        z = torch.empty((r1 - r0, v), **f32)
        z.copy_(x2[r0:r1])  # our own fp32 temporary: the caller's logits are only read
        z.mul_(inv_t)
        loc = labels[r0:r1].to(torch.int64) - vocab_start
        inside = (loc >= 0) & (loc < v)
        zl_c = z.gather(1, loc.clamp(0, v - 1).unsqueeze(1)).squeeze(1)
        zl[r0:r1] = torch.where(inside, zl_c, torch.zeros_like(zl_c))
        m_c = z.amax(dim=1)
        shift = torch.where(m_c == float("-inf"), torch.zeros_like(m_c), m_c)
        z.sub_(shift.unsqueeze(1))  # z now holds d = z - m
        e = torch.exp(z)
        s[r0:r1] = e.sum(dim=1)
        if w is not None:
            e.mul_(z)  # e d; NaN only where e = 0 and d = -inf (0 log 0), which nansum drops
            w[r0:r1] = torch.nansum(e, dim=1)
        m[r0:r1] = m_c
        del z, e
    return m, s, w, zl


def _backward_grad_torch(
    x2: Tensor,
    labels: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    g_lp: Tensor | None,
    g_h: Tensor | None,
    vocab_start: int,
    inv_t: float,
    chunk_tokens: int | None,
    n_valid: int | None = None,
) -> Tensor:
    """The gradient ``[rows, shard]``: columns ``>= n_valid`` (vocabulary padding) are 0."""
    grad = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    if n_valid is not None and n_valid < x2.shape[1]:
        grad[:, n_valid:] = 0
        x2 = x2[:, :n_valid]
    n, v = x2.shape
    rows = _chunk_rows(x2, chunk_tokens)
    zeros = torch.zeros(n, dtype=torch.float32, device=x2.device)
    a_all = g_lp if g_lp is not None else zeros
    b_all = g_h if g_h is not None else zeros
    h_all = entropy if (entropy is not None and g_h is not None) else zeros
    c_all = -a_all - b_all * h_all  # dz = p (c - b log p) + a 1[j = label]
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        logp = torch.empty((r1 - r0, v), dtype=torch.float32, device=x2.device)
        logp.copy_(x2[r0:r1])
        logp.mul_(inv_t).sub_(lse[r0:r1].unsqueeze(1))
        p = torch.exp(logp)
        if g_h is not None:
            dz = logp.mul_(-b_all[r0:r1].unsqueeze(1)).add_(c_all[r0:r1].unsqueeze(1)).mul_(p)
            dz.masked_fill_(p == 0, 0.0)  # p log p -> 0 for -inf logits
        else:
            dz = p.mul_(c_all[r0:r1].unsqueeze(1))
        if g_lp is not None:
            loc = labels[r0:r1].to(torch.int64) - vocab_start
            inside = (loc >= 0) & (loc < v)
            add = torch.where(inside, a_all[r0:r1], torch.zeros_like(a_all[r0:r1]))
            dz.scatter_add_(1, loc.clamp(0, v - 1).unsqueeze(1), add.unsqueeze(1))
        dz.mul_(inv_t)
        grad[r0:r1, :v].copy_(dz)
        del logp, p, dz
    return grad
