"""The Megatron tensors a Hugging Face export reads, shared by :func:`fnppo.io.hf.export.export_hf_weights`
(files) and :func:`fnppo.io.hf.stream.stream_hf_weights` (an iterator for an inference engine):

* :func:`export_params` walks a rank's model chunks: each parameter with its Hugging Face rule
  (:func:`fnppo.io.hf.keys.param_rule`), a tied output layer left out (it is the embedding);
* :func:`local_weight` is this rank's shard of one parameter as exported: the one place through which
  every exported tensor is read (where adapters are merged into their base weight);
* :func:`place_shard` writes tensor-parallel rank ``r``'s shard into the full (1-rank) tensor: along
  the partition dim (Megatron-LM, arXiv:1909.08053), and for a fused ``[gate; up]`` fc1 each half
  into its half (rank ``r`` holds ``[gate_r; up_r]``, the full tensor is ``[gate; up]``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from torch import nn

from fnppo.core.typing import Tensor
from fnppo.io.hf.arch import Arch
from fnppo.io.hf.keys import param_rule
from fnppo.megatron.lora_experts import stacked_merged_delta
from fnppo.megatron.lora_linear import merged_delta
from fnppo.megatron.stacked_experts import is_stacked, named_weights
from fnppo.megatron.unwrap import unwrap_model
from fnppo.megatron.weights import global_name


class ExportParam(NamedTuple):
    """One parameter of this rank as an export sees it."""

    chunk: int  # index of its model chunk (virtual pipeline stage order on this rank)
    index: int  # its position in the chunk's named_weights (stacked experts as per-expert views)
    core: nn.Module
    name: str  # the chunk-local name
    param: Tensor
    gname: str  # the global (1-rank) name
    kind: str  # the layout conversion (fnppo.io.hf.layouts)
    names: tuple[str, ...]  # the Hugging Face tensors it is made of


def export_params(fn: str, a: Arch, model_chunks: Sequence[nn.Module]) -> Iterator[ExportParam]:
    """Every parameter of this rank's chunks that the Hugging Face checkpoint holds (a tied output
    layer is the embedding, so it is left out).

    Raises:
        InputError: a parameter with no Hugging Face counterpart (from :func:`param_rule`).
    """
    for c, chunk in enumerate(model_chunks):
        core = unwrap_model(chunk)
        for i, (name, param) in enumerate(named_weights(core)):
            gname = global_name(core, name)
            kind, names = param_rule(fn, a, gname)
            if gname == "output_layer.weight" and a.tied:
                continue
            yield ExportParam(c, i, core, name, param, gname, kind, names)


def local_weight(p: ExportParam) -> Tensor:
    """This rank's shard of ``p`` as exported (detached; the parameter's own storage, so callers copy
    before they change it). Every exported tensor is read here: a LoRA adapter
    (:mod:`fnppo.megatron.lora`) is merged into its base weight here and nowhere else, as
    ``W + s B A`` of this rank's shard (:func:`fnppo.megatron.lora_linear.merged_delta`; then a new
    tensor in the weight's dtype)."""
    weight = p.param.detach()
    owner_name, _, leaf = p.name.rpartition(".")
    experts_name, _, proj = owner_name.rpartition(".")
    if leaf.startswith("weight") and leaf[6:].isdigit() and experts_name:  # a stacked expert's view
        experts = p.core.get_submodule(experts_name)
        if is_stacked(experts) and getattr(experts, "fnppo_lora", None) is not None:
            delta = stacked_merged_delta(experts, proj, int(leaf[6:]))
            return (weight.float() + delta).to(weight.dtype)
        return weight
    if leaf != "weight":
        return weight
    owner = p.core.get_submodule(owner_name)
    if getattr(owner, "fnppo_lora", None) is None:
        return weight
    return (weight.float() + merged_delta(owner)).to(weight.dtype)


def place_shard(full: Tensor, shard: Tensor, r: int, dim: int, gated: bool) -> None:
    """Copy tensor-parallel rank ``r``'s ``shard`` into its place in ``full`` (in place on ``full``, a
    buffer the caller allocated; ``shard`` is converted to ``full``'s dtype and device).

    ``full.narrow(dim, r * s, s) = shard`` with ``s = shard.shape[dim]``; a gated fc1 (``gated``):
    ``gate.narrow(dim, r * s/2, s/2) = shard_gate`` and the same for ``up``, where
    ``[gate; up] = full`` and ``[shard_gate; shard_up] = shard`` along ``dim``.
    """
    if gated:
        for whole, half in zip(full.chunk(2, dim=dim), shard.chunk(2, dim=dim)):
            s = half.shape[dim]
            whole.narrow(dim, r * s, s).copy_(half)
        return
    s = shard.shape[dim]
    full.narrow(dim, r * s, s).copy_(shard)
