"""Running one model chunk on one micro-batch: ``forward_logits``, ``forward_hidden``, ``forward_values``.

The stage between collation (:mod:`fnppo.core.batching.collate`) and the log-prob / loss stages: a
:class:`~fnppo.core.batching.sample.Microbatch` goes through one chunk (Megatron's ``PackedSeqParams`` for
packed micro-batches, :func:`packed_seq_params`), optionally with another parameter set
(``params``, ``torch.func.functional_call``; :func:`snapshot_params` makes one).
:func:`deterministic_algorithms` is torch's determinism switch (the steps enter it through
:func:`fnppo.megatron.numerics.running`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.module import Float16Module
from torch import nn

from fnppo.core.batching.sample import Microbatch
from fnppo.core.typing import Float, Tensor, typechecked
from fnppo.megatron.shared_prefix import shared_packed_seq_params, shared_rope
from fnppo.megatron.unwrap import check_head, unwrap_model

__all__ = [
    "forward_logits",
    "forward_values",
    "forward_hidden",
    "packed_seq_params",
    "snapshot_params",
    "deterministic_algorithms",
]


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool, *, fill_uninitialized_memory: bool = True) -> Iterator[None]:
    """Run the block under ``torch.use_deterministic_algorithms(True, warn_only=True)`` when
    ``enabled`` (a model built with ``ModelConfig(deterministic=True)``), and restore torch's
    previous setting afterwards, also on an exception; with ``enabled`` False, change nothing.

    Megatron-core consults ``torch.are_deterministic_algorithms_enabled()`` at call time: its MoE
    router then builds the routing map with ``index_put`` and its un-permutation adds the experts'
    outputs with ``index_add`` instead of ``scatter_add`` (atomic on CUDA, so the sum's order and
    bf16 rounding change from call to call). ``warn_only``: an operation without a deterministic
    implementation warns instead of failing the step. Reference: PyTorch "Reproducibility" notes
    (``torch.use_deterministic_algorithms``).

    ``fill_uninitialized_memory``: torch's ``torch.utils.deterministic.fill_uninitialized_memory``
    inside the block (restored afterwards). Under the switch torch fills every new uninitialized
    tensor (``torch.empty``) with NaN, thousands of extra kernel launches per step; the
    batch-invariant mode, which only needs the repeatable routing paths, turns it off.
    """
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    fill_before = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = bool(fill_uninitialized_memory)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill_before


def _call_target(model: nn.Module) -> tuple[nn.Module, str]:
    """The module to call (DDP stripped: its forward only forwards) and the prefix to the GPTModel."""
    while isinstance(model, DistributedDataParallel):
        model = model.module
    prefix = ""
    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, nn.Module):
        inner = inner.module
        prefix += "module."
    return model, prefix


def packed_seq_params(mb: Microbatch):
    """Megatron ``PackedSeqParams`` (THD) for a packed micro-batch, ``None`` for a padded one; a
    micro-batch with shared prefixes gets :class:`~fnppo.megatron.shared_prefix.SharedPackedSeqParams`."""
    if mb.is_shared:
        return shared_packed_seq_params(mb)
    if mb.cu_seqlens is None:
        return None
    cu = mb.cu_seqlens.to(device=mb.input_ids.device, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=int(mb.max_seqlen),
        max_seqlen_kv=int(mb.max_seqlen),
    )


@typechecked
def forward_values(
    model: nn.Module, microbatch: Microbatch, *, params: Mapping[str, Tensor] | None = None
) -> Float[Tensor, "..."]:
    """Run one chunk of a value model on a micro-batch: one value per position on the last stage.

    ``values[b, t] = V(input_ids[b, :t+1])``, the head of :class:`fnppo.megatron.value.GPTValueModel` on the
    decoder's (normed) output at position ``t``, ``[batch, seq]`` in the model's dtype (no fp32
    upcast), over the whole sequence also under sequence parallelism. With the alignment of
    :mod:`fnppo.core.batching.collate`, the value at the position of response token ``j``'s label is the value of
    the state before that token (the last prompt token for ``j = 0``). Other stages return
    Megatron's hidden state ``[seq, batch, hidden]`` (the schedule sends it on). Packed micro-batches
    get ``PackedSeqParams``; ``params`` as in :func:`forward_logits`.

    Reference: the value function of PPO, arXiv:1707.06347.

    Raises:
        InputError: ``model`` is not a value model.
    """
    check_head("fnppo.forward_values", "model", model, "value")
    return _forward(model, microbatch, params)


@typechecked
def forward_logits(
    model: nn.Module, microbatch: Microbatch, *, params: Mapping[str, Tensor] | None = None
) -> Float[Tensor, "..."]:
    """Run one model chunk on a micro-batch: vocab-parallel logits on the last pipeline stage.

    Returns ``[batch, seq, vocab_shard]`` logits in the model's dtype (no fp32 upcast copy) on the
    last stage, and Megatron's hidden state ``[seq, batch, hidden]`` on other stages (the schedule
    sends it on). Packed micro-batches get ``PackedSeqParams`` (THD); padded ones use causal
    attention with right padding, so padding never influences real tokens.

    A model whose unwrapped module sets ``takes_multi_modal = True`` (:class:`fnppo.megatron.vlm_model.VisionLanguageGPT`)
    also receives ``multi_modal=microbatch.multi_modal`` and ``multi_modal_counts=`` (items per
    sample); other models are called as before (their micro-batches' items are not read).

    ``params``: optional parameters (names as in the unwrapped ``GPTModel``'s ``named_parameters``)
    used instead of the module's own through ``torch.func.functional_call``, so one module skeleton
    evaluates several parameter sets (e.g. the reference policy). Missing names fall back to the
    module's own tensors.

    Raises:
        InputError: ``model`` is a value model (use :func:`forward_values`).
    """
    check_head("fnppo.forward_logits", "model", model, "lm")
    return _forward(model, microbatch, params)


def _forward(model: nn.Module, microbatch: Microbatch, params: Mapping[str, Tensor] | None) -> Tensor:
    """One chunk on one micro-batch (the body of :func:`forward_logits` / :func:`forward_values`)."""
    target, prefix = _call_target(model)
    args = (microbatch.input_ids, microbatch.position_ids, None)
    params_thd = packed_seq_params(microbatch)
    kwargs: dict[str, Any] = {"packed_seq_params": params_thd}
    if getattr(unwrap_model(target), "takes_multi_modal", False):  # e.g. fnppo.megatron.vlm_model.VisionLanguageGPT
        kwargs["multi_modal"] = microbatch.multi_modal
        kwargs["multi_modal_counts"] = microbatch.multi_modal_counts
    if isinstance(target, Float16Module):
        kwargs["fp32_output"] = False
    with shared_rope(target, params_thd):  # a shared micro-batch's tokens rotated by their own positions
        if params is None:
            return target(*args, **kwargs)
        named = {prefix + k: v for k, v in params.items()}
        return torch.func.functional_call(target, named, args, kwargs, strict=False)


@typechecked
def forward_hidden(
    model: nn.Module, microbatch: Microbatch, *, params: Mapping[str, Tensor] | None = None
) -> tuple[Float[Tensor, "..."], Tensor | None]:
    """Like :func:`forward_logits`, but the last pipeline stage stops before the output layer.

    Returns ``(hidden, weight)``. On the last stage: ``hidden`` ``[seq, batch, hidden]`` is the
    decoder's output after the final norm, in the model's dtype, made ready for this rank's
    output-weight shard the way Megatron's output layer (``ColumnParallelLinear``) readies its
    input: under tensor parallelism its gradient is summed over the TP group
    (``copy_to_tensor_model_parallel_region``); under sequence parallelism it is gathered over the
    sequence (``gather_from_sequence_parallel_region``); and ``weight`` ``[vocab_shard, hidden]`` is
    the output layer's weight shard, the word embedding when embeddings are tied
    (``GPTModel.shared_embedding_or_output_weight``; taken from ``params`` when given there). Feed
    both to :func:`fnppo.linear_logprob_and_entropy`: ``hidden @ weight.T`` are this rank's
    logits. On other stages: ``(hidden state to send, None)``, as :func:`forward_logits`. A model
    that wraps its ``GPTModel`` as ``language_model`` (:class:`fnppo.megatron.vlm_model.VisionLanguageGPT`) stops
    the same way; ``params`` are then named from the wrapper (``language_model.…``).
    """
    check_head("fnppo.forward_hidden", "model", model, "lm")
    core = unwrap_model(model)
    # a model that wraps its GPTModel (fnppo.megatron.vlm_model.VisionLanguageGPT: ``language_model``)
    lm, prefix = (core.language_model, "language_model.") if hasattr(core, "language_model") else (core, "")
    if not lm.post_process:
        return _forward(model, microbatch, params), None
    weight = _output_weight(lm, params, prefix)
    lm.post_process = False  # GPTModel._postprocess then returns the decoder's (normed) output
    try:
        hidden = _forward(model, microbatch, params)
    finally:
        lm.post_process = True
    layer = lm.output_layer
    if layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=layer.tp_group)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=layer.tp_group)
    return hidden, weight


def _output_weight(core: nn.Module, params: Mapping[str, Tensor] | None, prefix: str = "") -> Tensor:
    """The output layer's weight shard as ``GPTModel._postprocess`` would use it (``params`` named
    from the unwrapped model, whose GPTModel sits under ``prefix``)."""
    if core.share_embeddings_and_output_weights:
        name = "embedding.word_embeddings.weight" if (core.pre_process or core.mtp_process) else "output_layer.weight"
        own = core.shared_embedding_or_output_weight()
    else:
        name, own = "output_layer.weight", core.output_layer.weight
    name = prefix + name
    return params[name] if params is not None and name in params else own


def snapshot_params(model_chunks: Sequence[nn.Module]) -> list[dict[str, Tensor]]:
    """Detached copies of every chunk's parameters (names of the unwrapped ``GPTModel``).

    Use as ``params`` of :func:`forward_logits` / ``compute_logprobs`` (e.g. a frozen reference).
    """
    return [{k: v.detach().clone() for k, v in unwrap_model(c).named_parameters()} for c in model_chunks]
