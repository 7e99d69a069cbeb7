"""The student's log-probs and entropy with a divergence to a teacher (or the student's log-probs at
a teacher's top-k ids), from vocab-parallel logits, in one autograd function.

:func:`logprob_entropy_and_divergence` is what distillation adds to :func:`fnppo.logprob_and_entropy`:
per token, the reverse KL ``KL(student || teacher)`` or the forward KL ``KL(teacher || student)``
over the full vocabulary, with the teacher given as its logits (the same vocabulary shard) or as
its final hidden states and output-weight shard (its logits then exist one chunk of rows at a
time). :func:`logprob_entropy_and_topk` gives the student's log-probs at ``k`` token ids per
position (a teacher's top-k, from an inference engine); the top-k divergences are functions of
those (:func:`fnppo.core.losses.distill.topk_divergence`).

One autograd function computes everything the loss reads from the student's logits, so its
backward writes one gradient of the logits' size (the only ``[tokens, vocab]`` tensor it creates);
nothing is written to the inputs, nothing of that size is saved but the inputs themselves, and
the teacher gets no gradient. Plain torch (row chunks, :mod:`fnppo.core.ops.divergence_chunks`),
no Megatron import: pass the tensor-parallel ``torch.distributed`` process group.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from fnppo.core.errors import describe, input_error
from fnppo.core.ops.divergence_chunks import Teacher, divergence_sums, shard_stats, student_grad
from fnppo.core.ops.logprob import _check_args, _check_labels, _group_size_rank
from fnppo.core.typing import (
    Float,
    Float32,
    Integer,
    Tensor,
    TokenIds,
    TokenLogProbs,
    VocabLogits,
    typechecked,
    typechecking_enabled,
)

__all__ = ["logprob_entropy_and_divergence", "logprob_entropy_and_topk", "DIVERGENCES", "LOGPROB_FLOOR"]

DIVERGENCES = ("reverse_kl", "forward_kl")
"""The divergences: ``"reverse_kl"`` = ``KL(student || teacher)``, ``"forward_kl"`` = ``KL(teacher || student)``."""

LOGPROB_FLOOR = -100.0
"""The default floor of the teacher's log-probs inside the reverse KL's log-ratio (nats): about the
log of the smallest normal fp32 probability (``log 1.2e-38 = -87.3``) minus a margin; NeMo-RL's
``log_infinitesimal`` of its top-k loss is the same -100."""

_FN = "fnppo.logprob_entropy_and_divergence"
_FN_TOPK = "fnppo.logprob_entropy_and_topk"


@typechecked
def logprob_entropy_and_divergence(
    logits: VocabLogits,
    labels: TokenIds,
    *,
    teacher_logits: Float[Tensor, "*tok vocab_shard"] | None = None,
    teacher_hidden: Float[Tensor, "*tok teacher_hidden"] | None = None,
    teacher_weight: Float[Tensor, "vocab_shard teacher_hidden"] | None = None,
    kind: str = "reverse_kl",
    tp_group: Any = None,
    temperature: float | int = 1.0,
    with_entropy: bool = True,
    vocab_size: int | None = None,
    logprob_floor: float | int = LOGPROB_FLOOR,
    chunk_tokens: int | None = None,
) -> tuple[TokenLogProbs, TokenLogProbs | None, TokenLogProbs]:
    r"""Log-prob of each label, entropy, and the divergence to a teacher over the full vocabulary.

    With the student's ``z = x / T`` and the teacher's ``y = u / T`` over the real vocabulary (the
    TP shards concatenated, columns ``>= vocab_size`` left out of both), ``lp = log_softmax(z)``,
    ``lq = log_softmax(y)``, ``p = e^{lp}``, ``q = e^{lq}``::

        logprobs[t] = lp[t, label_t]                   entropy[t] = -sum_j p_j lp_j
        reverse_kl[t] = sum_j p_j (lp_j - max(lq_j, floor))        (KL(student || teacher))
        forward_kl[t] = sum_j q_j (lq_j - lp_j)                    (KL(teacher || student))

    and the gradient of the student's logits, written once (``D`` the divergence, ``g_*`` the
    incoming gradients)::

        dL/dx_j = ( g_lp (1[j = label] - p_j) - g_H p_j (lp_j + H)
                    + g_D p_j (lp_j - max(lq_j, floor) - D)     [reverse_kl]
                    + g_D (p_j - q_j)                            [forward_kl] ) / T

    Edges: a term whose weight is 0 (``p_j = 0`` in the reverse KL, ``q_j = 0`` in the forward) is
    exactly 0, never ``0 * inf``; the floor (default :data:`LOGPROB_FLOOR` = -100) bounds the
    reverse KL's log-ratio where the teacher gives a token (almost) no mass, so a teacher logit of
    ``-inf`` (a token it never produces, padding) gives a finite divergence and gradient (the
    student's token ``j`` is pushed down with weight ``p_j (lp_j - floor - D)``); the floor is a
    constant of the loss (no gradient flows through it) and leaves every ``lq_j >= floor``
    unchanged. A teacher row without any finite logit has ``lq = -inf`` everywhere (reverse KL:
    all floored; forward KL: 0). The forward KL needs the student's logits finite wherever the
    teacher has mass (a model's are).

    Tensor parallelism: both logits are this rank's contiguous shard of the same vocabulary
    partition (rank ``r`` holds columns ``r * vocab_shard ...``). The forward runs three collectives
    over the group, each moving O(tokens) values and never the logits: an all-reduce MAX of the
    student's and the teacher's row maxima, an all-reduce SUM of the rescaled sums (and the
    label's logit), then, with the normalizers known, an all-reduce SUM of the divergence's shard
    parts. The backward needs none.

    Teacher as hidden states: ``teacher_hidden`` ``[*tok, teacher_hidden]`` (the teacher's final
    norm output, the full hidden state on every TP rank) and ``teacher_weight``
    ``[vocab_shard, teacher_hidden]`` (this rank's rows of the teacher's output layer): the
    teacher's logits ``hidden @ weight.T`` are computed one chunk of rows at a time, in the inputs'
    dtype (three times: two forward passes and the backward), and never held whole.

    Memory: saved for backward are the inputs as given (no copy) and four fp32 values per token;
    the temporaries are fp32 chunks of about 1/8 of the logits; the backward creates the gradient
    (one logits-sized tensor in the logits' dtype), nothing else of that size.

    Precision: statistics and sums are fp32 for every input dtype (fp64 inputs too); the divergence
    agrees with an fp64 reference to fp32 rounding of the log-probs (absolute ~1e-7 times the
    logits' range).

    Args:
      logits: ``[*tok, vocab_shard]`` student logits (fp32, bf16, fp16 or fp64), this rank's shard.
      labels: ``[*tok]`` global token ids in ``[0, vocab_size)``.
      teacher_logits: ``[*tok, vocab_shard]`` the teacher's logits shard, or None.
      teacher_hidden, teacher_weight: the teacher as hidden states and output-weight shard (both or
        neither; exactly one of the two teacher forms).
      kind: one of :data:`DIVERGENCES`.
      tp_group: the tensor-parallel process group, or None.
      temperature: ``T > 0``, applied to both the student's and the teacher's logits.
      with_entropy: if False, no entropy work is done and ``None`` is returned for it.
      vocab_size: the real vocabulary (global), as in :func:`fnppo.logprob_and_entropy`.
      logprob_floor: the reverse KL's floor of the teacher's log-probs, a finite number <= 0.
      chunk_tokens: rows per chunk (default: from the memory budget above).

    Returns:
      ``(logprobs, entropy, divergence)``: fp32 ``[*tok]`` (``entropy`` None without entropy).

    Raises:
      InputError: the checks of :func:`fnppo.logprob_and_entropy`; no teacher or both teacher
        forms; a teacher tensor on another device; an unknown ``kind``; a ``logprob_floor`` that
        is not a finite number <= 0.

    References: the KL directions of on-policy distillation, Agarwal et al. 2024 (GKD,
    arXiv:2306.13649) and Gu et al. 2024 (MiniLLM, arXiv:2306.08543); NeMo-RL's full-vocabulary
    reverse KL from the teacher's hidden states (its distillation docs).
    """
    t = _check_args(logits, labels, tp_group, temperature, vocab_size, chunk_tokens)
    teacher = _check_teacher(logits, teacher_logits, teacher_hidden, teacher_weight)
    floor = _check_kind_floor(_FN, kind, logprob_floor)
    cfg = _config(logits, labels, tp_group, t, with_entropy, vocab_size, chunk_tokens, _FN)
    cfg.kind, cfg.floor = kind, floor
    out = _StudentTeacher.apply(logits, labels, None, *_teacher_tensors(teacher), cfg)
    return out[0], (out[1] if with_entropy else None), out[2]


@typechecked
def logprob_entropy_and_topk(
    logits: VocabLogits,
    labels: TokenIds,
    topk_ids: Integer[Tensor, "*tok k"],
    *,
    tp_group: Any = None,
    temperature: float | int = 1.0,
    with_entropy: bool = True,
    vocab_size: int | None = None,
    chunk_tokens: int | None = None,
) -> tuple[TokenLogProbs, TokenLogProbs | None, Float32[Tensor, "*tok k"]]:
    r"""Log-prob of each label, entropy, and the student's log-probs at ``k`` given ids per token.

    ``topk_logprobs[t, i] = z[t, id_{t,i}] - logsumexp_j z[t, j]`` (``z = x / T`` over the real
    vocabulary), the gradient ``dL/dx_j = sum_i g_i (1[j = id_i] - p_j) / T`` added to that of the
    log-prob and entropy of :func:`fnppo.logprob_and_entropy`, in the same one gradient buffer.
    Under tensor parallelism each id's logit comes from the rank that holds it (one all-reduce SUM
    of ``[tokens, k + 2]`` values after the MAX of the row maxima).

    Args:
      logits, labels, tp_group, temperature, with_entropy, vocab_size, chunk_tokens: as
        :func:`fnppo.logprob_and_entropy`.
      topk_ids: ``[*tok, k]`` global token ids in ``[0, vocab_size)`` (e.g. a teacher's top-k).

    Returns:
      ``(logprobs, entropy, topk_logprobs)``: fp32 ``[*tok]``, ``[*tok]`` (or None), ``[*tok, k]``.

    Raises:
      InputError: the checks of :func:`fnppo.logprob_and_entropy`; ``topk_ids`` out of range
        (while call-time checking is on), on another device or with ``k = 0``.
    """
    t = _check_args(logits, labels, tp_group, temperature, vocab_size, chunk_tokens)
    if topk_ids.device != logits.device or topk_ids.shape[-1] == 0:
        raise input_error(_FN_TOPK, "topk_ids", f"[*tok, k >= 1] ids on {logits.device}", describe(topk_ids))
    cfg = _config(logits, labels, tp_group, t, with_entropy, vocab_size, chunk_tokens, _FN_TOPK)
    if typechecking_enabled():
        _check_labels(_FN_TOPK, topk_ids, cfg.vocab_total, vocab_size is not None)
    out = _StudentTeacher.apply(logits, labels, topk_ids, None, None, None, cfg)
    return out[0], (out[1] if with_entropy else None), out[3]


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def _check_teacher(logits: Tensor, t_logits: Any, t_hidden: Any, t_weight: Any) -> Teacher:
    have = [t_logits is not None, t_hidden is not None or t_weight is not None]
    if sum(have) != 1 or (have[1] and (t_hidden is None or t_weight is None)):
        raise input_error(
            _FN,
            "teacher_logits",
            "exactly one teacher: teacher_logits, or teacher_hidden with teacher_weight",
            f"teacher_logits={_short(t_logits)}, teacher_hidden={_short(t_hidden)}, teacher_weight={_short(t_weight)}",
        )
    for name, x in (("teacher_logits", t_logits), ("teacher_hidden", t_hidden), ("teacher_weight", t_weight)):
        if x is not None and x.device != logits.device:
            raise input_error(_FN, name, f"a tensor on the logits' device {logits.device}", f"one on {x.device}")
    if t_hidden is not None and t_hidden.dtype != t_weight.dtype:
        raise input_error(_FN, "teacher_weight", f"the dtype of teacher_hidden ({t_hidden.dtype})", describe(t_weight))
    return Teacher(t_logits, t_hidden, t_weight)


def _short(x: Any) -> str:
    return describe(x) if isinstance(x, Tensor) else repr(x)


def _check_kind_floor(fn: str, kind: Any, floor: Any) -> float:
    if kind not in DIVERGENCES:
        raise input_error(fn, "kind", f"one of {DIVERGENCES}", repr(kind))
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not math.isfinite(floor) or floor > 0:
        raise input_error(fn, "logprob_floor", "a finite number <= 0 (nats)", repr(floor))
    return float(floor)


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
        "chunk_tokens",
        "kind",
        "floor",
    )


def _config(
    logits: Tensor,
    labels: Tensor,
    group: Any,
    t: float,
    with_entropy: bool,
    vocab_size: int | None,
    chunk_tokens: int | None,
    fn: str,
) -> _Cfg:
    tp_size, tp_rank = _group_size_rank(group)
    shard = logits.shape[-1]
    cfg = _Cfg()
    cfg.inv_t, cfg.with_entropy, cfg.group, cfg.tp_size = 1.0 / t, bool(with_entropy), group, tp_size
    cfg.vocab_total = shard * tp_size if vocab_size is None else vocab_size
    cfg.vocab_start = tp_rank * shard
    cfg.n_valid = max(0, min(shard, cfg.vocab_total - cfg.vocab_start))
    cfg.chunk_tokens, cfg.kind, cfg.floor = chunk_tokens, None, LOGPROB_FLOOR
    if typechecking_enabled():
        _check_labels(fn, labels, cfg.vocab_total, vocab_size is not None)
    return cfg


def _teacher_tensors(teacher: Teacher) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    return teacher.logits, teacher.hidden, teacher.weight


# ---------------------------------------------------------------------------------------------
# The autograd function
# ---------------------------------------------------------------------------------------------
class _StudentTeacher(torch.autograd.Function):
    """Outputs ``(logprobs, entropy, divergence, topk_logprobs)`` (the last two zeros ``[n]`` /
    ``[n, 0]`` when not asked for); the gradient flows to the student's logits only."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        labels: Tensor,
        topk_ids: Tensor | None,
        t_logits: Tensor | None,
        t_hidden: Tensor | None,
        t_weight: Tensor | None,
        cfg: _Cfg,
    ) -> Any:
        ctx.set_materialize_grads(False)
        shard = logits.shape[-1]
        x2 = logits.reshape(-1, shard)
        lab = labels.reshape(-1)
        n = x2.shape[0]
        ids = None if topk_ids is None else topk_ids.reshape(n, -1)
        teacher = _flat_teacher(t_logits, t_hidden, t_weight, n, shard)
        stats = _stats(x2, lab, ids, teacher, cfg)
        lse, lse_t, logp, ent, zk = _combine(stats, lab, ids, teacher is not None, cfg)
        div = torch.zeros(n, dtype=torch.float32, device=x2.device)
        if teacher is not None:
            part = divergence_sums(x2, teacher, lse, lse_t, cfg) if cfg.n_valid else div
            div = _all_reduce_sum(part.clone(), cfg)
        topk_lp = torch.zeros((n, 0), dtype=torch.float32, device=x2.device) if ids is None else zk - lse.unsqueeze(1)
        saved_ent = ent if ent is not None else torch.zeros_like(lse)
        ctx.save_for_backward(logits, labels, topk_ids, t_logits, t_hidden, t_weight, lse, lse_t, saved_ent, div)
        ctx.cfg = cfg
        tok = labels.shape
        ent_out = saved_ent if cfg.with_entropy else torch.zeros_like(lse)
        topk_shape = (*tok, ids.shape[1]) if ids is not None else (*tok, 0)
        return logp.view(tok), ent_out.view(tok), div.view(tok), topk_lp.reshape(topk_shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_lp: Any, g_ent: Any, g_div: Any, g_topk: Any) -> Any:
        cfg = ctx.cfg
        nones = (None,) * 6
        if not ctx.needs_input_grad[0] or all(g is None for g in (g_lp, g_ent, g_div, g_topk)):
            return (None, *nones)
        logits, labels, topk_ids, t_logits, t_hidden, t_weight, lse, lse_t, ent, div = ctx.saved_tensors
        shard = logits.shape[-1]
        x2 = logits.reshape(-1, shard)
        n = x2.shape[0]
        if cfg.n_valid == 0:
            return (torch.zeros_like(logits), *nones)
        ids = None if topk_ids is None else topk_ids.reshape(n, -1)
        teacher = _flat_teacher(t_logits, t_hidden, t_weight, n, shard)

        def flat(g: Any, *shape: int) -> Tensor | None:
            return None if g is None else g.reshape(*shape).to(torch.float32)

        grads = {
            "lp": flat(g_lp, n),
            "ent": flat(g_ent, n) if cfg.with_entropy else None,
            "div": flat(g_div, n) if teacher is not None else None,
            "topk": flat(g_topk, n, -1) if ids is not None else None,
        }
        if teacher is not None and grads["div"] is None:
            teacher = None  # no divergence gradient: the teacher is not read again
        saved = {"lse": lse, "lse_t": lse_t, "ent": ent, "div": div}
        grad = student_grad(x2, labels.reshape(-1), ids, teacher, saved, grads, cfg)
        return (grad.view(logits.shape), *nones)


def _flat_teacher(t_logits: Any, t_hidden: Any, t_weight: Any, n: int, shard: int) -> Teacher | None:
    if t_logits is not None:
        return Teacher(t_logits.reshape(n, shard), None, None)
    if t_hidden is not None:
        return Teacher(None, t_hidden.reshape(n, t_hidden.shape[-1]), t_weight)
    return None


def _stats(x2: Tensor, lab: Tensor, ids: Tensor | None, teacher: Teacher | None, cfg: _Cfg) -> dict[str, Tensor]:
    """This shard's row statistics (:func:`~fnppo.core.ops.divergence_chunks.shard_stats`); a shard of
    padding only has none: maxima -inf, sums 0."""
    if cfg.n_valid:
        return shard_stats(x2, lab, ids, teacher, cfg)
    n = x2.shape[0]
    zeros = torch.zeros(n, dtype=torch.float32, device=x2.device)
    out = {"m": torch.full_like(zeros, float("-inf")), "s": zeros, "zl": zeros.clone(), "w": zeros.clone()}
    if ids is not None:
        out["zk"] = torch.zeros(ids.shape, dtype=torch.float32, device=x2.device)
    if teacher is not None:
        out["mt"], out["st"] = torch.full_like(zeros, float("-inf")), zeros.clone()
    return out


def _all_reduce_sum(x: Tensor, cfg: _Cfg) -> Tensor:
    if cfg.tp_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=cfg.group)
    return x


def _combine(
    st: dict[str, Tensor], lab: Tensor, ids: Tensor | None, has_teacher: bool, cfg: _Cfg
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None, Tensor | None]:
    """``(lse, lse_t, logprobs, entropy, zk)`` from the shards' statistics: one all-reduce MAX of the
    row maxima, one all-reduce SUM of the rescaled sums (two collectives under TP, none without)."""
    maxima = torch.stack([st["m"], st["mt"]], dim=1) if has_teacher else st["m"].unsqueeze(1)
    local = maxima.clone()
    if cfg.tp_size > 1:
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=cfg.group)
    shift = torch.where(maxima == float("-inf"), torch.zeros_like(maxima), maxima)
    scale = torch.exp(local - shift)  # 0 for a shard without a finite value on a row
    parts = [st["s"] * scale[:, 0]]
    if cfg.with_entropy:
        s, w = st["s"], st["w"]
        parts.append(scale[:, 0] * (w + torch.where(s > 0, s * (st["m"] - shift[:, 0]), torch.zeros_like(s))))
    if has_teacher:
        parts.append(st["st"] * scale[:, 1])
    parts.append(st["zl"])
    cols = [p.unsqueeze(1) for p in parts]
    if ids is not None:
        cols.append(st["zk"])
    packed = _all_reduce_sum(torch.cat(cols, dim=1), cfg)
    s_g = packed[:, 0]
    i = 1
    entropy = None
    if cfg.with_entropy:
        entropy = torch.log(s_g) - packed[:, 1] / s_g
        i = 2
    lse_t = None
    if has_teacher:
        st_g = packed[:, i]
        # a teacher row without a finite logit: lse_t = +inf, so that every lq = -inf
        lse_t = torch.where(st_g > 0, shift[:, 1] + torch.log(st_g), torch.full_like(st_g, float("inf")))
        i += 1
    zl = packed[:, i]
    zk = packed[:, i + 1 :] if ids is not None else None
    lse = shift[:, 0] + torch.log(s_g)
    logp = zl - lse
    bad = (lab < 0) | (lab >= cfg.vocab_total)  # only reachable with call-time checking off
    logp = torch.where(bad, torch.full_like(logp, float("nan")), logp)
    if zk is not None:
        bad_k = (ids < 0) | (ids >= cfg.vocab_total)
        zk = torch.where(bad_k, torch.full_like(zk, float("nan")), zk)
    return lse.contiguous(), lse_t, logp.contiguous(), entropy, zk
