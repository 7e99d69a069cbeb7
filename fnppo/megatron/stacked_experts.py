"""Mixture-of-Experts experts with stacked weights: one parameter and one grouped GEMM per projection.

:class:`StackedExperts` is an experts module for Megatron's ``MoELayer`` (``ModelConfig(moe_experts=
"stacked")``). Megatron's ``SequentialMLP`` runs one MLP per expert and Transformer Engine's
``TEGroupedMLP`` launches one GEMM per expert (on several streams) and keeps one parameter per
expert: an MoE layer of 64 experts is 128 parameters, each with its own gradient hook, gradient
accumulation, optimizer and norm kernels. Here each layer holds two parameters,

* ``weight1``: ``[local experts, 2 (gate, up) or 1, ffn / etp, hidden]``, the fc1 of every local
  expert (a gated MLP's gate and up halves on their own axis, so tensor parallelism splits both
  the same way),
* ``weight2``: ``[local experts, hidden, ffn / etp]``, the fc2,

and each projection is one call of :func:`fnppo.core.ops.grouped_matmul.grouped_matmul` over the
permuted tokens (``torch._grouped_mm``: one CUTLASS grouped GEMM on a Hopper GPU), with no host
synchronization. The computation is that of ``SequentialMLP``: ``fc2(act(gate) * up * prob)`` per
token and expert, the router's probability applied after the activation in fp32 and cast back.

For everything that reads weights by name (Hugging Face load and export, full-weight gather and
load, layout-invariant initialization), :func:`named_weights` presents each stacked parameter as
per-expert views named like ``TEGroupedMLP``'s (``experts.linear_fc1.weight<i>``,
``experts.linear_fc2.weight<i>``), so every tool that knows Transformer Engine's grouped experts
knows these. :meth:`StackedExperts.sharded_state_dict` describes the stacks for Megatron's
distributed checkpoints (expert axis over expert parallelism, the ffn axis over expert tensor
parallelism), so they reshard between layouts.

LoRA (:mod:`fnppo.megatron.lora_experts` puts the adapters on): the batched products carry a
batched low-rank update, per expert ``A`` and ``B`` stacked like the weights (``fc1_lora_A``
``[experts, parts * r, hidden]``, ``fc1_lora_B`` ``[experts, parts * ffn, r]``, ``fc2_lora_A``
``[experts, r, ffn]``, ``fc2_lora_B`` ``[experts, hidden, r]``; a gated fc1's gate and up each
have their own rank-``r`` adapter, as Megatron's ``SequentialMLP`` path and PEFT give them; or,
``LoRAConfig(expert_gate_up="fused")``, one rank-``r`` adapter over both, ``fc1_lora_A``
``[experts, r, hidden]``, as PEFT's ``target_parameters`` adapter of ``gate_up_proj``), each
one more grouped GEMM; or one adapter shared by all experts of the layer (the same shapes without
the expert axis, plain matrix products over all the layer's tokens).

Not covered (refused at build): biases in the experts, FP8/FP4, a latent MoE projection,
``moe_apply_probs_on_input``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule
from torch import Tensor, nn
from torch.nn import functional as F

from fnppo.core.errors import input_error
from fnppo.core.ops.grouped_matmul import grouped_matmul

__all__ = ["StackedExperts", "named_weights", "is_stacked", "ADAPTER_PARAMS"]

#: the adapter parameters of an adapted :class:`StackedExperts` -> (projection, ``A`` or ``B``)
ADAPTER_PARAMS = {
    "fc1_lora_A": ("linear_fc1", "lora_A"),
    "fc1_lora_B": ("linear_fc1", "lora_B"),
    "fc2_lora_A": ("linear_fc2", "lora_A"),
    "fc2_lora_B": ("linear_fc2", "lora_B"),
}

_FN = "fnppo.moe.StackedExperts"


def _refuse_unsupported(config) -> None:  # noqa: ANN001 - a Megatron TransformerConfig
    for field, bad, expected in (
        ("add_bias_linear", True, "False (no biases in stacked experts)"),
        ("moe_apply_probs_on_input", True, "False"),
        ("moe_latent_size", "set", "None"),
        ("fp8", "set", "None (FP8 experts need moe_experts='te_grouped')"),
        ("fp4", "set", "None"),
    ):
        value = getattr(config, field, None)
        if (bad == "set" and value is not None) or (bad is True and value is True):
            raise input_error(_FN, f"config.{field}", expected, repr(value))


class StackedExperts(MegatronModule):
    """The local experts of one MoE layer as two stacked weights and two grouped GEMMs.

    Built by Megatron's ``MoELayer`` from the spec ``ModuleSpec(module=StackedExperts)``
    (:func:`fnppo.megatron.layer_specs.stacked_experts_spec`); the forward takes what Megatron's
    experts modules take: the permuted tokens (sorted by local expert), the number of tokens of
    each local expert and the permuted router probabilities, and returns ``(output, None)``.
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None) -> None:  # noqa: ANN001
        super().__init__(config=config)
        _refuse_unsupported(config)
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        etp = self.tp_group.size()
        ffn = config.moe_ffn_hidden_size
        if ffn % etp:
            raise input_error(
                _FN, "config.moe_ffn_hidden_size", f"a multiple of the expert tensor-parallel size {etp}", str(ffn)
            )
        self.gated = bool(config.gated_linear_unit)
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        kw = dict(dtype=config.params_dtype, device=device)
        hidden = config.hidden_size
        self.weight1 = nn.Parameter(torch.empty(num_local_experts, 2 if self.gated else 1, ffn // etp, hidden, **kw))
        self.weight2 = nn.Parameter(torch.empty(num_local_experts, hidden, ffn // etp, **kw))
        expert_parallel = config.expert_model_parallel_size > 1
        for w in (self.weight1, self.weight2):
            # Megatron's conventions: the ffn axis is split over expert TP; experts sharded over EP
            # are reduced over the expert data-parallel group only (allreduce=False).
            w.tensor_model_parallel = True
            w.partition_dim = 2
            w.partition_stride = 1
            w.allreduce = not expert_parallel
        if config.perform_initialization:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                config.init_method(self.weight1.data)
                config.output_layer_init_method(self.weight2.data)
        self.activation_func = config.activation_func

    def forward(self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor, permuted_probs: Tensor):
        x = permuted_local_hidden_states
        e, halves, ffn, hidden = self.weight1.shape
        if not isinstance(tokens_per_expert, Tensor):
            tokens_per_expert = torch.tensor(tokens_per_expert)
        ends = torch.cumsum(tokens_per_expert.to(device=x.device), 0).to(torch.int32)
        h = grouped_matmul(x, self.weight1.view(e, halves * ffn, hidden), ends)
        if hasattr(self, "fc1_lora_A"):
            h = h + self._adapter(x, "fc1", ends).to(h.dtype)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            a = self.activation_func(gate) * up
        else:
            a = self.activation_func(h)
        a = (a * permuted_probs.unsqueeze(-1)).to(x.dtype)
        out = grouped_matmul(a, self.weight2, ends)
        if hasattr(self, "fc2_lora_A"):
            out = out + self._adapter(a, "fc2", ends).to(out.dtype)
        return out, None

    def _adapter(self, x: Tensor, proj: str, ends: Tensor) -> Tensor:
        """The adapter term ``s * dropout(x) A_e^T B_e^T`` of projection ``proj`` for each row's expert
        ``e`` (shared layout: the one ``A``, ``B`` for every row); a gated fc1's gate and up parts each
        multiply their own ``r`` columns of ``x A^T`` (output ``[gate rows; up rows]``), here as one
        product with the block-diagonal ``B`` (:func:`_block_diagonal_parts`); a fused fc1 adapter
        (``LoRAConfig(expert_gate_up="fused")``) is one rank-``r`` ``A`` and ``B`` over all rows. The scale ``s`` multiplies
        the ``r``-wide ``x A^T`` rather than the output (the same product up to rounding)."""
        spec = self.fnppo_lora[proj]
        a, b = getattr(self, f"{proj}_lora_A"), getattr(self, f"{proj}_lora_B")
        if spec.dropout and self.training:
            x = F.dropout(x, p=spec.dropout, training=True)
        parts = a.shape[-2] // spec.rank
        # contiguous: the reference policy's adapters_off passes B as expanded zeros (stride 0)
        b = _block_diagonal_parts(b, parts) if parts > 1 else b.contiguous()
        if spec.shared:
            return F.linear(F.linear(x, a) * spec.scaling, b)
        return grouped_matmul(grouped_matmul(x, a, ends) * spec.scaling, b, ends)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Each stack as one sharded tensor of the global ``[experts, ...]`` shape: the expert axis
        split over expert parallelism, the ffn axis over expert tensor parallelism, replicated over
        the expert data-parallel group (so Megatron's distributed checkpoints reshard it)."""
        from megatron.core.dist_checkpointing import ShardedTensor

        n = len(sharded_offsets)
        ep, ep_rank = self.ep_group.size(), self.ep_group.rank()
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        out = {}
        for name in ("weight1", "weight2"):
            param = getattr(self, name)
            out[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}{name}",
                param,
                *sharded_offsets,
                (n, ep_rank, ep),
                (n + 2, tp_rank, tp),
                replica_id=(0, 0, self.dp_group.rank()),
                prepend_axis_num=n,
            )
        for name in ADAPTER_PARAMS:
            if not hasattr(self, name):
                continue
            param = getattr(self, name)
            if _shared(self):  # replicated like a dense weight
                from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

                out.update(make_sharded_tensors_for_checkpoint({name: param}, prefix, {}, sharded_offsets))
                continue
            out[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}{name}",
                param,
                *sharded_offsets,
                (n, ep_rank, ep),
                replica_id=(0, tp_rank, self.dp_group.rank()),
                prepend_axis_num=n,
            )
        return out


def _block_diagonal_parts(b: Tensor, parts: int) -> Tensor:
    """``[..., parts * n, r]`` (the ``B`` of ``parts`` stacked projections sharing one input) as the
    ``[..., parts * n, parts * r]`` block-diagonal matrix whose part ``p`` reads columns
    ``p * r .. (p + 1) * r``: ``z @ _block_diagonal_parts(b).T`` equals the concatenation of
    ``z_p @ b_p.T`` over the parts (``z_p`` the ``p``-th ``r`` columns of ``z``), in one product."""
    rows = b.chunk(parts, dim=-2)
    r = b.shape[-1]
    return torch.cat([F.pad(bp, (p * r, (parts - 1 - p) * r)) for p, bp in enumerate(rows)], dim=-2)


def _shared(module: nn.Module) -> bool:
    """Whether adapted stacked experts hold one adapter for all experts (``fnppo_lora``: projection -> spec)."""
    return any(spec.shared for spec in getattr(module, "fnppo_lora", {}).values())


def is_stacked(module: nn.Module) -> bool:
    """Whether ``module`` is a :class:`StackedExperts`."""
    return isinstance(module, StackedExperts)


def _view(param: Tensor, view: Tensor, partition_dim: int) -> Tensor:
    view.tensor_model_parallel = True
    view.partition_dim = partition_dim
    view.partition_stride = 1
    view.allreduce = param.allreduce
    return view


def named_weights(core: nn.Module, *, adapters: bool = False) -> Iterator[tuple[str, Tensor]]:
    """``core.named_parameters()``, with each :class:`StackedExperts` stack given as per-expert views.

    Local expert ``i``'s fc1 is ``<prefix>.linear_fc1.weight<i>`` (``[2 * ffn / etp, hidden]``: gate
    rows then up rows, as a gated fc1 of Megatron's other expert modules), its fc2
    ``<prefix>.linear_fc2.weight<i>`` (``[hidden, ffn / etp]``); the views carry Megatron's
    tensor-parallel attributes (``partition_dim`` 0 and 1) and write through to the stacks.

    LoRA adapter matrices (parameters tagged ``fnppo_lora_adapter``, :mod:`fnppo.megatron.lora`)
    are left out: the weights are the base model's. ``adapters=True``: the adapter matrices only,
    a stacked experts module's per-expert adapters as views named like ``SequentialMLP``'s adapters
    by local index (``<prefix>.linear_fc1.lora_A<i>``: ``[parts * r, hidden]``, ``lora_B<i>``
    ``[parts * ffn, r]``; ``linear_fc2.lora_A<i>`` ``[r, ffn]``, ``lora_B<i>`` ``[hidden, r]``), a
    shared adapter once (``<prefix>.linear_fc1.lora_A``, ...).
    """
    stacked = {name for name, m in core.named_modules() if isinstance(m, StackedExperts)}
    for name, param in core.named_parameters():
        if bool(getattr(param, "fnppo_lora_adapter", False)) != adapters:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner not in stacked:
            yield name, param
            continue
        if leaf in ADAPTER_PARAMS:
            proj, ab = ADAPTER_PARAMS[leaf]
            if _shared(core.get_submodule(owner)):
                yield f"{owner}.{proj}.{ab}", param
            else:
                for i in range(param.shape[0]):  # expert tensor parallelism 1 (adapters refuse more)
                    view = _view(param, param[i], 0)
                    view.tensor_model_parallel = False
                    yield f"{owner}.{proj}.{ab}{i}", view
            continue
        if leaf == "weight1":
            e, halves, ffn, hidden = param.shape
            for i in range(e):
                yield f"{owner}.linear_fc1.weight{i}", _view(param, param[i].view(halves * ffn, hidden), 0)
        else:
            for i in range(param.shape[0]):
                yield f"{owner}.linear_fc2.weight{i}", _view(param, param[i], 1)
