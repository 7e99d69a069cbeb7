"""The terms of an objective as a loss: :func:`terms_loss` and each term's normalizer (pure torch).

:func:`terms_loss` is the part of the loss that :mod:`fnppo.core.losses.terms` adds beside
:func:`fnppo.core.losses.ppo.ppo_loss` (which stays the policy term): the distillation term from a
per-token divergence (a full-vocabulary one, or the student's and the teacher's top-k log-probs),
the cross-entropy on given tokens, and the KL to the reference. :func:`local_normalizers` gives
each normalizer's local count (one per term with ``normalizer="own"`` and ``"shared"``, the policy
loss's), which the step sums over all micro-batches and data-parallel ranks before its schedule,
so that the sum of the micro-batch losses is the full-batch objective whatever the split.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fnppo.core.errors import input_error
from fnppo.core.losses.aggregate import Tokens, agg_weights, denominator, loss_normalizer
from fnppo.core.losses.checks import check_non_empty, validate_inputs
from fnppo.core.losses.config import LossConfig
from fnppo.core.losses.distill import topk_divergence
from fnppo.core.losses.kl import kl_penalty
from fnppo.core.losses.terms import term_agg, terms_of
from fnppo.core.metrics import pair_metric, weighted_metric
from fnppo.core.typing import Float, PaddedFloat, PaddedMask, Scalar, Shaped, Tensor, typechecked, typechecking_enabled

__all__ = ["terms_loss", "local_normalizers", "normalizer_key", "term_mask"]

SHARED = "shared"
"""The key of the policy loss's normalizer (``LossConfig.agg`` over ``loss_mask``) among the normalizers."""


def normalizer_key(name: str, part: Any) -> str:
    """The normalizer a term divides by: ``"shared"``, or its own (keyed by its field name)."""
    return SHARED if part.normalizer == "shared" else name


def term_mask(name: str, loss_mask: Tensor, ce_mask: Tensor | None) -> Tensor:
    """The tokens of a term: ``ce_mask`` for the cross-entropy when given, else ``loss_mask``."""
    return ce_mask if (name == "ce" and ce_mask is not None) else loss_mask


def local_normalizers(
    config: LossConfig, loss_mask: Tensor, *, seq_ids: Tensor | None = None, ce_mask: Tensor | None = None
) -> dict[str, Tensor]:
    """The local count of every normalizer of ``config`` in one micro-batch (0-dim fp32 each):
    ``"shared"`` (:func:`~fnppo.core.losses.aggregate.loss_normalizer` of ``loss_mask`` and
    ``config.agg``) and, per term with ``normalizer="own"``, that of its tokens and its aggregation.
    Sum each over all micro-batches and DP ranks and pass the sums as ``normalizers`` to
    :func:`terms_loss` (``"shared"`` is also ``ppo_loss``'s ``normalizer``)."""
    out = {SHARED: loss_normalizer(loss_mask, config.agg, seq_ids=seq_ids)}
    for name, part in terms_of(config).items():
        if part.normalizer == "own":
            out[name] = loss_normalizer(term_mask(name, loss_mask, ce_mask), term_agg(part, config), seq_ids=seq_ids)
    return out


@typechecked
def terms_loss(
    logprobs: PaddedFloat,
    loss_mask: PaddedMask,
    config: LossConfig,
    *,
    divergence: PaddedFloat | None = None,
    student_topk: Float[Tensor, "batch seq k"] | None = None,
    teacher_topk: Float[Tensor, "batch seq k"] | None = None,
    ce_mask: PaddedMask | None = None,
    ref_logprobs: PaddedFloat | None = None,
    normalizers: Mapping[str, Any] | None = None,
    seq_ids: Shaped[Tensor, "batch seq"] | None = None,
) -> tuple[Scalar, dict[str, Tensor]]:
    """The objective's terms (``config.distill``, ``config.ce``, ``config.ref_kl``) of one micro-batch.

    Each term ``i`` is ``coef_i * sum_t a_t l_t / N_i`` over its tokens (``loss_mask``; for the
    cross-entropy ``ce_mask`` when given), with ``a_t`` from its aggregation
    (:func:`~fnppo.core.losses.terms.term_agg`) and ``N_i = normalizers[key]``
    (:func:`normalizer_key`; the local count when ``normalizers`` is None; ``N = 0`` gives 0)::

        distill: l_t = divergence_t   (full vocabulary)   or   topk_divergence(student_topk_t, teacher_topk_t)
        ce:      l_t = -logprobs_t
        ref_kl:  l_t = kl_penalty(logprobs_t, ref_logprobs_t, estimator)

    Positions outside a term's tokens are never read (NaN there changes nothing). A term with
    ``coef = 0`` is reported, not trained (detached).

    Args:
        logprobs: ``[batch, seq]`` the student's log-probs of the labels (carry the gradient).
        loss_mask: 0/1 mask of the trained tokens.
        config: the :class:`~fnppo.core.losses.config.LossConfig`; its policy loss is not computed here.
        divergence: per-token full-vocabulary divergence (carries the gradient; a distillation term
            with a full-vocabulary teacher needs it).
        student_topk, teacher_topk: ``[batch, seq, k]`` log-probs at the teacher's top-k ids (a
            :class:`~fnppo.core.losses.distill.TopK` teacher needs them).
        ce_mask: the cross-entropy's tokens (None: ``loss_mask``).
        ref_logprobs: the reference policy's log-probs (``ref_kl`` with ``coef != 0`` needs them).
        normalizers: the step's global normalizers by key (see :func:`local_normalizers`).
        seq_ids: packed layout: per-token sequence index, -1 for no sequence.

    Returns:
        ``(loss, metrics)``: the 0-dim sum of the terms and ``[2]`` metric pairs: per term
        ``distill_loss`` / ``ce_loss`` / ``ref_kl_loss`` (numerator and local count: finalized, the
        term's normalized value without its coefficient), and with a top-k teacher
        ``distill_topk_mass_student`` / ``distill_topk_mass_teacher`` (mean mass of the top-k set).

    Raises:
        InputError: an empty batch; a term's input missing; with checking on, masks that are not
            0/1, NaN/inf in ``ref_logprobs``, NaN or values above 0 in ``teacher_topk`` (``-inf`` is
            allowed) at trained tokens, a negative or non-finite normalizer.
    """
    fn = "fnppo.losses.terms_loss"
    check_non_empty(fn, "logprobs", logprobs)
    terms = terms_of(config)
    _check_term_inputs(fn, terms, divergence, student_topk, teacher_topk, ref_logprobs)
    if typechecking_enabled():
        _validate(fn, loss_mask, ce_mask, ref_logprobs, teacher_topk, normalizers, seq_ids)
    shared_den = loss_normalizer(loss_mask, config.agg, seq_ids=seq_ids)
    total = torch.zeros((), dtype=torch.promote_types(logprobs.dtype, torch.float32), device=logprobs.device)
    metrics: dict[str, Tensor] = {}
    for name, part in terms.items():
        mask = term_mask(name, loss_mask, ce_mask)
        tok = Tokens.of(logprobs, mask, seq_ids)
        per_token = _per_token(name, part, config, mask, logprobs, divergence, student_topk, teacher_topk, ref_logprobs)
        if per_token is None:  # ref_kl with coef 0 and no reference log-probs: nothing to report
            continue
        if name == "distill" and student_topk is not None:
            per_token, mass_s, mass_t = per_token
            metrics["distill_topk_mass_student"] = weighted_metric(mass_s.float(), tok.mf)
            metrics["distill_topk_mass_teacher"] = weighted_metric(mass_t.float(), tok.mf)
        agg = term_agg(part, config)
        weights, den = agg_weights(tok.mf, tok.seg, agg.mode, agg.scale)
        num = (tok.clean(per_token, detach=part.coef == 0) * weights).sum()
        key = normalizer_key(name, part)
        if key == SHARED:
            den = shared_den.to(den.dtype)
        given = None if normalizers is None else normalizers[key]
        metrics[f"{name}_loss"] = pair_metric(num, den)
        if part.coef != 0:
            total = total + part.coef * num / denominator(given, den)
    return total, metrics


def _check_term_inputs(
    fn: str, terms: dict[str, Any], divergence: Any, student_topk: Any, teacher_topk: Any, ref: Any
) -> None:
    """The inputs the configured terms read are given."""
    part = terms.get("distill")
    if part is not None:
        if part.teacher.full_vocabulary and divergence is None:
            raise input_error(fn, "divergence", f"a tensor (the term {type(part).__name__} has a full teacher)", "None")
        if not part.teacher.full_vocabulary and (student_topk is None or teacher_topk is None):
            got = f"student_topk={'given' if student_topk is not None else None}, teacher_topk="
            got += "given" if teacher_topk is not None else "None"
            raise input_error(fn, "teacher_topk", "student_topk and teacher_topk (a TopK teacher)", got)
    ref_kl = terms.get("ref_kl")
    if ref_kl is not None and ref_kl.coef != 0 and ref is None:
        raise input_error(fn, "ref_logprobs", f"a tensor since ref_kl.coef={ref_kl.coef!r}", "None")


def _validate(
    fn: str,
    loss_mask: Tensor,
    ce_mask: Tensor | None,
    ref: Tensor | None,
    teacher_topk: Tensor | None,
    normalizers: Mapping[str, Any] | None,
    seq_ids: Tensor | None,
) -> None:
    """The value checks of one call (masks 0/1, finite values at trained tokens, normalizers >= 0)."""
    validate_inputs(fn, loss_mask, {"ref_logprobs": ref}, None, seq_ids)
    if ce_mask is not None:
        validate_inputs(fn, ce_mask, {}, None, None, "ce_mask")
    for key, v in (normalizers or {}).items():
        x = torch.as_tensor(v, dtype=torch.float64)
        if x.numel() != 1 or not bool(torch.isfinite(x).all() & (x >= 0).all()):
            raise input_error(fn, f"normalizers[{key!r}]", "a finite number >= 0", repr(v))
    if teacher_topk is not None:
        m = (loss_mask != 0).unsqueeze(-1)
        bad = m & (torch.isnan(teacher_topk) | (teacher_topk > 0))
        if bool(bad.any()):
            v = teacher_topk[bad].flatten()[0].item()
            raise input_error(
                fn, "teacher_topk", "log-probs in [-inf, 0] (not NaN) at trained tokens", f"a value {v!r} there"
            )


def _per_token(
    name: str,
    part: Any,
    config: LossConfig,
    mask: Tensor,
    logprobs: Tensor,
    divergence: Tensor | None,
    student_topk: Tensor | None,
    teacher_topk: Tensor | None,
    ref: Tensor | None,
) -> Any:
    """A term's per-token values (for a top-k teacher: ``(values, student mass, teacher mass)``)."""
    if name == "distill":
        if part.teacher.full_vocabulary:
            return divergence
        # positions off the mask may hold anything (NaN too): never read, not even by the backward
        keep = (mask != 0).unsqueeze(-1)
        teacher = torch.where(keep, teacher_topk.detach(), torch.zeros_like(teacher_topk))
        return topk_divergence(
            student_topk, teacher, kind=part.kind, tail=part.teacher.tail, logprob_floor=part.logprob_floor
        )
    if name == "ce":
        return -logprobs
    if ref is None:
        return None
    lp = logprobs if part.coef != 0 else logprobs.detach()
    # positions off the mask may hold anything: kl_penalty reads them, Tokens.clean drops them
    ref_clean = torch.where(torch.isfinite(ref), ref.to(lp.dtype), lp.detach())
    return kl_penalty(lp, ref_clean, part.estimator, log_ratio_clamp=config.log_ratio_clamp)
