"""The low-rank adapter of one Megatron linear: its forward under tensor and sequence parallelism,
its checkpoint entries and its merged weight.

A LoRA linear (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685)
computes ``y = x W^T + s * dropout(x) A^T B^T`` with the base weight ``W`` frozen, ``A`` ``[r, in]``,
``B`` ``[out, r]`` and ``s = alpha / r``. Megatron's fused linears hold several Hugging Face
projections (the fused QKV: per query group the query, key and value rows; a gated MLP's fc1: the
gate rows, then the up rows); each of those *parts* gets its own adapter, as PEFT gives each
projection its own: ``A`` stacks the parts' ``[r, in]`` matrices (``[parts * r, in]``) and ``B``
holds their output rows in the base weight's row layout (``[out, r]``), row ``j`` multiplying the
rank-``r`` activations of the part it belongs to.

Tensor parallelism (Megatron-LM, arXiv:1909.08053) shards the adapter like its base weight:

* column-parallel base (output rows split): ``A`` replicated, ``B`` split on its rows. The rank-r
  activations ``z = x A^T`` are made whole the way the base readies its input: without sequence
  parallelism ``z`` goes through ``copy_to_tensor_model_parallel_region`` (its gradient summed
  over TP, so ``A``'s gradient is whole on every rank); under sequence parallelism ``z`` is
  computed on this rank's tokens and gathered over the sequence (``gather_from_sequence_parallel_
  region``, reduce-scatter backward), and ``A``'s gradient (this rank's tokens only) is summed over
  TP by Megatron's finalize (``param.sequence_parallel``), as for a layer norm;
* row-parallel base (input columns split): ``A`` split on its columns, ``B`` replicated; ``z`` is
  all-reduced over TP (``reduce_from_tensor_model_parallel_region``), under sequence parallelism
  reduce-scattered over the sequence (then ``B``'s gradient is summed over TP by the finalize);
* expert linears (Megatron's ``SequentialMLP``): the token dispatcher does the communication; the
  adapter is local (expert tensor parallelism 1) and reduced over the expert data-parallel group
  like its base weight (``param.allreduce``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import nn

from fnppo.core.typing import Tensor

__all__ = ["AdapterSpec", "lora_class", "adapter_output", "merged_delta", "tp_size", "comm_mode", "is_adapter"]


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """What one adapted linear needs to know at run time (kept on the module as ``fnppo_lora``).

    ``role``: ``"column"`` or ``"row"`` (how the base weight is split); ``parts``: rows per query
    group of each part in this rank's shard (QKV: ``(heads/groups * d, d, d)``; gated fc1:
    ``(ffn/tp, ffn/tp)``; else ``(out/tp,)``) and ``groups`` their groups on this rank (QKV: query
    groups / TP, else 1); ``scaling`` ``alpha / rank``; ``gated`` a gated fc1 (its ``B`` is saved
    in Megatron's ``[gate; up]`` form); ``norm`` the input norm a fused norm-linear applies first
    (Transformer Engine's ``LayerNormColumnParallelLinear``: the adapter sees the normed input);
    ``shared`` (stacked experts, role ``"stacked"``): one adapter for all experts of the layer.
    """

    role: str
    rank: int
    parts: tuple[int, ...]
    groups: int
    scaling: float
    dropout: float
    gated: bool = False
    norm: bool = False
    shared: bool = False


def is_adapter(param: Tensor) -> bool:
    """Whether ``param`` is a LoRA adapter matrix (tagged ``fnppo_lora_adapter`` by :func:`fnppo.megatron.lora.apply_lora`)."""
    return bool(getattr(param, "fnppo_lora_adapter", False))


def tp_size(module: nn.Module) -> int:
    """The size of the tensor-parallel group that splits ``module``'s weight (expert TP for experts)."""
    group = getattr(module, "tp_group", None)
    return 1 if group is None else group.size()


def comm_mode(module: nn.Module) -> str:
    """``"local"`` (no TP, or experts: the dispatcher communicates), ``"sp"`` (sequence parallel) or ``"tp"``."""
    if tp_size(module) == 1 or getattr(module, "explicit_expert_comm", False):
        return "local"
    return "sp" if getattr(module, "sequence_parallel", False) else "tp"


def _normed(module: nn.Module, x: Tensor) -> Tensor:
    """The input of a fused norm-linear after its norm (Transformer Engine's ``LayerNormLinear``:
    ``normalization`` LayerNorm or RMSNorm, ``zero_centered_gamma``), computed in fp32."""
    w = module.layer_norm_weight.float()
    if getattr(module, "zero_centered_gamma", False):
        w = w + 1.0
    xf = x.float()
    if getattr(module, "normalization", "LayerNorm") == "RMSNorm":
        out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + module.eps) * w
    else:
        bias = getattr(module, "layer_norm_bias", None)
        out = F.layer_norm(xf, xf.shape[-1:], w, None if bias is None else bias.float(), module.eps)
    return out.to(x.dtype)


def _expand(z: Tensor, b: Tensor, spec: AdapterSpec) -> Tensor:
    """``z`` ``[..., parts * r]`` through ``B`` ``[out, r]``: output row ``j`` of part ``p`` is
    ``z_p . B[j]`` (rows in the base weight's layout: per group, the parts one after another)."""
    if len(spec.parts) == 1:
        return F.linear(z, b)
    zs = z.unflatten(-1, (len(spec.parts), spec.rank))
    bs = b.view(spec.groups, sum(spec.parts), spec.rank).split(list(spec.parts), dim=1)
    ys = [torch.einsum("...r,gnr->...gn", zs[..., p, :], bp) for p, bp in enumerate(bs)]
    return torch.cat(ys, dim=-1).flatten(-2)


def _dropout_rng(spec: AdapterSpec, mode: str) -> Any:
    """Where the adapter's dropout mask is drawn: an input split over the tensor-parallel ranks (a
    row-parallel base's input columns, or this rank's tokens under sequence parallelism) draws from
    Megatron's tensor-parallel RNG stream (its own seed per TP rank), as Megatron's dropout inside a
    TP region does; a replicated input (column-parallel without SP, or no TP) draws from torch's
    default generator, seeded alike on the TP ranks, so that every rank drops the same entries."""
    if mode == "sp" or (mode == "tp" and spec.role == "row"):
        return get_cuda_rng_tracker().fork()
    return contextlib.nullcontext()


def adapter_output(module: nn.Module, x: Tensor) -> Tensor:
    """The adapter's term ``s * dropout(x) A^T B^T`` of ``module``'s output, in the layout of the
    base output (this rank's rows for a column-parallel base; this rank's tokens under sequence
    parallelism). Dropout only in training mode."""
    spec: AdapterSpec = module.fnppo_lora
    if spec.norm:
        x = _normed(module, x)
    mode = comm_mode(module)
    if spec.dropout and module.training:
        with _dropout_rng(spec, mode):
            x = F.dropout(x, p=spec.dropout, training=True)
    group = getattr(module, "tp_group", None)
    z = F.linear(x, module.lora_A)
    if spec.role == "column":
        if mode == "tp":
            z = copy_to_tensor_model_parallel_region(z, group=group)
        elif mode == "sp":
            z = gather_from_sequence_parallel_region(z, tensor_parallel_output_grad=True, group=group)
        return _expand(z, module.lora_B, spec) * spec.scaling
    if mode == "tp":
        z = reduce_from_tensor_model_parallel_region(z, group=group)
    elif mode == "sp":
        z = reduce_scatter_to_sequence_parallel_region(z, group=group)
    return F.linear(z, module.lora_B) * spec.scaling


def merged_delta(module: nn.Module, a: Tensor | None = None, b: Tensor | None = None) -> Tensor:
    """``s * B A`` of this rank's shard, in the layout of the base weight shard (``[out, in]`` of
    this rank): what merging the adapter adds to the weight. Column-parallel: ``B``'s local rows
    times ``A``; row-parallel: ``B`` times ``A``'s local columns. Computed in fp32."""
    spec: AdapterSpec = module.fnppo_lora
    a = (module.lora_A if a is None else a).detach().float()
    b = (module.lora_B if b is None else b).detach().float()
    if len(spec.parts) == 1:
        return (b @ a) * spec.scaling
    bs = b.view(spec.groups, sum(spec.parts), spec.rank).split(list(spec.parts), dim=1)
    parts = [bp @ ap for bp, ap in zip(bs, a.view(len(spec.parts), spec.rank, -1), strict=True)]
    return torch.cat(parts, dim=1).reshape(b.shape[0], a.shape[-1]) * spec.scaling


class _LoRAMixin:
    """Added in front of a Megatron linear's class: its output plus the adapter's, and checkpoint
    entries for ``lora_A`` / ``lora_B`` sharded like the base weight."""

    def forward(self, input_: Tensor, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(input_, *args, **kwargs)
        delta = adapter_output(self, input_)
        if isinstance(out, tuple):
            return (out[0] + delta.to(out[0].dtype), *out[1:])
        return out + delta.to(out.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        spec: AdapterSpec = self.fnppo_lora
        name, axis = ("lora_B", 0) if spec.role == "column" else ("lora_A", 1)
        if tp_size(self) > 1:
            sd.update(
                make_sharded_tensors_for_checkpoint(
                    {name: getattr(self, name)},
                    prefix,
                    {name: axis},
                    sharded_offsets,
                    tp_group=self.tp_group,
                    dp_cp_group=(metadata or {}).get("dp_cp_group"),
                )
            )
        if spec.gated:  # [gate_r; up_r] per rank, saved in the [gate; up] layout as Megatron's MLP saves fc1
            key = f"{prefix}lora_B"
            sd[key] = apply_swiglu_sharded_factory(
                sd[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False)
            )
        return sd


@functools.cache
def lora_class(base: type) -> type:
    """The class of an adapted ``base`` linear: ``base`` with the adapter's forward and checkpoint
    entries in front (one class per base class)."""
    return type(f"LoRA{base.__name__}", (_LoRAMixin, base), {"__module__": __name__})
