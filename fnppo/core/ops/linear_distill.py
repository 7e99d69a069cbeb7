"""Log-probs, entropy and a divergence to a teacher, straight from both models' hidden states.

:func:`linear_logprob_entropy_and_divergence` is :func:`~fnppo.core.ops.linear_logprob.linear_logprob_and_entropy`
plus, per token, the reverse or forward KL divergence between the student's distribution over the
vocabulary and a frozen teacher's, whose logits come from the teacher's last hidden states and its
output weight (over the same vocabulary partition). One pass over blocks of the vocabulary computes
both models' logits, both normalizers (online log-sum-exps) and the cross sum of the divergence;
the backward recomputes each block of both and contracts it at once into the student's hidden-state
and weight gradients. No ``[tokens, vocab]`` tensor of either model is stored.

Plain torch, no Megatron import. On CUDA the blocks run in Triton kernels
(:mod:`fnppo.core.kernels.linear_distill_triton`, imported on first use); elsewhere a chunked PyTorch
path gives the same results.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from fnppo.core.errors import describe, input_error
from fnppo.core.kernels import distill_kernels, linear_logprob_kernels
from fnppo.core.ops.linear_logprob import (
    _backward_chunks,
    _backward_torch,
    _block_logits,
    _rows,
    _torch_chunks,
)
from fnppo.core.ops.logprob import (
    _FLOAT_DTYPES,
    _check_labels,
    _check_labels_and_options,
    _check_optional_sizes,
    _check_vocab_bound,
    _group_size_rank,
    _resolve_impl,
)
from fnppo.core.typing import Float, Tensor, TokenIds, TokenLogProbs, typechecked, typechecking_enabled

__all__ = ["linear_logprob_entropy_and_divergence", "DIVERGENCE_KINDS", "TEACHER_LOGIT_FLOOR"]

_FN = "fnppo.linear_logprob_entropy_and_divergence"
DIVERGENCE_KINDS = ("reverse_kl", "forward_kl")
"""Values of ``kind``: ``KL(p_student || p_teacher)`` and ``KL(p_teacher || p_student)``."""
TEACHER_LOGIT_FLOOR = -1.0e4
"""Default ``teacher_logit_floor``: scaled teacher logits below it (and non-finite ones) are raised to it."""


@typechecked
def linear_logprob_entropy_and_divergence(
    hidden: Float[Tensor, "*tok hidden"],
    weight: Float[Tensor, "vocab_shard hidden"],
    labels: TokenIds,
    teacher_hidden: Float[Tensor, "*tok teacher_hidden"],
    teacher_weight: Float[Tensor, "vocab_shard teacher_hidden"],
    *,
    kind: str = "reverse_kl",
    tp_group: Any = None,
    temperature: float | int = 1.0,
    teacher_temperature: float | int | None = None,
    with_entropy: bool = True,
    vocab_size: int | None = None,
    teacher_logit_floor: float | int = TEACHER_LOGIT_FLOOR,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    impl: str | None = None,
) -> tuple[TokenLogProbs, TokenLogProbs | None, TokenLogProbs]:
    r"""Student log-prob of each label, student entropy, and a KL divergence to a frozen teacher, per token.

    With ``z_s = hidden @ weight.T / T`` and ``z_t = max(teacher_hidden @ teacher_weight.T / T_t, f)``
    over the full vocabulary (the TP shards concatenated, columns at or beyond ``vocab_size`` left
    out of both), ``p_s = softmax(z_s)``, ``p_t = softmax(z_t)``, ``log p = z - logsumexp(z)``::

        logprobs[t]   = log p_s[t, label_t]
        entropy[t]    = -sum_j p_s log p_s                      (as linear_logprob_and_entropy)
        reverse_kl[t] = sum_j p_s (log p_s - log p_t)  = E_ps[z_s - z_t] - lse_s + lse_t
        forward_kl[t] = sum_j p_t (log p_t - log p_s)  = E_pt[z_t - z_s] - lse_t + lse_s

    One pass over vocabulary blocks keeps, per token, each model's running maximum ``m`` and rescaled
    sum of exponentials (online log-sum-exp, Milakov & Gimelshein 2018) and the cross sum
    ``sum_j e^{z_s - m_s} ((z_s - m_s) - (z_t - m_t))`` (reverse; the models swapped for forward),
    whose terms are relative to each model's maximum, so that a large common offset of either
    model's logits costs no precision. The backward recomputes each block of both models' logits and
    contracts the student's logit gradient at once into ``d hidden`` and ``d weight``::

        dz_s = ( g_lp (1[j = label] - p_s) - g_H p_s (log p_s + H) + g_D D ) / T
        D    = p_s (log p_s - log p_t - KL)     (reverse)      D = p_s - p_t     (forward)

    (Hinton et al. 2015 for the temperatures; Agarwal et al. 2024, "On-Policy Distillation of
    Language Models", and Gu et al. 2024, "MiniLLM", for the reverse KL on the student's samples.)

    The teacher is frozen: no gradient reaches ``teacher_hidden`` or ``teacher_weight``, and either
    requiring grad (with grad mode on) is refused: pass ``.detach()``, which says so in the code.

    Edges. The teacher's log-probs are computed from its logits (``(z_t - m_t) - log s_t``), never
    as the log of an underflowed probability: a teacher log-prob of -200 where the student has mass
    gives the exact, finite divergence and gradient. ``f = teacher_logit_floor`` (default ``-1e4``)
    bounds the *scaled* teacher logits from below, and a non-finite teacher logit (-inf, +inf or NaN,
    from non-finite teacher inputs) becomes ``f``: such a column is a token the teacher gives
    log-prob ``f - lse_t`` (about -1e4), so the reverse KL stays finite where the teacher "never
    produces" a token the student puts mass on, and a token whose teacher logits are all non-finite
    has a uniform teacher over the real vocabulary (``reverse_kl = log V - H``). Nothing is NaN for
    finite student inputs; a token with zero incoming gradients (masked out of the loss) gets
    exactly zero gradient rows. Where the models agree the divergence may be a rounding error below 0.

    Tensor parallelism: as :func:`linear_logprob_and_entropy` (``weight`` and ``teacher_weight`` are
    this rank's rows of the same vocabulary partition; both hidden states full on every rank; each
    rank's ``d hidden`` is its share, summed by the caller). The forward runs two collectives of
    O(tokens): an all-reduce MAX of ``[tokens, 2]`` maxima, then one all-reduce SUM of ``[tokens, 5]``
    (``[tokens, 4]`` without entropy). The backward runs none.

    Precision, memory, time: logits accumulate in fp32 from the inputs' dtypes and all statistics
    are fp32 (values within ~1e-6 of an fp64 reference, relative to the logits' scale). Saved for
    the backward: the inputs as given and five fp32 values per token. The backward's extra memory is
    the student head's (one block of logit gradients, an fp32 ``d hidden`` accumulator): the
    teacher's tile lives in registers (Triton) or one fp32 block (PyTorch path). The teacher's
    logits are computed twice (forward and recompute): ``2 tokens vocab teacher_hidden``
    multiply-adds on top of the head's ``4 tokens vocab hidden``. Without a divergence gradient
    the backward is the head's and does no teacher work.

    Never writes to any input.

    Args:
      hidden: ``[*tok, hidden]`` student hidden states (fp32, bf16, fp16 or fp64).
      weight: ``[vocab_shard, hidden]`` this rank's rows of the student's output weight, ``hidden``'s dtype and device.
      labels: ``[*tok]`` global token ids in ``[0, vocab_size)``, any integer dtype.
      teacher_hidden: ``[*tok, teacher_hidden]`` teacher hidden states (its own width and float dtype),
        same device; no grad.
      teacher_weight: ``[vocab_shard, teacher_hidden]`` this rank's rows of the teacher's output weight
        (the same vocabulary rows as ``weight``), ``teacher_hidden``'s dtype; no grad.
      kind: ``"reverse_kl"`` (``KL(p_s || p_t)``, on-policy distillation's) or ``"forward_kl"``.
      tp_group: the tensor-parallel process group, or None.
      temperature: the student's ``T > 0`` (applied to the log-probs and entropy too).
      teacher_temperature: the teacher's ``T_t > 0``; None: ``temperature``.
      with_entropy: if False, no entropy work is done and ``None`` is returned for it.
      vocab_size: the real global vocabulary size (padding rows beyond it left out of both models and
        given a zero weight gradient). Default: ``vocab_shard * tp_size``.
      teacher_logit_floor: ``f``, a finite float (see above).
      chunk_tokens, chunk_vocab, impl: as for :func:`linear_logprob_and_entropy`.

    Returns:
      ``(logprobs, entropy, divergence)``: fp32 ``[*tok]`` tensors (``entropy`` is None without entropy).

    Raises:
      InputError: bad dtypes, devices, shapes (the teacher's vocabulary rows must be the student's),
        temperatures, ``kind``, ``teacher_logit_floor``, ``vocab_size``, chunk sizes; teacher inputs
        that require grad; labels outside ``[0, vocab_size)`` (while call-time checking is on).
      ShapeError: the annotations above are violated (call-time checking on).
    """
    t, t_t = _check_args(
        hidden, weight, labels, teacher_hidden, teacher_weight, kind, tp_group, temperature, teacher_temperature
    )
    _check_rest(with_entropy, teacher_logit_floor, vocab_size, chunk_tokens, chunk_vocab, weight, tp_group)
    # Triton only when both models' inputs allow it (an fp64 teacher: the PyTorch path, or refused for "triton").
    asked, impl = impl, _resolve_impl(_FN, impl, hidden, "inputs")
    impl = _resolve_impl(_FN, asked, teacher_hidden, "teacher inputs") if impl == "triton" else impl
    tp_size, tp_rank = _group_size_rank(tp_group)
    shard = weight.shape[0]
    vocab_total = shard * tp_size if vocab_size is None else vocab_size
    if typechecking_enabled():
        _check_labels(_FN, labels, vocab_total)
    vocab_start = tp_rank * shard
    n_valid = max(0, min(shard, vocab_total - vocab_start))  # this shard's real (unpadded) rows
    cfg = _Cfg(
        1.0 / t, 1.0 / t_t, float(teacher_logit_floor), kind == "reverse_kl", with_entropy, tp_group, tp_size,
        vocab_start, n_valid, vocab_total, impl, chunk_tokens, chunk_vocab,
    )  # fmt: skip
    out = _LinearDistill.apply(hidden, weight, labels, teacher_hidden, teacher_weight, cfg)
    if with_entropy:
        return out[0], out[1], out[2]
    return out[0], None, out[1]


@dataclasses.dataclass(frozen=True, eq=False)
class _Cfg:
    """Non-tensor arguments of the autograd function (``n_valid``: this shard's real rows)."""

    inv_t: float
    inv_tt: float
    floor: float
    reverse: bool
    with_entropy: bool
    group: Any = None
    tp_size: int = 1
    vocab_start: int = 0
    n_valid: int = 0
    vocab_total: int = 0
    impl: str = "torch"
    chunk_tokens: int | None = None
    chunk_vocab: int | None = None


# ---------------------------------------------------------------------------------------------
# Validation (the label, option and TP checks: fnppo.core.ops.logprob)
# ---------------------------------------------------------------------------------------------
def _check_pair(h: Any, w: Any, h_name: str, w_name: str, lead: tuple[int, ...] | None, rows: int | None) -> None:
    """A hidden-state tensor and its weight: floating, same dtype and device, matching widths."""
    what = "a floating [*tok, hidden] tensor (fp32, bf16, fp16 or fp64)"
    if not isinstance(h, torch.Tensor) or h.dtype not in _FLOAT_DTYPES or h.dim() < 1 or h.shape[-1] == 0:
        raise input_error(_FN, h_name, what + " with hidden > 0", describe(h))
    if lead is not None and tuple(h.shape[:-1]) != lead:
        raise input_error(_FN, h_name, f"leading dims {lead} (those of 'hidden')", describe(h))
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != h.dtype:
        raise input_error(_FN, w_name, f"a [vocab_shard, hidden] tensor of {h_name}'s dtype {describe(h)}", describe(w))
    want_rows = "vocab_shard > 0" if rows is None else f"{rows} (the rows of 'weight': the same vocabulary)"
    if w.shape[1] != h.shape[-1] or w.shape[0] == 0 or (rows is not None and w.shape[0] != rows):
        raise input_error(
            _FN, w_name, f"shape [{want_rows}, {h.shape[-1]}] (hidden size of {h_name} {describe(h)})", describe(w)
        )


def _check_args(
    hidden: Any,
    weight: Any,
    labels: Any,
    teacher_hidden: Any,
    teacher_weight: Any,
    kind: Any,
    tp_group: Any,
    temperature: Any,
    teacher_temperature: Any,
) -> tuple[float, float]:
    # These repeat what the annotations say, so that they hold with call-time checking off too.
    _check_pair(hidden, weight, "hidden", "weight", None, None)
    lead = tuple(hidden.shape[:-1])
    _check_pair(teacher_hidden, teacher_weight, "teacher_hidden", "teacher_weight", lead, weight.shape[0])
    for name, x in (("weight", weight), ("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):
        if x.device != hidden.device:
            raise input_error(_FN, name, f"a tensor on the hidden states' device {hidden.device}", f"one on {x.device}")
    if torch.is_grad_enabled():
        for name, x in (("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):
            if x.requires_grad:
                raise input_error(
                    _FN,
                    name,
                    f"a tensor without grad (the teacher is frozen: pass {name}.detach())",
                    "one requiring grad",
                )
    if not isinstance(kind, str) or kind not in DIVERGENCE_KINDS:
        raise input_error(_FN, "kind", f"one of {DIVERGENCE_KINDS}", repr(kind))
    t = _check_labels_and_options(_FN, labels, hidden, "hidden", "the hidden states'", temperature, tp_group)
    if teacher_temperature is None:
        return t, t
    bad = isinstance(teacher_temperature, bool) or not isinstance(teacher_temperature, (int, float))
    if bad or not (0.0 < float(teacher_temperature) < float("inf")):
        raise input_error(_FN, "teacher_temperature", "None or a finite float > 0", repr(teacher_temperature))
    return t, float(teacher_temperature)


def _check_rest(
    with_entropy: Any,
    floor: Any,
    vocab_size: Any,
    chunk_tokens: Any,
    chunk_vocab: Any,
    weight: Tensor,
    tp_group: Any,
) -> None:
    if not isinstance(with_entropy, bool):
        raise input_error(_FN, "with_entropy", "a bool", repr(with_entropy))
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not math.isfinite(float(floor)):
        raise input_error(_FN, "teacher_logit_floor", "a finite float", repr(floor))
    _check_optional_sizes(_FN, vocab_size=vocab_size, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab)
    if vocab_size is not None:
        tp_size, _ = _group_size_rank(tp_group)
        _check_vocab_bound(_FN, vocab_size, weight.shape[0], tp_size, "rows of all 'weight' shards")


# ---------------------------------------------------------------------------------------------
# The autograd function
# ---------------------------------------------------------------------------------------------
class _LinearDistill(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, t_hidden: Tensor, t_weight: Tensor, cfg: _Cfg
    ) -> Any:
        ctx.set_materialize_grads(False)
        h2, ht2, lab = _rows(hidden), _rows(t_hidden), labels.reshape(-1)
        valid = (weight[: cfg.n_valid], t_weight[: cfg.n_valid])
        if cfg.impl == "triton":
            stats = distill_kernels().forward_stats(h2, valid[0], lab, ht2, valid[1], cfg)
        else:
            stats = _forward_stats_torch(h2, valid[0], lab, ht2, valid[1], cfg)
        logp, entropy, div, lse_s, teacher_norm = _combine(stats, lab, cfg)
        ctx.save_for_backward(hidden, weight, labels, t_hidden, t_weight, lse_s, teacher_norm, div, entropy)
        ctx.cfg = cfg
        outs = (logp, entropy, div) if cfg.with_entropy else (logp, div)
        return tuple(o.view(labels.shape) for o in outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        cfg: _Cfg = ctx.cfg
        g_lp, g_d = grads[0], grads[-1]
        g_h = grads[1] if cfg.with_entropy else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nones = (None,) * 4
        if (g_lp is None and g_h is None and g_d is None) or not (need_h or need_w):
            return (None, None, *nones)
        hidden, weight, labels, t_hidden, t_weight, lse_s, teacher_norm, div, entropy = ctx.saved_tensors
        h2, lab = _rows(hidden), labels.reshape(-1)
        dw = None
        if need_w:
            dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
            dw[cfg.n_valid :].zero_()  # padding rows beyond the real vocabulary
        dw_valid = None if dw is None else dw[: cfg.n_valid]
        coef = _coefficients((g_lp, g_h, g_d), (entropy, div, lse_s, teacher_norm), cfg, h2.shape[0])
        w_valid = weight[: cfg.n_valid]
        if g_d is None:  # no divergence gradient: the student head's backward, no teacher work
            head = (coef[0], coef[1], coef[2], lse_s)
            args = (h2, w_valid, lab, head, g_h is not None, cfg, need_h, dw_valid)
            if cfg.impl == "triton":
                sizes = _backward_chunks(h2.shape[0], weight.shape[0], h2.shape[1], h2.element_size(), cfg)
                dh = linear_logprob_kernels().backward_grads(*args, **sizes)
            else:
                dh = _backward_torch(*args)
        else:
            teacher = (_rows(t_hidden), t_weight[: cfg.n_valid])
            args = (h2, w_valid, lab, teacher, coef, cfg, need_h, dw_valid)
            if cfg.impl == "triton":
                sizes = _backward_chunks(h2.shape[0], weight.shape[0], h2.shape[1], h2.element_size(), cfg)
                dh = distill_kernels().backward_grads(*args, **sizes)
            else:
                dh = _backward_distill_torch(*args)
        return (None if dh is None else dh.view(hidden.shape)), dw, *nones


def _coefficients(grads: tuple[Tensor | None, ...], saved: tuple[Tensor, ...], cfg: _Cfg, n: int) -> tuple[Tensor, ...]:
    """Per-token ``(a, B, C, G, lse_s, m_t, log s_t)`` of the block of logit gradients (natural units, before ``1/T``)::

        reverse:  dz = p_s (C - B log p_s - G log p_t) + a 1[j = label],   log p_t = (z_t - m_t) - log s_t
        forward:  dz = p_s (C - B log p_s) - G p_t + a 1[j = label]

    with ``a = g_lp``, ``b = g_H``, ``g = g_D``, ``c = -a - b H``: reverse ``C = c - g KL``,
    ``B = b - g``; forward ``C = c + g``, ``B = b``; ``G = g``. Without a divergence gradient
    ``(a, b, c)`` are the student head's (``G = 0``).
    """
    (g_lp, g_h, g_d), (entropy, div, lse_s, teacher_norm) = grads, saved
    zeros = torch.zeros(n, dtype=torch.float32, device=lse_s.device)
    a = zeros if g_lp is None else g_lp.reshape(-1).to(torch.float32)
    b = zeros if g_h is None else g_h.reshape(-1).to(torch.float32)
    c = -a if g_h is None else -a - b * entropy
    g = zeros if g_d is None else g_d.reshape(-1).to(torch.float32)
    if g_d is not None:
        if cfg.reverse:
            c, b = c - g * div, b - g
        else:
            c = c + g
    return tuple(x.contiguous() for x in (a, b, c, g, lse_s, teacher_norm[0], teacher_norm[1]))


# ---------------------------------------------------------------------------------------------
# Per-shard statistics and their combination over the TP group
# ---------------------------------------------------------------------------------------------
def _combine(stats: tuple[Tensor | None, ...], labels: Tensor, cfg: _Cfg) -> tuple[Any, ...]:
    """Per-token ``(logprob, entropy, divergence, lse_s, [m_t, log s_t])`` from this shard's statistics.

    ``stats = (m_s, s_s, w_s, zl, m_t, s_t, x)``: each model's maximum and sum of exponentials
    relative to it, the student's entropy sum, the label logit (0 off the label's shard) and the
    cross sum ``x = sum_j e^{z_s - m_s} ((z_s - m_s) - (z_t - m_t))`` (reverse; the forward KL's
    swaps the models). Its terms are differences of logits *relative to each model's maximum*, so
    a large common offset of either model's logits costs no precision.
    With TP: an all-reduce MAX of both maxima, then one all-reduce SUM of the rescaled sums.
    """
    m_s, s_s, w_s, zl, m_t, s_t, x = stats
    if cfg.tp_size > 1:
        big = torch.stack([m_s, m_t], dim=-1)
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=cfg.group)
        big = torch.where(big == float("-inf"), torch.zeros_like(big), big)
        a_s, a_t = torch.exp(m_s - big[:, 0]), torch.exp(m_t - big[:, 1])  # 0 on a shard without columns
        parts = [s_s * a_s]
        if w_s is not None:
            parts.append(a_s * (w_s + torch.where(s_s > 0, s_s * (m_s - big[:, 0]), torch.zeros_like(s_s))))
        own, other = (m_s - big[:, 0], m_t - big[:, 1]) if cfg.reverse else (m_t - big[:, 1], m_s - big[:, 0])
        parts += [
            zl,
            s_t * a_t,
            _rescale_cross(x, s_s if cfg.reverse else s_t, own, other, a_s if cfg.reverse else a_t),
        ]
        packed = torch.stack(parts, dim=-1)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=cfg.group)
        m_s, m_t = big[:, 0], big[:, 1]
        s_s, zl, s_t, x = packed[:, 0], packed[:, -3], packed[:, -2], packed[:, -1]
        w_s = packed[:, 1] if w_s is not None else None
    log_s, log_t = torch.log(s_s), torch.log(s_t)
    logp = (zl - m_s) - log_s
    bad = (labels < 0) | (labels >= cfg.vocab_total)  # only reachable with call-time checking off
    logp = torch.where(bad, torch.full_like(logp, float("nan")), logp)
    entropy = None if w_s is None else (log_s - w_s / s_s).contiguous()
    if cfg.reverse:  # E_ps[(z_s - m_s) - (z_t - m_t)] - log s_s + log s_t
        div = x / s_s + (log_t - log_s)
    else:  # E_pt[(z_t - m_t) - (z_s - m_s)] - log s_t + log s_s
        div = x / s_t + (log_s - log_t)
    # The teacher's log-probs are (z_t - m_t) - log s_t in the backward: exact for logits near the floor too.
    return logp.contiguous(), entropy, div.contiguous(), (m_s + log_s).contiguous(), torch.stack([m_t, log_t])


# ---------------------------------------------------------------------------------------------
# The PyTorch path (CPU, CI; any device)
# ---------------------------------------------------------------------------------------------
def _teacher_logits(ht32: Tensor, wt_block: Tensor, cfg: _Cfg) -> Tensor:
    """``max(teacher_hidden @ teacher_weight_block.T / T_t, floor)`` in fp32, non-finite values -> ``floor``."""
    zt = torch.mm(ht32, wt_block.to(torch.float32).t()).mul_(cfg.inv_tt)
    return zt.nan_to_num_(nan=cfg.floor, posinf=cfg.floor, neginf=cfg.floor).clamp_(min=cfg.floor)


def _online(m: Tensor, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """New maximum, the old sums' rescaling ``e^{m - m'}`` and ``e^{z - m'}`` (``z`` a block with a finite max)."""
    m_new = torch.maximum(m, z.amax(dim=1))
    return m_new, torch.exp(m - m_new), torch.exp(z - m_new.unsqueeze(1))


def _rescale_cross(x: Tensor, s: Tensor, own: Tensor, other: Tensor, alpha: Tensor) -> Tensor:
    """A cross sum moved to new maxima: ``alpha (x + s (own - other))``, ``own``/``other`` the changes
    ``m - m'`` of the weighting model's and the other model's maxima (no term where ``s = 0``)."""
    return alpha * (x + torch.where(s > 0, s * (own - other), torch.zeros_like(s)))


def _forward_stats_torch(
    h2: Tensor, w_valid: Tensor, labels: Tensor, ht2: Tensor, wt_valid: Tensor, cfg: _Cfg
) -> tuple[Tensor | None, ...]:
    """This shard's ``(m_s, s_s, w_s, zl, m_t, s_t, x)`` (see :func:`_combine`), over fp32 blocks."""
    n, n_valid = h2.shape[0], w_valid.shape[0]
    f32 = dict(dtype=torch.float32, device=h2.device)
    m_s, m_t = torch.full((n,), float("-inf"), **f32), torch.full((n,), float("-inf"), **f32)
    s_s, s_t, zl, x = (torch.zeros(n, **f32) for _ in range(4))
    w_s = torch.zeros(n, **f32) if cfg.with_entropy else None
    rows, cols = _torch_chunks(n, n_valid, h2.element_size() + ht2.element_size(), cfg)
    for r0 in range(0, n, rows):
        sl = slice(r0, min(n, r0 + rows))
        h32, ht32 = h2[sl].to(torch.float32), ht2[sl].to(torch.float32)
        loc = labels[sl].to(torch.int64) - cfg.vocab_start
        for c0 in range(0, n_valid, cols):
            z = _block_logits(h32, w_valid[c0 : c0 + cols], cfg.inv_t)
            zt = _teacher_logits(ht32, wt_valid[c0 : c0 + cols], cfg)
            inside = (loc >= c0) & (loc < c0 + z.shape[1])
            picked = z.gather(1, (loc - c0).clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
            zl[sl] += torch.where(inside, picked, torch.zeros_like(picked))
            m_new, alpha, e = _online(m_s[sl], z)
            mt_new, alpha_t, et = _online(m_t[sl], zt)
            d, dt = z.sub_(m_new.unsqueeze(1)), zt.sub_(mt_new.unsqueeze(1))  # relative to the new maxima
            own, other = m_s[sl] - m_new, m_t[sl] - mt_new
            if cfg.reverse:
                x[sl] = _rescale_cross(x[sl], s_s[sl], own, other, alpha) + (e * (d - dt)).sum(dim=1)
            else:
                x[sl] = _rescale_cross(x[sl], s_t[sl], other, own, alpha_t) + (et * (dt - d)).sum(dim=1)
            if w_s is not None:
                rel = torch.where(s_s[sl] > 0, s_s[sl] * own, torch.zeros_like(m_new))
                w_s[sl] = alpha * (w_s[sl] + rel) + (e * d).sum(dim=1)
            s_s[sl] = alpha * s_s[sl] + e.sum(dim=1)
            s_t[sl] = alpha_t * s_t[sl] + et.sum(dim=1)
            m_s[sl], m_t[sl] = m_new, mt_new
    return m_s, s_s, w_s, zl, m_t, s_t, x


def _backward_distill_torch(
    h2: Tensor,
    w_valid: Tensor,
    labels: Tensor,
    teacher: tuple[Tensor, Tensor],
    coef: tuple[Tensor, ...],
    cfg: _Cfg,
    need_h: bool,
    dw: Tensor | None,
) -> Tensor | None:
    """Vocabulary blocks outside, token blocks inside, fp32 accumulators; writes ``dw``, returns ``dh``."""
    ht2, wt_valid = teacher
    n, hid = h2.shape
    rows, cols = _torch_chunks(n, cfg.n_valid, h2.element_size() + ht2.element_size(), cfg)
    dh_acc = torch.zeros((n, hid), dtype=torch.float32, device=h2.device) if need_h else None
    for c0 in range(0, cfg.n_valid, cols):
        wb32 = w_valid[c0 : c0 + cols].to(torch.float32)
        dw_acc = torch.zeros(wb32.shape, dtype=torch.float32, device=h2.device) if dw is not None else None
        for r0 in range(0, n, rows):
            sl = slice(r0, min(n, r0 + rows))
            h32 = h2[sl].to(torch.float32)
            zt = _teacher_logits(ht2[sl].to(torch.float32), wt_valid[c0 : c0 + cols], cfg)
            dz = _block_grad(_block_logits(h32, wb32, cfg.inv_t), zt, labels[sl], c0, [t[sl] for t in coef], cfg)
            if dh_acc is not None:
                dh_acc[sl].addmm_(dz, wb32)
            if dw_acc is not None:
                dw_acc.addmm_(dz.t(), h32)
        if dw is not None:
            dw[c0 : c0 + cols].copy_(dw_acc)
    return None if dh_acc is None else dh_acc.to(h2.dtype)


def _block_grad(z: Tensor, zt: Tensor, labels: Tensor, c0: int, coef: list[Tensor], cfg: _Cfg) -> Tensor:
    """The block of student logit gradients (fp32) from the blocks of scaled logits ``z``, ``zt`` (overwritten)."""
    a, b, c, g, lse_s, m_t, log_st = (t.unsqueeze(1) for t in coef)
    logp = z.sub_(lse_s)
    p = torch.exp(logp)
    if cfg.reverse:
        dz = logp.mul_(-b).add_(c).sub_(zt.sub_(m_t).sub_(log_st).mul_(g)).mul_(p)
    else:
        dz = logp.mul_(-b).add_(c).mul_(p).sub_(zt.sub_(m_t).sub_(log_st).exp_().mul_(g))
    loc = labels.to(torch.int64) - cfg.vocab_start - c0
    inside = (loc >= 0) & (loc < dz.shape[1])
    add = torch.where(inside, a.squeeze(1), torch.zeros_like(a.squeeze(1)))
    dz.scatter_add_(1, loc.clamp(0, dz.shape[1] - 1).unsqueeze(1), add.unsqueeze(1))
    return dz.mul_(cfg.inv_t)
