"""Full (unsharded) weights <-> this rank's shards: load, gather, and a layout-invariant initialization.

Full names are those of a 1-rank ``GPTModel``: ``decoder.layers.<global index>.…`` (global expert
indices for MoE experts); ``output_layer.weight`` is absent when embeddings are tied. The name and
shard helpers (:func:`global_name`, :func:`is_expert`, :func:`tp_of`, :func:`is_gated_fc1`) are
shared with the Hugging Face conversion (:mod:`fnppo.io.hf`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fnppo.core.errors import InputError, input_error
from fnppo.core.typing import Tensor
from fnppo.megatron.parallel import ParallelLayout, current_layout
from fnppo.megatron.stacked_experts import named_weights
from fnppo.megatron.unwrap import model_head, unwrap_model
from fnppo.megatron.value import VALUE_HEAD_PREFIX

__all__ = [
    "load_full_weights",
    "gather_full_weights",
    "layout_invariant_init",
    "global_name",
    "is_expert",
    "is_gated_fc1",
    "tp_of",
    "shard_of",
    "full_shape",
    "name_seed",
]


def is_expert(param: Tensor) -> bool:
    """Megatron marks expert weights (sharded over expert parallelism) with ``allreduce=False``."""
    return not getattr(param, "allreduce", True)


def tp_of(param: Tensor, layout: ParallelLayout) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group that shards ``param``: expert TP for experts."""
    return (layout.etp, layout.etp_rank) if is_expert(param) else (layout.tp, layout.tp_rank)


def global_name(core: nn.Module, name: str, layout: ParallelLayout | None = None) -> str:
    """The 1-rank name: global layer index (any prefix, e.g. a VLM's ``language_model.``); local
    expert ``i`` of EP rank ``r`` is expert ``r * E / ep + i``, named as Megatron's ``SequentialMLP``
    names it (``experts.local_experts.<j>.linear_fc1.weight``) whatever the experts module (grouped
    experts' ``experts.linear_fc1.weight<i>`` too), so full weights move between expert modules."""
    parts = name.split(".")
    for j in range(len(parts) - 2):
        if parts[j] == "decoder" and parts[j + 1] == "layers" and parts[j + 2].isdigit():
            layer = core.get_submodule(".".join(parts[: j + 3]))
            parts[j + 2] = str(layer.layer_number - 1)
            break
    if "experts" in parts and core.config.num_moe_experts:
        layout = layout or current_layout()
        offset = layout.ep_rank * (core.config.num_moe_experts // layout.ep)
        if "local_experts" in parts:  # SequentialMLP: experts.local_experts.<i>.linear_fc1.weight
            i = parts.index("local_experts") + 1
            parts[i] = str(int(parts[i]) + offset)
        else:  # grouped GEMM: experts.linear_fc1.weight<i> -> experts.local_experts.<i + offset>.linear_fc1.weight
            head, idx = parts[-1].rstrip("0123456789"), parts[-1][len(parts[-1].rstrip("0123456789")) :]
            if idx and parts[-2] in ("linear_fc1", "linear_fc2"):
                parts[-3:] = ["experts", "local_experts", str(int(idx) + offset), parts[-2], head]
    return ".".join(parts)


def _tied_output(core: nn.Module, gname: str) -> bool:
    """Whether ``gname`` is an output layer tied to its model's word embeddings."""
    return gname.endswith("output_layer.weight") and bool(getattr(core, "share_embeddings_and_output_weights", False))


def _embedding_name(gname: str) -> str:
    """The word-embedding name beside an output layer: ``<prefix>output_layer.weight`` ->
    ``<prefix>embedding.word_embeddings.weight``."""
    return gname[: -len("output_layer.weight")] + "embedding.word_embeddings.weight"


def is_gated_fc1(core: nn.Module, name: str) -> bool:
    """A gated MLP's fused ``[gate; up]`` fc1 (dense, expert or grouped-GEMM expert), judged by the
    config of the module that owns it (a VLM's vision MLP has its own)."""
    parts = name.split(".")
    if not (
        "mlp" in parts
        and len(parts) >= 3
        and parts[-2] == "linear_fc1"
        and parts[-1].rstrip("0123456789") in ("weight", "bias", "lora_B")
    ):
        return False
    owner = core.get_submodule(".".join(parts[:-2]))
    return bool(getattr(getattr(owner, "config", core.config), "gated_linear_unit", False))


def shard_of(core: nn.Module, name: str, param: Tensor, full: Tensor, tp: int, tp_rank: int) -> Tensor:
    """Tensor-parallel rank ``tp_rank``'s shard of the full tensor ``full`` of ``param`` (along its
    ``partition_dim``; a gated fc1's gate and up halves each split; unsplit parameters: ``full``)."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    if is_gated_fc1(core, name):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[tp_rank], up.chunk(tp, dim=dim)[tp_rank]], dim=dim)
    return full.chunk(tp, dim=dim)[tp_rank]


def _is_value_head(gname: str) -> bool:
    """Whether ``gname`` is a parameter of a critic's value head."""
    return gname.startswith(VALUE_HEAD_PREFIX)


def _skippable_with_fresh_head(gname: str) -> bool:
    """Tensors of ``full`` that ``fresh_head=True`` leaves aside: a policy's vocabulary output
    layer, a critic's value head."""
    return gname.endswith("output_layer.weight") or _is_value_head(gname)


def load_full_weights(
    model_chunks: Sequence[nn.Module],
    full: Mapping[str, Tensor],
    *,
    strict: bool = True,
    fresh_head: bool = False,
    adapters: bool = False,
) -> list[str]:
    """Copy this rank's TP/PP/EP shard of full (1-rank) weights into the model chunks' parameters.

    Expert weights: EP rank ``r`` holds experts ``r * E / ep ... (r + 1) * E / ep - 1`` (full names
    carry the global expert index), each sharded over expert TP (``etp``).

    Every parameter of every chunk must be found in ``full`` with a shape that shards to it; with
    ``strict`` no tensor of ``full`` may be left unused by the whole world. Collective: the ranks
    share their verdicts before anything is written, so a mismatch on any rank loads nothing anywhere
    and every rank raises the same error.

    ``fresh_head=True`` (value models, ``build_gpt(cfg, head="value")``): the trunk is loaded and the
    value head keeps the weights it has (a fresh head on an actor's trunk); a policy's vocabulary
    output layer (``output_layer.weight``) and a stored value head in ``full`` are skipped.

    LoRA adapters (:mod:`fnppo.megatron.lora`) are not among the weights; ``adapters=True`` loads
    the adapter tensors (``<linear>.lora_A``, ``<linear>.lora_B``, as :func:`gather_full_weights`
    with ``adapters=True`` returns them) instead of the base weights.

    Returns:
        The names of the tensors of ``full`` that were not loaded (sorted; empty with ``strict``
        unless ``fresh_head`` skipped some).

    Raises:
        InputError: a parameter missing from ``full`` or of another shape; with ``strict``, unused
            tensors; ``fresh_head`` for a model without a value head.
    """
    if fresh_head and not any(model_head(c) == "value" for c in model_chunks):
        raise input_error(
            "load_full_weights", "fresh_head", "False for a model without a value head (head='lm')", "True"
        )
    layout = current_layout()
    plan: list[tuple[Tensor, Tensor]] = []
    used: set[str] = set()
    problem: str | None = None
    for chunk in model_chunks:
        core = unwrap_model(chunk)
        for name, param in named_weights(core, adapters=adapters):
            gname = global_name(core, name, layout)
            if fresh_head and _is_value_head(gname):
                continue  # keeps its weights
            if gname.endswith("output_layer.weight") and gname not in full and _embedding_name(gname) in full:
                gname = _embedding_name(gname)
            if gname not in full:
                problem = problem or str(
                    input_error("load_full_weights", "full", f"a tensor named {gname!r}", "no such tensor")
                )
                continue
            used.add(gname)
            src = full[gname]
            tp, tp_rank = tp_of(param, layout)
            shard = shard_of(core, name, param, src, tp, tp_rank)
            want_shape = full_shape(param, tp)  # uneven chunks can still fit a shard
            if tuple(src.shape) != want_shape or tuple(shard.shape) != tuple(param.shape):
                problem = problem or str(
                    input_error(
                        "load_full_weights",
                        f"full[{gname!r}]",
                        f"shape {want_shape} (shard {tuple(param.shape)} for tp_rank {tp_rank} of {tp})",
                        f"{tuple(src.shape)} (shard {tuple(shard.shape)})",
                    )
                )
                continue
            plan.append((param, shard))
    # Every rank learns every rank's verdict before anyone writes: all load or none does.
    verdicts: list[Any] = [(problem, used)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, (problem, used))
    first = next((p for p, _ in verdicts if p), None)
    if first:
        raise InputError(first)
    unused = sorted(set(full) - set().union(*(u for _, u in verdicts)))
    if strict:
        bad = [n for n in unused if not (fresh_head and _skippable_with_fresh_head(n))]
        if bad:
            raise input_error(
                "load_full_weights", "full", "only tensors of this model (strict=True)", f"unused tensors {bad[:5]}"
            )
    with torch.no_grad():
        for param, shard in plan:
            param.copy_(shard.to(dtype=param.dtype, device=param.device))
    # DDP keeps fp32 main params for half precision in the optimizer; callers build the optimizer after loading.
    return unused


def gather_full_weights(model_chunks: Sequence[nn.Module], *, adapters: bool = False) -> dict[str, Tensor]:
    """All ranks' shards assembled into full (1-rank) weights, returned on every rank (CPU fp32 copies).

    The inverse of :func:`load_full_weights` (``adapters=True``: the LoRA adapter tensors instead of
    the base weights). Collective over the whole world.
    """
    layout = current_layout()
    local: dict[str, Tensor] = {}
    for chunk in model_chunks:
        core = unwrap_model(chunk)
        for name, param in named_weights(core, adapters=adapters):
            gname = global_name(core, name, layout)
            t = param.detach().to(torch.float32, copy=True)  # a copy even when already fp32
            tp, _ = tp_of(param, layout)
            if getattr(param, "tensor_model_parallel", False) and tp > 1:
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=layout.etp_group if is_expert(param) else layout.tp_group)
                dim = param.partition_dim
                if is_gated_fc1(core, name):
                    gates = [p.chunk(2, dim=dim)[0] for p in parts]
                    ups = [p.chunk(2, dim=dim)[1] for p in parts]
                    t = torch.cat(gates + ups, dim=dim)
                else:
                    t = torch.cat(parts, dim=dim)
            if _tied_output(core, gname):
                continue
            local[gname] = t.cpu()
    if layout.ep > 1:  # each EP rank holds other experts (and the same dense weights)
        by_ep: list[Any] = [None] * layout.ep
        dist.all_gather_object(by_ep, local, group=layout.ep_group)
        for part in by_ep:
            local.update(part)
    if layout.pp == 1:
        return local
    gathered: list[Any] = [None] * layout.pp
    dist.all_gather_object(gathered, local if layout.tp_rank == 0 else local, group=layout.pp_group)
    out: dict[str, Tensor] = {}
    for part in gathered:
        out.update(part)
    return out


def full_shape(param: Tensor, tp: int) -> tuple[int, ...]:
    """The full (1-rank) shape of ``param`` split over ``tp`` tensor-parallel ranks."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp > 1:
        shape[param.partition_dim] *= tp
    return tuple(shape)


def name_seed(seed: int, name: str) -> int:
    """The seed of full tensor ``name``'s generator: a function of ``(seed, name)`` only."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def layout_invariant_init(model_chunks: Sequence[nn.Module], *, seed: int = 0, std: float | None = None) -> None:
    """Initialize parameters so that every TP/PP/VPP layout holds the same full model.

    Megatron's own initialization depends on the layout (each rank draws its shard from its own RNG
    stream). Here every full tensor is drawn from a generator seeded by ``(seed, global name)`` and
    this rank keeps its shard, so runs with different layouts start from identical weights. Matrices
    get N(0, std^2) (output projections std/sqrt(2 * num_layers), as in Megatron), norm weights 1,
    biases 0. Collective-free.
    """
    layout = current_layout()
    with torch.no_grad():
        for chunk in model_chunks:
            core = unwrap_model(chunk)
            cfg = core.config
            sigma = std if std is not None else cfg.init_method_std
            for name, param in named_weights(core):
                gname = global_name(core, name, layout)
                if _tied_output(core, gname):
                    gname = _embedding_name(gname)
                tp, tp_rank = tp_of(param, layout)
                shape = full_shape(param, tp)
                owner = name.split(".")[-2]
                if "norm" in owner or owner.startswith("ln_") or name.endswith("layer_norm_weight"):
                    full = torch.ones(shape)
                elif name.endswith("bias"):
                    full = torch.zeros(shape)
                else:
                    g = torch.Generator().manual_seed(name_seed(seed, gname))
                    s = (
                        sigma / math.sqrt(2.0 * cfg.num_layers)
                        if gname.endswith(("linear_proj.weight", "linear_fc2.weight"))
                        else sigma
                    )
                    full = torch.randn(shape, generator=g) * s
                param.copy_(shard_of(core, name, param, full, tp, tp_rank).to(param.dtype))
