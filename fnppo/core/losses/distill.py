"""Distillation terms of a loss: the teacher signals, the divergence parts and the top-k divergence (pure torch).

A distillation term pulls the student's next-token distribution toward a teacher's at every
trained token (on-policy distillation: the student sampled the tokens)::

    LossConfig(policy=None, distill=ReverseKL(coef=1.0, teacher=TopK()))        # from the samples' top-k
    LossConfig(policy=ppo_clip(), distill=ReverseKL(0.5, teacher=TeacherModel(chunks)))   # fnppo.steps

* :class:`TeacherSignal` -- where the teacher's distribution comes from. :class:`TopK` (here): the
  teacher's top-k log-probs and token ids that the samples carry (``Sample.teacher_topk_ids`` /
  ``teacher_topk_logprobs``, what an inference engine returns). A teacher model evaluated inside
  the step is :class:`fnppo.steps.teacher.TeacherModel` (its hidden states and output layer give
  the full-vocabulary divergence of :func:`fnppo.core.ops.divergence.logprob_entropy_and_divergence`).
* :class:`ReverseKL` (``KL(student || teacher)``, mode-seeking; the usual on-policy distillation
  objective) and :class:`ForwardKL` (``KL(teacher || student)``) -- the parts, each a term of the
  objective with its coefficient, aggregation and normalizer (:mod:`fnppo.core.losses.terms`).
* :func:`topk_divergence` -- the divergence over a teacher's top-k set ``S``, with the tail (the
  mass outside ``S``) handled explicitly: ``"bucket"`` (the default: one more category holding the
  remaining mass of each side, the exact KL of the two ``k + 1``-category distributions, a lower
  bound of the full KL) or ``"renormalize"`` (both sides renormalized over ``S``).

Why a tail bucket by default: the truncated sum ``sum_{j in S} p_j log(p_j / q_j)`` is not a
divergence (it is negative whenever the student's mass in ``S`` is below the teacher's), and its
reverse-KL form can be made small by shrinking the student's own mass in ``S``: verl's on-policy
distillation PR (#5041) records that its top-k reverse KL was unstable for that reason; renormalizing
over ``S`` removes the incentive but also any signal about the tail, whose mass then drifts up
(Tail-Aware Top-k OPD, arXiv:2608.14728); the tail bucket penalizes a tail mass unlike the teacher's
(verl's ``forward_kl_topk_tail``, PR #7855, for the forward direction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fnppo.core.errors import check_bool_fields
from fnppo.core.losses.aggregate import Aggregation
from fnppo.core.losses.checks import Checker
from fnppo.core.ops.divergence import DIVERGENCES, LOGPROB_FLOOR
from fnppo.core.typing import Float, Tensor, typechecked

__all__ = [
    "TeacherSignal",
    "TopK",
    "TOPK_TAILS",
    "Distill",
    "ReverseKL",
    "ForwardKL",
    "topk_divergence",
    "NORMALIZERS",
    "check_term",
]

TOPK_TAILS = ("bucket", "renormalize")
"""How :func:`topk_divergence` treats the mass outside the teacher's top-k (see the module docstring)."""

NORMALIZERS = ("own", "shared")
"""A term's normalizer: ``"own"`` (its own aggregation over its own tokens, summed over the step, as
prime-rl normalizes each term by its own token count) or ``"shared"`` (the policy loss's
``LossConfig.agg`` and its normalizer)."""


@dataclass(frozen=True)
class TeacherSignal:
    """Where a distillation term's teacher distribution comes from (a base class; see :class:`TopK`
    and :class:`fnppo.steps.teacher.TeacherModel`)."""

    #: whether the signal gives the teacher's whole distribution (a model) or its top-k only
    full_vocabulary: ClassVar[bool] = False


@dataclass(frozen=True)
class TopK(TeacherSignal):
    """The teacher's top-k log-probs and token ids carried by the samples.

    Each sample holds ``teacher_topk_ids`` ``[r, k]`` and ``teacher_topk_logprobs`` ``[r, k]``: at
    response token ``j``, the teacher's ``k`` most likely next tokens and their log-probs under its
    full distribution, sorted by descending log-prob (ties in any order), as an inference engine
    returns them (vLLM's ``prompt_logprobs=k``). The student's log-probs at those ids come from its
    logits (:func:`fnppo.core.ops.divergence.logprob_entropy_and_topk`).

    Attributes:
        tail: ``"bucket"`` (default) or ``"renormalize"``: see :func:`topk_divergence`.

    Raises:
        InputError: an unknown ``tail``.
    """

    tail: str = "bucket"

    def __post_init__(self) -> None:
        c = Checker.of(self, "fnppo.losses.TopK")
        c.need(self.tail in TOPK_TAILS, "tail", f"one of {TOPK_TAILS}")


def check_term(c: Checker, *, agg_ok: bool = True) -> None:
    """The fields every term has: ``coef`` a finite number >= 0, ``normalizer`` one of
    :data:`NORMALIZERS`, ``agg`` an :class:`Aggregation` or None, None with ``normalizer="shared"``
    (the shared normalizer is ``LossConfig.agg``'s)."""
    c.number("coef", 0)
    c.need(c.get("normalizer") in NORMALIZERS, "normalizer", f"one of {NORMALIZERS}")
    agg = c.get("agg")
    c.need(agg is None or isinstance(agg, Aggregation), "agg", "an Aggregation or None")
    if c.get("normalizer") == "shared":
        c.need(agg is None, "agg", "None with normalizer='shared' (the shared normalizer is LossConfig.agg's)")


@dataclass(frozen=True)
class Distill:
    """A distillation term: ``coef *`` the divergence between the student's and the teacher's
    next-token distributions at each trained token (``loss_mask``), aggregated and normalized.

    Use a subclass: :class:`ReverseKL` or :class:`ForwardKL`.

    Attributes:
        coef: the weight, a finite number >= 0 (0: the term is reported, not trained).
        teacher: the :class:`TeacherSignal` (default :class:`TopK`, from the samples).
        agg: the term's :class:`Aggregation` (None: ``token-mean`` with ``normalizer="own"``;
            ``LossConfig.agg`` with ``"shared"``).
        normalizer: ``"own"`` (default) or ``"shared"`` (:data:`NORMALIZERS`).
        logprob_floor: the floor of the teacher's log-probs (nats, a finite number <= 0; default
            -100): the log-ratio of the reverse KL uses ``max(lq, floor)``, so a token the teacher
            never produces (log-prob ``-inf``) costs a finite amount; with :class:`TopK`, the
            teacher's given log-probs and the tail masses' logs are floored the same way.

    The temperature is the step's (``StepConfig.temperature``), applied to the student's and a
    teacher model's logits alike; top-k log-probs are used as the samples carry them.

    Raises:
        InputError: a field out of range (naming the class and the field).
    """

    coef: float = 1.0
    teacher: TeacherSignal = TopK()
    agg: Aggregation | None = None
    normalizer: str = "own"
    logprob_floor: float = LOGPROB_FLOOR
    kind: ClassVar[str] = ""

    def __post_init__(self) -> None:
        fn = f"fnppo.losses.{type(self).__name__}"
        check_bool_fields(fn, self)
        c = Checker.of(self, fn)
        c.need(self.kind in DIVERGENCES, "kind", f"a subclass with kind in {DIVERGENCES} (ReverseKL, ForwardKL)")
        check_term(c)
        c.need(
            isinstance(self.teacher, TeacherSignal),
            "teacher",
            "a TeacherSignal: fnppo.losses.TopK() (from the samples) or fnppo.steps.TeacherModel(chunks)",
        )
        c.number("logprob_floor", high=0, expected="a finite number <= 0 (nats)")


@dataclass(frozen=True)
class ReverseKL(Distill):
    """``coef * KL(student || teacher)`` per token: ``sum_j p_j (log p_j - log q_j)``, mode-seeking;
    the objective of on-policy distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649; Gu et al.
    2024, MiniLLM, arXiv:2306.08543; Thinking Machines' "On-Policy Distillation", 2025)."""

    kind: ClassVar[str] = "reverse_kl"


@dataclass(frozen=True)
class ForwardKL(Distill):
    """``coef * KL(teacher || student)`` per token: ``sum_j q_j (log q_j - log p_j)``, mode-covering
    (the loss of classic distillation, Hinton et al. 2015, on the student's own samples)."""

    kind: ClassVar[str] = "forward_kl"


@typechecked
def topk_divergence(
    student_topk: Float[Tensor, "*tok k"],
    teacher_topk: Float[Tensor, "*tok k"],
    *,
    kind: str = "reverse_kl",
    tail: str = "bucket",
    logprob_floor: float = LOGPROB_FLOOR,
) -> tuple[Float[Tensor, "*tok"], Float[Tensor, "*tok"], Float[Tensor, "*tok"]]:
    r"""The divergence over a teacher's top-k set ``S`` per token, and both sides' mass in ``S``.

    ``lp_i`` (``student_topk``, carries the gradient) and ``lq_i`` (``teacher_topk``, detached) are
    both sides' log-probs under their full distributions at the ``k`` ids of ``S``; ``f`` the
    floor; ``lq~_i = max(lq_i, f)``. With ``P = sum_S e^{lp}``, ``Q = sum_S e^{lq~}`` and the tail
    log-masses ``lt = max(log(1 - P), f)``, ``lqt = max(log(1 - Q), f)`` (``log(-expm1(logsumexp))``,
    exact near ``P = 1``; a tail of mass 0 or below, e.g. ``k`` = the whole vocabulary, sits at the
    floor)::

        bucket,      reverse: sum_S e^{lp} (lp - lq~) + e^{lt} (lt - lqt)
        bucket,      forward: sum_S e^{lq~} (lq~ - lp) + e^{lqt} (lqt - lt)
        renormalize, reverse: sum_S p^ (log p^ - log q^)    p^ = softmax_S(lp), q^ = softmax_S(lq~)
        renormalize, forward: sum_S q^ (log q^ - log p^)

    Every value and gradient is finite for any finite ``lp`` and any ``lq`` in ``[-inf, 0]``: the
    logs of vanishing tails go through ``where`` on a safe argument (no ``0 * inf`` in the
    backward) and sit at the floor. Ties in ``lq`` at the boundary of ``S`` need nothing: the loss
    is that of the ``S`` given.

    Args:
        student_topk: ``[*tok, k]`` the student's log-probs at the ids of ``S``.
        teacher_topk: ``[*tok, k]`` the teacher's log-probs at the same ids.
        kind: ``"reverse_kl"`` or ``"forward_kl"``.
        tail: one of :data:`TOPK_TAILS`.
        logprob_floor: ``f``, a finite number <= 0.

    Returns:
        ``(divergence, student_mass, teacher_mass)``: ``[*tok]`` in the compute dtype (fp32 or
        fp64); the masses ``P`` and ``Q`` (detached) for the metrics.

    Raises:
        InputError: an unknown ``kind`` or ``tail``, a bad ``logprob_floor``.

    References: Tail-Aware Top-k On-Policy Distillation (arXiv:2608.14728) for the reverse tail
    bucket; verl PR #7855 (``forward_kl_topk_tail``) for the forward one.
    """
    c = Checker("fnppo.losses.topk_divergence", {"kind": kind, "tail": tail, "logprob_floor": logprob_floor}.get)
    c.need(kind in DIVERGENCES, "kind", f"one of {DIVERGENCES}")
    c.need(tail in TOPK_TAILS, "tail", f"one of {TOPK_TAILS}")
    c.number("logprob_floor", high=0, expected="a finite number <= 0 (nats)")
    dtype = torch.promote_types(student_topk.dtype, torch.float32)
    lp = student_topk.to(dtype)
    lq = torch.clamp(teacher_topk.detach().to(dtype), min=logprob_floor)
    p_lse = torch.logsumexp(lp, dim=-1)
    q_lse = torch.logsumexp(lq, dim=-1)
    masses = (p_lse.detach().exp(), q_lse.exp())
    if tail == "renormalize":
        lp_hat = lp - p_lse.unsqueeze(-1)
        lq_hat = lq - q_lse.unsqueeze(-1)
        return _kl_terms(lp_hat, lq_hat, kind).sum(dim=-1), *masses
    lt = _tail_log(p_lse, logprob_floor)
    lqt = _tail_log(q_lse, logprob_floor)
    inside = _kl_terms(lp, lq, kind).sum(dim=-1)
    outside = _kl_terms(lt.unsqueeze(-1), lqt.unsqueeze(-1), kind).squeeze(-1)
    return inside + outside, *masses


def _kl_terms(lp: Tensor, lq: Tensor, kind: str) -> Tensor:
    """``e^{lp} (lp - lq)`` (reverse) or ``e^{lq} (lq - lp)`` (forward), elementwise (all finite here)."""
    if kind == "reverse_kl":
        return torch.exp(lp) * (lp - lq)
    return torch.exp(lq) * (lq - lp)


def _tail_log(lse: Tensor, floor: float) -> Tensor:
    """``max(log(1 - e^{lse}), floor)`` with a finite gradient everywhere (``log`` of a safe argument)."""
    u = -torch.expm1(torch.clamp(lse, max=0.0))
    ok = u > 0
    safe = torch.log(torch.where(ok, u, torch.ones_like(u)))
    return torch.clamp(torch.where(ok, safe, torch.full_like(u, floor)), min=floor)
