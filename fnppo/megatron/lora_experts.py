"""LoRA adapters on stacked MoE experts (:class:`fnppo.megatron.stacked_experts.StackedExperts`).

The stacked experts compute each projection of all local experts as one grouped GEMM; their
adapters are stacked the same way (per expert ``A`` ``[parts * r, in]`` and ``B`` ``[out, r]``,
one tensor per projection with the expert axis first), so the adapted forward is two more grouped
GEMMs per projection (:meth:`StackedExperts._adapter`). Each projection of each layer has its own
rank and scaling (``LoRAConfig.rank_alpha`` of ``<experts>.linear_fc1`` / ``linear_fc2``); a gated
fc1 is ``parts`` 2 (gate and up, ``LoRAConfig(expert_gate_up="split")``) or 1 (one adapter over
both, ``"fused"``, PEFT's ``target_parameters`` form). Per expert, the adapter is the one
Megatron's ``SequentialMLP`` path puts on that expert's linear (:mod:`fnppo.megatron.lora_linear`:
a gated fc1's gate and up each get their own rank-``r`` adapter), named the same way in full
weights (``experts.local_experts.<global j>.linear_fc1.lora_A``), so full adapters move between
the two paths and the numbers agree to fp32 rounding.

``LoRAConfig(expert_layout="shared")``: one adapter per projection shared by all experts of the
layer (``experts.linear_fc1.lora_A`` ...). It is a dense parameter (``allreduce=True``): its
gradient (every local expert's tokens) is summed over all data-parallel ranks, expert-parallel
ones included, so it is the sum over all experts of all tokens under any expert-parallel size.

Expert tensor parallelism > 1 is refused (the replicated ``A`` of fc1 and ``B`` of fc2 would need
their gradients summed over the expert tensor-parallel group, which Megatron's finalize does not
do for expert parameters).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from fnppo.core.errors import input_error
from fnppo.megatron.lora_linear import AdapterSpec
from fnppo.megatron.stacked_experts import named_weights
from fnppo.megatron.weights import global_name, name_seed

__all__ = ["add_stacked_adapters", "stacked_merged_delta", "stacked_shared", "EXPERT_LAYOUTS", "check_stacked"]

_LOCAL_EXPERT = re.compile(r"\.local_experts\.\d+(?=\.)")

#: ``LoRAConfig.expert_layout`` values
EXPERT_LAYOUTS = ("per_expert", "shared")


def check_stacked(fn: str, name: str, module: nn.Module) -> None:
    """Refuse stacked experts that adapters cannot be exact on (expert tensor parallelism > 1)."""
    etp = module.tp_group.size()
    if etp > 1:
        raise input_error(
            fn,
            "model_chunks",
            f"expert_tensor_parallel_size (etp) 1 for adapters in stacked experts at {name}",
            f"etp={etp}",
        )


def _shapes(module: nn.Module, ranks: dict[str, int], fused: bool) -> dict[str, tuple[int, ...]]:
    """The adapter parameters of ``module`` (without the expert axis) for the projections in ``ranks``
    (``"fc1"`` / ``"fc2"`` -> rank; ``fused``: one fc1 adapter over the gate and up rows)."""
    _, halves, ffn, hidden = module.weight1.shape
    out = {}
    if "fc1" in ranks:
        r = ranks["fc1"]
        out.update(fc1_lora_A=((1 if fused else halves) * r, hidden), fc1_lora_B=(halves * ffn, r))
    if "fc2" in ranks:
        out.update(fc2_lora_A=(ranks["fc2"], ffn), fc2_lora_B=(hidden, ranks["fc2"]))
    return out


def add_stacked_adapters(core: nn.Module, name: str, module: nn.Module, config) -> None:  # noqa: ANN001 - LoRAConfig
    """Give the stacked experts ``module`` (at ``name`` in ``core``) adapters on the targeted
    projections, each of the rank and alpha ``config.rank_alpha`` gives its linear
    (``<name>.linear_fc1``, 1-rank name): ``A`` uniform in ``±1/sqrt(in)`` from the generator of
    ``(seed, full name of each expert's A)`` (the same draw as the ``SequentialMLP`` path's), ``B``
    zero. ``module.fnppo_lora`` is then ``{"fc1": AdapterSpec, "fc2": AdapterSpec}`` (the adapted ones)."""
    shared = config.expert_layout == "shared"
    fused = config.expert_gate_up == "fused" and module.gated
    experts, halves, ffn = module.weight1.shape[:3]
    kw = dict(dtype=module.weight1.dtype, device=module.weight1.device)
    gname = _LOCAL_EXPERT.sub("", global_name(core, name))
    specs = {}
    for proj in ("linear_fc1", "linear_fc2"):
        if proj not in config.targets:
            continue
        rank, alpha = config.rank_alpha(f"{gname}.{proj}")
        fc1 = proj == "linear_fc1"
        specs["fc1" if fc1 else "fc2"] = AdapterSpec(
            role="stacked",
            rank=rank,
            parts=((halves * ffn,) if fused else (ffn,) * halves) if fc1 else (module.weight2.shape[1],),
            groups=1,
            scaling=config.scaling_for(rank, alpha),
            dropout=float(config.dropout),
            gated=module.gated and fc1,
            shared=shared,
        )
    for pname, shape in _shapes(module, {k: v.rank for k, v in specs.items()}, fused).items():
        p = nn.Parameter(torch.zeros(shape if shared else (experts, *shape), **kw))
        p.fnppo_lora_adapter = True
        p.allreduce = True if shared else module.weight1.allreduce
        p.tensor_model_parallel = False
        p.partition_dim = 0
        p.partition_stride = 1
        module.register_parameter(pname, p)
    module.fnppo_lora = specs
    prefix = f"{name}."  # expert parallelism enters through global_name (global expert indices)
    with torch.no_grad():
        for vname, view in named_weights(core, adapters=True):
            if not (vname.startswith(prefix) and vname.rpartition(".")[2].rstrip("0123456789") == "lora_A"):
                continue
            g = torch.Generator().manual_seed(name_seed(config.seed, global_name(core, vname)))
            bound = 1.0 / math.sqrt(view.shape[1])
            full = (torch.rand(tuple(view.shape), generator=g, dtype=torch.float64) * 2 - 1) * bound
            view.copy_(full.to(view.dtype))


def stacked_merged_delta(module: nn.Module, proj: str, expert: int) -> torch.Tensor:
    """``s * B_e A_e`` of local expert ``expert``'s ``proj`` (``"linear_fc1"``: ``[parts * ffn,
    hidden]``, gate rows then up rows; ``"linear_fc2"``: ``[hidden, ffn]``), in fp32; zeros for a
    projection without an adapter. A split gated fc1: each part's rows from its own ``r`` columns of
    ``A``; a fused one: ``B A`` over all rows."""
    key = "fc1" if proj == "linear_fc1" else "fc2"
    spec: AdapterSpec | None = module.fnppo_lora.get(key)
    if spec is None:
        return torch.zeros(())
    a, b = getattr(module, f"{key}_lora_A").detach().float(), getattr(module, f"{key}_lora_B").detach().float()
    if not spec.shared:
        a, b = a[expert], b[expert]
    parts = a.shape[0] // spec.rank
    blocks = [bp @ ap for bp, ap in zip(b.chunk(parts, 0), a.chunk(parts, 0), strict=True)]
    return torch.cat(blocks, dim=0) * spec.scaling


def stacked_shared(module: nn.Module) -> bool:
    """Whether the adapted stacked experts ``module`` hold one adapter for all their experts."""
    return any(spec.shared for spec in getattr(module, "fnppo_lora", {}).values())
