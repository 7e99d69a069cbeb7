"""A frozen teacher model evaluated inside the training step: the signal, its checks and its forward.

``LossConfig(distill=ReverseKL(teacher=TeacherModel(chunks)))`` makes :func:`fnppo.train_step` run
the teacher forward-only (eval mode, no autograd) over the same micro-batches as the student,
before the student's schedule, through Megatron's own schedule (any TP / PP / VPP / CP layout: the
teacher's stages live on the ranks of the student's). The teacher stops before its output layer
(:func:`fnppo.megatron.forward.forward_hidden`): the last pipeline stage keeps, per micro-batch,
only its final hidden states ``[batch, seq, hidden]`` and the output-weight shard, and the loss
projects them chunk by chunk (:func:`fnppo.core.ops.divergence.logprob_entropy_and_divergence`), so
the teacher's ``[tokens, vocab]`` logits never exist whole.

The teacher has the student's tokenizer and vocabulary and its own size and depth; it must share
the student's parallel layout (Megatron's process groups are global: one TP, PP and CP layout per
process), which :func:`check_teacher_model` checks by name before anything runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from fnppo.core.batching.sample import Microbatch
from fnppo.core.errors import input_error
from fnppo.core.losses.distill import TeacherSignal
from fnppo.megatron.forward import forward_hidden
from fnppo.megatron.unwrap import check_head
from fnppo.steps.plan import ModelFacts, model_facts
from fnppo.steps.schedule import run_forward_only

__all__ = ["TeacherModel", "check_teacher_model", "teacher_forward"]


@dataclass(frozen=True, eq=False)
class TeacherModel(TeacherSignal):
    """A frozen teacher model evaluated inside the step, for a full-vocabulary divergence.

    Attributes:
        chunks: this rank's model chunks of the teacher (``build_gpt(teacher_cfg)``, weights loaded;
            DDP-wrapped or not), built under the student's parallel layout. The step reads them
            only (no gradient, never given to an optimizer) and runs them in eval mode.

    Compared by identity (two signals are equal when they hold the same chunks).

    Raises:
        InputError: ``chunks`` that are not a non-empty sequence of ``torch.nn.Module``.
    """

    chunks: Sequence[nn.Module] = ()
    full_vocabulary: ClassVar[bool] = True
    __eq__ = object.__eq__  # identity, not the (field-less) base class's comparison
    __hash__ = object.__hash__

    def __post_init__(self) -> None:
        fn = "fnppo.steps.TeacherModel"
        chunks = tuple(self.chunks) if isinstance(self.chunks, (list, tuple)) else self.chunks
        if not isinstance(chunks, tuple) or not chunks or not all(isinstance(c, nn.Module) for c in chunks):
            raise input_error(
                fn, "chunks", "a non-empty list of the teacher's model chunks (nn.Module)", repr(chunks)[:200]
            )
        object.__setattr__(self, "chunks", chunks)


def check_teacher_model(fn: str, teacher: TeacherModel, student: ModelFacts, longest: int) -> ModelFacts:
    """The teacher can serve the student's micro-batches; its :class:`~fnppo.steps.plan.ModelFacts`.

    Refused by name (``config.loss.distill.teacher``): a value model; another vocabulary (the real
    vocabulary and the padded one, whose TP shards must cover the student's columns); another
    tensor-, pipeline- or context-parallel size than the current layout's, or another number of
    model chunks (virtual pipeline stages) than the student; another device; a ``max_sequence_length``
    below the longest sample (``longest`` tokens).
    """
    arg = "config.loss.distill.teacher"
    check_head(fn, arg, teacher.chunks[0], "lm")
    facts = model_facts(teacher.chunks, student.layout)
    layout = student.layout
    if facts.real_vocab_size != student.real_vocab_size or facts.vocab_size != student.vocab_size:
        raise input_error(
            fn,
            arg,
            f"a teacher of the student's vocabulary: {student.real_vocab_size} tokens, padded to {student.vocab_size}",
            f"one of {facts.real_vocab_size} tokens, padded to {facts.vocab_size}",
        )
    config = facts.config
    sizes = {
        "tensor": (getattr(config, "tensor_model_parallel_size", 1), layout.tp),
        "pipeline": (getattr(config, "pipeline_model_parallel_size", 1), layout.pp),
        "context": (getattr(config, "context_parallel_size", 1), layout.cp),
    }
    for name, (got, want) in sizes.items():
        if got != want:
            raise input_error(
                fn,
                arg,
                f"a teacher built under the student's layout ({name}-parallel size {want}: Megatron's process "
                "groups are global, one layout per process)",
                f"a {name}-parallel size of {got}",
            )
    if len(facts.chunks) != len(student.chunks):
        raise input_error(
            fn,
            arg,
            f"{len(student.chunks)} model chunks (the student's virtual pipeline stages)",
            f"{len(facts.chunks)}",
        )
    if facts.device != student.device:
        raise input_error(fn, arg, f"a model on the student's device {student.device}", f"one on {facts.device}")
    if facts.max_sequence_length is not None and facts.max_sequence_length < longest:
        raise input_error(
            fn, arg, f"a max_sequence_length of at least {longest} (the longest sample)", str(facts.max_sequence_length)
        )
    return facts


def teacher_forward(facts: ModelFacts, mbs: Sequence[Microbatch]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The teacher forward-only over ``mbs`` (eval mode, no autograd; routing replay off: the
    student's routes are not the teacher's): on the last pipeline stage ``{id(mb): (hidden, weight)}``
    with ``hidden`` ``[batch, seq, teacher_hidden]`` (after the final norm, the full hidden state on
    every TP rank) and ``weight`` this rank's output-weight shard; ``{}`` on other stages."""
    weights: list[torch.Tensor] = []

    def forward(chunk: nn.Module, mb: Microbatch, *, params: Any = None) -> torch.Tensor:
        hidden, weight = forward_hidden(chunk, mb, params=params)
        if weight is not None:
            weights.append(weight)
        return hidden

    def keep(hidden: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        return hidden.transpose(0, 1).contiguous()

    bare = [dataclasses.replace(mb, routed_experts=None) if mb.routed_experts is not None else mb for mb in mbs]
    out = run_forward_only(facts, bare, keep, params=None, forward=forward, recorder=None)
    if out is None:
        return {}
    return {id(mb): (h, weights[-1].detach()) for mb, h in zip(mbs, out, strict=True)}
