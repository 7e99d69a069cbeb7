"""The training step's objective of several terms: policy loss + distillation + cross-entropy + KL to a reference.

When ``StepConfig.loss`` sets a term (``distill``, ``ce``, ``ref_kl``: :mod:`fnppo.core.losses.terms`),
:func:`fnppo.train_step` runs the stages of this module instead of the policy loss alone:

* before the schedule (:func:`objective_sums`): the policy loss's sums
  (:func:`~fnppo.steps.schedule.global_sums`, :func:`~fnppo.steps.schedule.global_m2_cutoff`), every
  term's normalizer summed over the micro-batches and the data(-and-context)-parallel ranks in one
  all-reduce (:func:`term_normalizers`), and, for a :class:`~fnppo.steps.teacher.TeacherModel`, the
  teacher's forward over the same micro-batches (:func:`~fnppo.steps.teacher.teacher_forward`);
* per micro-batch on the last stage (:func:`objective_forward_step`): the student's log-probs,
  entropy and the distillation signal from one autograd function of its logits
  (:func:`student_outputs`), then ``ppo_loss`` (``config.fns.loss``; skipped with ``policy=None``)
  plus :func:`~fnppo.core.losses.objective.terms_loss`, each divided by its own global normalizer.

The loss is exact under any split and layout: every normalizer is the step's. The metric ``loss``
is the whole objective, each term's ``<term>_loss`` its normalized value (without coefficient).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fnppo.core.batching.sample import Microbatch, Sample
from fnppo.core.batching.teacher import check_teacher_values
from fnppo.core.errors import input_error
from fnppo.core.losses.objective import local_normalizers, terms_loss
from fnppo.core.losses.terms import term_agg, terms_of
from fnppo.core.metrics import pair_metric, weighted_metric
from fnppo.core.ops.divergence import logprob_entropy_and_divergence, logprob_entropy_and_topk
from fnppo.core.ops.logprob import logprob_and_entropy
from fnppo.megatron.parallel import ParallelLayout
from fnppo.megatron.routing import routed
from fnppo.steps.checks import check_logits
from fnppo.steps.config import StepConfig
from fnppo.steps.plan import ModelFacts, Plan, model_facts
from fnppo.steps.schedule import global_m2_cutoff, global_sums, onpolicy_gaps, token_logprobs
from fnppo.steps.teacher import TeacherModel, check_teacher_model, teacher_forward

__all__ = [
    "uses_terms",
    "ObjectiveSums",
    "term_normalizers",
    "objective_sums",
    "objective_forward_step",
    "student_outputs",
    "objective_stages",
    "check_objective",
]


def uses_terms(loss_cfg: Any) -> bool:
    """Whether a loss config sets a term beside the policy loss (then the step runs this module)."""
    return bool(terms_of(loss_cfg))


class ObjectiveSums(NamedTuple):
    """What the objective needs of the whole mini-batch, worked out before the schedule."""

    normalizer: torch.Tensor  # the policy loss's (shared) normalizer
    tis_mean: torch.Tensor | None
    m2_cutoff: torch.Tensor | None
    terms: dict[str, torch.Tensor]  # every normalizer by key (fnppo.core.losses.objective.normalizer_key)
    count: int  # micro-batches x data(-with-context)-parallel ranks: the weight of one micro-batch's 'loss' pair
    teacher: dict[int, tuple[torch.Tensor, torch.Tensor]]  # id(micro-batch) -> (hidden, weight), last stage


def term_normalizers(
    mbs: Sequence[Microbatch], loss_cfg: Any, layout: ParallelLayout, device: torch.device
) -> dict[str, torch.Tensor]:
    """Every normalizer of ``loss_cfg`` (:func:`~fnppo.core.losses.objective.local_normalizers`), summed
    over ``mbs`` and the data-parallel group of ``layout`` (one all-reduce, fp64; fp32 results)."""
    keys: list[str] = []
    local = None
    for mb in mbs:
        per = local_normalizers(loss_cfg, mb.loss_mask, seq_ids=mb.seq_ids, ce_mask=mb.ce_mask)
        keys = sorted(per)
        row = torch.stack([per[k].to(device=device, dtype=torch.float64) for k in keys])
        local = row if local is None else local + row
    if layout.dp > 1:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=layout.dp_group)
    return {k: local[i].float() for i, k in enumerate(keys)}


def objective_sums(
    config: StepConfig, teacher: ModelFacts | None
) -> Callable[[Sequence[Microbatch], ParallelLayout, torch.device], ObjectiveSums]:
    """The step's pre-schedule stage for ``config`` (``teacher``: the teacher model's facts, or None)."""

    def sums(mbs: Sequence[Microbatch], layout: ParallelLayout, device: torch.device) -> ObjectiveSums:
        normalizer, tis_mean = global_sums(mbs, config.loss, layout, device)
        return ObjectiveSums(
            normalizer=normalizer,
            tis_mean=tis_mean,
            m2_cutoff=global_m2_cutoff(mbs, config.loss, layout, device),
            terms=term_normalizers(mbs, config.loss, layout, device),
            count=len(mbs) * layout.dp,
            teacher=teacher_forward(teacher, mbs) if teacher is not None else {},
        )

    return sums


def student_outputs(
    fn: str, out: torch.Tensor, weight: torch.Tensor | None, mb: Microbatch, config: StepConfig, plan: Plan, sums: Any
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(logprobs, entropy, divergence, student_topk)`` of one micro-batch from the student's logits
    (``weight`` None) or hidden states ``[seq, batch, hidden]`` and output-weight shard (the fused path).

    Without a distillation term: the step's log-prob stage. With one: one autograd function of the
    logits (:func:`~fnppo.core.ops.divergence.logprob_entropy_and_divergence` for a teacher model,
    :func:`~fnppo.core.ops.divergence.logprob_entropy_and_topk` for the samples' top-k). On the fused
    path the head's ``with_divergence`` / ``with_topk`` methods are used when it has them (a fused
    kernel that never materializes the logits); otherwise the logits are formed (``hidden @ weight.T``)
    and the same functions run on them. The methods' signatures (``hidden`` ``[batch, seq, hidden]``)::

        head.with_divergence(hidden, weight, labels, teacher_hidden, teacher_weight, *, kind,
                             logprob_floor, tp_group, temperature, with_entropy, vocab_size)
            -> (logprobs, entropy, divergence)          # as logprob_entropy_and_divergence
        head.with_topk(hidden, weight, labels, topk_ids, *, tp_group, temperature, with_entropy,
                       vocab_size) -> (logprobs, entropy, topk_logprobs)   # as logprob_entropy_and_topk
    """
    distill = config.loss.distill
    if distill is None:
        lp, ent = token_logprobs(fn, out, weight, mb, config, plan, True)
        return lp, ent, None, None
    layout = plan.model.layout
    kw = dict(
        tp_group=layout.tp_group if layout.tp > 1 else None,
        temperature=config.temperature,
        with_entropy=True,
        vocab_size=plan.model.real_vocab_size,
    )
    head = config.fns.head if weight is not None else None
    if weight is not None:
        out = out.transpose(0, 1)  # [batch, seq, hidden]
    else:
        check_logits(fn, out, plan.model.vocab_size, layout)
    if distill.teacher.full_vocabulary:
        t_hidden, t_weight = sums.teacher[id(mb)]
        extra = dict(kind=distill.kind, logprob_floor=distill.logprob_floor)
        method = getattr(head, "with_divergence", None)
        if method is not None:
            return (*method(out, weight, mb.labels, t_hidden, t_weight, **extra, **kw), None)
        logits = out if head is None else torch.nn.functional.linear(out, weight)
        lp, ent, div = logprob_entropy_and_divergence(
            logits, mb.labels, teacher_hidden=t_hidden, teacher_weight=t_weight, **extra, **kw
        )
        return lp, ent, div, None
    method = getattr(head, "with_topk", None)
    if method is not None:
        lp, ent, topk = method(out, weight, mb.labels, mb.teacher_topk_ids, **kw)
    else:
        logits = out if head is None else torch.nn.functional.linear(out, weight)
        lp, ent, topk = logprob_entropy_and_topk(logits, mb.labels, mb.teacher_topk_ids, **kw)
    return lp, ent, None, topk


def objective_forward_step(
    config: StepConfig, plan: Plan, sums: ObjectiveSums, loss_scale: float
) -> Callable[[Iterator[Microbatch], nn.Module], Any]:
    """Megatron's ``forward_step_func`` of the objective: forward, then (last stage) the student's
    outputs, the policy loss (unless ``policy=None``) and the terms, scaled by ``loss_scale``."""
    fns, loss_cfg = config.fns, config.loss
    extra = {k: v for k, v in (("tis_mean", sums.tis_mean), ("m2_cutoff", sums.m2_cutoff)) if v is not None}

    def forward_step(data_iterator: Iterator[Microbatch], model: nn.Module):
        mb = next(data_iterator)
        with routed(model, mb):
            out, weight = fns.forward(model, mb) if fns.head is not None else (fns.forward(model, mb), None)

        def loss_func(output: torch.Tensor):
            lp, ent, div, topk = student_outputs("train_step", output, weight, mb, config, plan, sums)
            old = mb.rollout_logprobs if loss_cfg.bypass_old_logprobs else mb.old_logprobs
            if loss_cfg.policy is not None:
                loss, metrics = fns.loss(
                    lp,
                    old,
                    mb.advantages,
                    mb.loss_mask,
                    loss_cfg,
                    entropy=ent,
                    ref_logprobs=mb.ref_logprobs,
                    rollout_logprobs=mb.rollout_logprobs,
                    normalizer=sums.normalizer,
                    seq_ids=mb.seq_ids,
                    **extra,
                )
                gaps = onpolicy_gaps(lp, old, mb.loss_mask)
            else:
                loss = torch.zeros((), dtype=torch.float32, device=lp.device)
                metrics = {"entropy": weighted_metric(ent, mb.loss_mask)}
                gaps = onpolicy_gaps(lp, None, mb.loss_mask)
            t_loss, t_metrics = terms_loss(
                lp,
                mb.loss_mask,
                loss_cfg,
                divergence=div,
                student_topk=topk,
                teacher_topk=mb.teacher_topk_logprobs,
                ce_mask=mb.ce_mask,
                ref_logprobs=mb.ref_logprobs,
                normalizers=sums.terms,
                seq_ids=mb.seq_ids,
            )
            total = loss + t_loss
            metrics = {**metrics, **t_metrics}
            # the whole objective: pairs (loss of this micro-batch * count, 1) finalize to the sum over all
            metrics["loss"] = pair_metric(total.detach() * sums.count, torch.ones((), device=total.device))
            return total * loss_scale, {"metrics": metrics, "onpolicy": gaps}

        return out, loss_func

    return forward_step


def objective_stages(config: StepConfig, plan: Plan) -> tuple[Callable, Callable]:
    """The two stages :func:`fnppo.train_step` runs for an objective with terms: the pre-schedule sums
    (:func:`objective_sums`) and Megatron's forward-step function of those sums and a loss scale."""
    distill = config.loss.distill
    teacher = None
    if distill is not None and isinstance(distill.teacher, TeacherModel):
        teacher = model_facts(distill.teacher.chunks, plan.model.layout)

    def forward_step(s: ObjectiveSums, scale: float) -> Callable:
        return objective_forward_step(config, plan, s, scale)

    return objective_sums(config, teacher), forward_step


def check_objective(fn: str, samples: Sequence[Sample], config: StepConfig, plan: Plan) -> None:
    """What an objective with terms needs of the batch and the layout, before anything runs.

    Refused by name: a replaced ``config.fns.logprob`` with a distillation term (the term computes the
    log-probs with its divergence, in one function); under context parallelism a term aggregated
    otherwise than ``token-mean``; the samples' teacher top-k or cross-entropy masks that
    :func:`~fnppo.core.batching.teacher.check_teacher_values` refuses (ids against the model's
    vocabulary); a :class:`~fnppo.core.losses.distill.TopK` distillation term without the teacher's
    top-k in the batch; a teacher model that cannot serve the student's micro-batches
    (:func:`~fnppo.steps.teacher.check_teacher_model`); ``ref_kl`` with ``coef != 0`` and no
    ``ref_logprobs``.
    """
    loss = config.loss
    terms = terms_of(loss)
    check_teacher_values(fn, samples, plan.model.real_vocab_size, arg="batch")
    if not terms:
        return
    distill = loss.distill
    if distill is not None and config.fns.logprob is not logprob_and_entropy:
        raise input_error(
            fn,
            "config.fns.logprob",
            "the default with a distillation term (the term's function computes the log-probs with the divergence)",
            repr(config.fns.logprob),
        )
    cp = plan.model.layout.cp
    for name, part in terms.items():
        mode = term_agg(part, loss).mode
        if cp > 1 and mode != "token-mean":
            raise input_error(
                fn, f"config.loss.{name}.agg.mode", f"'token-mean' with context parallelism (cp={cp})", repr(mode)
            )
    if distill is not None and not distill.teacher.full_vocabulary and samples[0].teacher_topk_ids is None:
        raise input_error(
            fn,
            "batch[0].teacher_topk_ids",
            f"a tensor: config.loss.distill ({type(distill).__name__}) reads the teacher's top-k from the samples "
            "(TopK); give the samples teacher_topk_ids / teacher_topk_logprobs, or a TeacherModel",
            "None",
        )
    if distill is not None and isinstance(distill.teacher, TeacherModel):
        check_teacher_model(fn, distill.teacher, plan.model, max(len(s) for s in samples))
    ref_kl = loss.ref_kl
    if ref_kl is not None and ref_kl.coef != 0 and samples[0].ref_logprobs is None:
        raise input_error(
            fn, "batch[0].ref_logprobs", f"a tensor since config.loss.ref_kl.coef={ref_kl.coef!r}", "None"
        )
