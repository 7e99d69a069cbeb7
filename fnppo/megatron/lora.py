"""LoRA adapters on a Megatron GPT: the config, putting adapters on built chunks, and parameter sets.

:func:`apply_lora` gives the chosen linears of built model chunks (before :func:`fnppo.wrap_ddp`)
low-rank adapters (:mod:`fnppo.megatron.lora_linear`), freezes every other parameter and tags it
``fnppo_lora_base`` (left out of checkpoints). Megatron's DDP, the (distributed) optimizer and the
grad norm then hold the adapters only: :func:`fnppo.wrap_ddp`, :func:`fnppo.build_optimizer`,
``train_step`` and ``critic_step`` take such a model unchanged.

The reference policy needs no second model: :func:`adapters_off` is a parameter set (one dict per
chunk, ``params=`` of ``compute_logprobs``) whose every ``B`` is zero, so the same modules compute
the base model (bit for bit: the adapter adds exact zeros); :func:`snapshot_adapters` copies the
adapters (any other adapter set is a dict of the same names).

Adapter tensors are named after their linear (``decoder.layers.0.self_attention.linear_qkv.lora_A``);
:func:`fnppo.megatron.weights.gather_full_weights` / ``load_full_weights`` with ``adapters=True``
move them as full (1-rank) tensors, and :func:`fnppo.megatron.weights.named_weights`-based tools
(full weights, Hugging Face load and export) see the base weights only; the Hugging Face export
writes the merged weights ``W + s B A``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch import nn

from fnppo.core.errors import check_positive_int, input_error
from fnppo.core.typing import Tensor
from fnppo.megatron.lora_experts import EXPERT_LAYOUTS, add_stacked_adapters, check_stacked
from fnppo.megatron.lora_linear import AdapterSpec, is_adapter, lora_class, tp_size
from fnppo.megatron.parallel import current_layout
from fnppo.megatron.stacked_experts import is_stacked
from fnppo.megatron.unwrap import unwrap_model
from fnppo.megatron.weights import full_shape, global_name, name_seed, shard_of, tp_of

__all__ = [
    "LoRAConfig",
    "TARGETS",
    "apply_lora",
    "adapters_off",
    "snapshot_adapters",
    "adapter_names",
    "lora_config_of",
    "is_adapter",
]

#: the linears that can carry adapters, by their Megatron name
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
#: ``LoRAConfig.expert_gate_up`` values
GATE_UP_FORMS = ("split", "fused")
_FN = "fnppo.lora.apply_lora"
_OVERRIDE_NAME = re.compile(r"^(?:.+\.)?decoder\.layers\.\d+\.(?:[a-z_]+\.)+linear_(?:qkv|proj|fc1|fc2)$")
_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)(?=\.|$)")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.\d+(?=\.)")


def _number(v: object) -> bool:
    """An int or float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters: ``W x + (alpha / rank) B A dropout(x)`` on the ``targets`` linears.

    Reference: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685.

    Args:
        rank: ``r`` of every adapter (each part of a fused linear: query, key and value of the fused
            QKV, gate and up of a gated fc1, gets its own rank-``r`` adapter, as in PEFT).
        alpha: the scaling numerator; the adapter's output is multiplied by ``alpha / rank``.
        dropout: dropout on the adapter's input in training forwards (0: none).
        targets: names of the linears to adapt, from :data:`TARGETS` (fused QKV, attention output,
            MLP fc1 (gate/up), MLP fc2 (down)).
        experts: also adapt the targets inside MoE experts (Megatron's ``SequentialMLP``, or fnppo's
            stacked experts, ``ModelConfig(moe_experts="stacked")``: :mod:`fnppo.megatron.lora_experts`).
        expert_layout: ``"per_expert"`` (each expert its own adapter, PEFT's layout) or
            ``"shared"`` (one adapter per projection for all experts of a layer; stacked experts
            only; its gradient summed over all experts on all expert-parallel ranks).
        seed: ``A`` of each adapter is drawn from a generator seeded by ``(seed, its full name)``,
            uniform in ``±1/sqrt(in)`` (PEFT's default, Kaiming-uniform with ``a = sqrt(5)``), the
            same in every layout; ``B`` starts at zero, so the adapted model starts as the base.
        rslora: rank-stabilized scaling ``alpha / sqrt(rank)`` instead of ``alpha / rank``
            (Kalajdzievski, arXiv:2312.03732; PEFT's ``use_rslora``).
        expert_gate_up: the adapter of a gated expert fc1 (``[gate; up]`` rows): ``"split"``, a
            rank-``r`` adapter for gate and for up each (as for the dense MLP; PEFT's rank-``2r``
            ``gate_up_proj`` adapter with a block-diagonal ``B``), or ``"fused"``, one rank-``r``
            adapter over the fused rows (one ``A`` ``[r, hidden]`` shared by gate and up, one ``B``
            ``[2 ffn, r]``: what PEFT trains with ``target_parameters=["gate_up_proj"]``).
        overrides: ``(rank, alpha)`` of single linears, by their name in a 1-rank model with the
            experts' ``local_experts.<j>`` left out (``{"decoder.layers.0.mlp.experts.linear_fc2":
            (8, 32.0)}``: layer 0's expert fc2, every expert); a dict or ``(name, rank, alpha)``
            triples (PEFT's ``rank_pattern`` / ``alpha_pattern`` resolved per layer,
            :func:`fnppo.lora.lora_config_from_peft`). Stored as sorted triples.

    Raises:
        InputError: a rank that is not a positive int, ``alpha`` not a finite number > 0 (NaN,
            inf, a string), ``dropout`` outside ``[0, 1)``, a seed that is not an int, no targets or
            an unknown one, an unknown ``expert_layout`` or ``expert_gate_up``, ``rslora`` not a
            bool, an override that is not ``name -> (positive int, finite number > 0)``, names a
            linear outside ``targets``, or names one twice.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    experts: bool = True
    seed: int = 0
    expert_layout: str = "per_expert"
    rslora: bool = False
    expert_gate_up: str = "split"
    overrides: tuple[tuple[str, int, float], ...] | Mapping[str, tuple[int, float]] = ()

    def __post_init__(self) -> None:
        fn = "fnppo.lora.LoRAConfig"
        check_positive_int(fn, "rank", self.rank)
        if not (_number(self.alpha) and math.isfinite(self.alpha) and self.alpha > 0):
            raise input_error(fn, "alpha", "a finite number > 0", repr(self.alpha))
        if not (_number(self.dropout) and 0.0 <= self.dropout < 1.0):  # NaN fails the comparison
            raise input_error(fn, "dropout", "a number in [0, 1)", repr(self.dropout))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise input_error(fn, "seed", "an int", repr(self.seed))
        if not isinstance(self.experts, bool):
            raise input_error(fn, "experts", "a bool", repr(self.experts))
        targets = tuple(self.targets) if not isinstance(self.targets, str) else (self.targets,)
        if not targets or any(t not in TARGETS for t in targets):
            raise input_error(fn, "targets", f"a non-empty tuple of names from {TARGETS}", repr(self.targets))
        object.__setattr__(self, "targets", targets)
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise input_error(fn, "expert_layout", f"one of {EXPERT_LAYOUTS}", repr(self.expert_layout))
        if not isinstance(self.rslora, bool):
            raise input_error(fn, "rslora", "a bool", repr(self.rslora))
        if self.expert_gate_up not in GATE_UP_FORMS:
            raise input_error(fn, "expert_gate_up", f"one of {GATE_UP_FORMS}", repr(self.expert_gate_up))
        object.__setattr__(self, "overrides", _overrides(fn, self.overrides, targets))

    def rank_alpha(self, name: str) -> tuple[int, float]:
        """``(rank, alpha)`` of the linear ``name`` (1-rank name, experts without ``local_experts.<j>``)."""
        for n, r, a in self.overrides:
            if n == name:
                return r, a
        return self.rank, float(self.alpha)

    def scaling_for(self, rank: int, alpha: float) -> float:
        """``alpha / rank`` (``alpha / sqrt(rank)`` with ``rslora``)."""
        return float(alpha) / (math.sqrt(rank) if self.rslora else rank)

    @property
    def scaling(self) -> float:
        """The scaling of a linear without an override: ``alpha / rank`` (``alpha / sqrt(rank)`` with ``rslora``)."""
        return self.scaling_for(self.rank, self.alpha)


def _overrides(fn: str, value: Any, targets: tuple[str, ...]) -> tuple[tuple[str, int, float], ...]:
    """``LoRAConfig.overrides`` as sorted ``(name, rank, alpha)`` triples, each checked."""
    expected = "a dict name -> (rank, alpha) or (name, rank, alpha) triples"
    if isinstance(value, Mapping):
        items = [(k, *v) if isinstance(v, (tuple, list)) and len(v) == 2 else (k, v) for k, v in value.items()]
    elif isinstance(value, (tuple, list)):
        items = [tuple(t) if isinstance(t, (tuple, list)) else (t,) for t in value]
    else:
        raise input_error(fn, "overrides", expected, type(value).__name__)
    out = {}
    for item in items:
        if len(item) != 3:
            raise input_error(fn, "overrides", expected, repr(item))
        name, rank, alpha = item
        arg = f"overrides[{name!r}]"
        leaf = name.rpartition(".")[2] if isinstance(name, str) else None
        if leaf not in targets or not _OVERRIDE_NAME.match(name):
            raise input_error(
                fn,
                "overrides",
                f"names of linears 'decoder.layers.<i>.….<target>' with a target from {targets}",
                repr(name),
            )
        check_positive_int(fn, f"{arg}[0] (rank)", rank)
        if not (_number(alpha) and math.isfinite(alpha) and alpha > 0):
            raise input_error(fn, f"{arg}[1] (alpha)", "a finite number > 0", repr(alpha))
        if name in out:
            raise input_error(fn, "overrides", "each linear named once", f"{name!r} twice")
        out[name] = (name, rank, float(alpha))
    return tuple(out[n] for n in sorted(out))


def linear_name(core: nn.Module, name: str) -> str:
    """The name :attr:`LoRAConfig.overrides` knows the linear ``name`` of ``core`` by: its 1-rank name
    (:func:`fnppo.megatron.weights.global_name`) without an expert's ``local_experts.<j>``."""
    return _LOCAL_EXPERT.sub("", global_name(core, name))


def _parts(
    fn: str, name: str, module: nn.Module, leaf: str, role: str, fused: bool = False
) -> tuple[tuple[int, ...], int, bool]:
    """(rows per group of each part in this rank's shard, local groups, gated fc1) of a target
    (``fused``: a gated fc1's gate and up rows as one part)."""
    cfg = module.config
    tp = tp_size(module)
    out_local = module.weight.shape[0]
    if leaf == "linear_qkv":
        groups, heads, d = cfg.num_query_groups, cfg.num_attention_heads, cfg.kv_channels
        if groups % tp:
            raise input_error(fn, "model_chunks", f"query groups divisible by TP {tp} at {name}", str(groups))
        parts, local = (heads // groups * d, d, d), groups // tp
    elif leaf == "linear_fc1" and cfg.gated_linear_unit and fused:
        parts, local = (out_local,), 1
    elif leaf == "linear_fc1" and cfg.gated_linear_unit:
        parts, local = (out_local // 2, out_local // 2), 1
    else:
        parts, local = (out_local,), 1
    if role == "column" and local * sum(parts) != out_local:
        raise input_error(fn, "model_chunks", f"{name} with {local * sum(parts)} output rows", str(out_local))
    return parts, local, leaf == "linear_fc1" and bool(cfg.gated_linear_unit)


def _role(module: nn.Module) -> str | None:
    """``"column"`` / ``"row"`` for Megatron's (and Transformer Engine's) parallel linears, else None."""
    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    mode = getattr(module, "parallel_mode", None)  # Transformer Engine's linears (Megatron's TE wrappers)
    if type(module).__name__.startswith("TE") and mode in ("column", "row"):
        return mode
    return None


def _targets(fn: str, core: nn.Module, config: LoRAConfig) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, role)`` of every linear of ``core`` to adapt (role ``"stacked"``: stacked experts)."""
    found = []
    for name, module in core.named_modules():
        if is_stacked(module) and config.experts and {"linear_fc1", "linear_fc2"} & set(config.targets):
            check_stacked(fn, name, module)
            found.append((name, module, "stacked"))
            continue
        leaf = name.rpartition(".")[2]
        if leaf not in config.targets:
            continue
        expert = ".experts." in f".{name}."
        if expert and not config.experts:
            continue
        kind = type(core.get_submodule(name[: name.index(".experts.") + 8])).__name__ if expert else ""
        if expert and kind != "SequentialMLP":
            raise input_error(
                fn,
                "model_chunks",
                "experts built with moe_experts='stacked' or 'sequential' for adapters in experts",
                f"{kind} at {name}",
            )
        if expert and config.expert_layout == "shared":
            raise input_error(
                fn,
                "config.expert_layout",
                "'per_expert' on SequentialMLP experts (the shared layout needs moe_experts='stacked')",
                repr(config.expert_layout),
            )
        role = _role(module)
        if role is None:
            raise input_error(
                fn,
                "model_chunks",
                "Megatron's column/row-parallel linears at the targets (experts: SequentialMLP)",
                f"{type(module).__name__} at {name}",
            )
        if expert and tp_size(module) > 1:
            raise input_error(
                fn,
                "model_chunks",
                f"expert_tensor_parallel_size (etp) 1 for adapters in experts at {name}",
                f"etp={tp_size(module)}",
            )
        if getattr(module, "weight", None) is None or module.weight.dim() != 2:
            raise input_error(fn, "model_chunks", f"a 2-D weight at {name}", type(module).__name__)
        found.append((name, module, role))
    return found


def _init_a(core: nn.Module, name: str, param: Tensor, seed: int) -> Tensor:
    """This rank's shard of ``A``, uniform in ``±1/sqrt(in)`` from the generator of ``(seed, full name)``."""
    gname = global_name(core, name)
    tp = tp_of(param, current_layout())
    shape = full_shape(param, tp[0])
    g = torch.Generator().manual_seed(name_seed(seed, gname))
    bound = 1.0 / math.sqrt(shape[1])
    full = (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * bound
    return shard_of(core, name, param, full, *tp)


def _add_adapter(core: nn.Module, name: str, module: nn.Module, role: str, config: LoRAConfig) -> None:
    fused = config.expert_gate_up == "fused" and ".experts." in f".{name}."
    parts, groups, gated = _parts(_FN, name, module, name.rpartition(".")[2], role, fused)
    base = module.weight
    out, inp = base.shape
    r, alpha = config.rank_alpha(linear_name(core, name))
    kw = dict(dtype=base.dtype, device=base.device)
    a = nn.Parameter(torch.zeros((len(parts) * r, inp), **kw))
    b = nn.Parameter(torch.zeros((out, r), **kw))
    tp = tp_size(module)
    sp = (
        bool(getattr(module, "sequence_parallel", False))
        and tp > 1
        and not getattr(module, "explicit_expert_comm", False)
    )
    split, whole = (b, a) if role == "column" else (a, b)
    for p in (a, b):
        p.fnppo_lora_adapter = True
        p.allreduce = getattr(base, "allreduce", True)
        p.tensor_model_parallel = p is split and tp > 1
        p.partition_dim = 0 if role == "column" else 1
        p.partition_stride = 1
    if sp:  # its gradient comes from this rank's tokens only: summed over TP by Megatron's finalize
        whole.sequence_parallel = True
    module.register_parameter("lora_A", a)
    module.register_parameter("lora_B", b)
    module.fnppo_lora = AdapterSpec(
        role=role,
        rank=r,
        parts=parts,
        groups=groups,
        scaling=config.scaling_for(r, alpha),
        dropout=float(config.dropout),
        gated=gated,
        norm=hasattr(module, "layer_norm_weight"),
    )
    module.__class__ = lora_class(type(module))
    with torch.no_grad():
        a.copy_(_init_a(core, f"{name}.lora_A", a, config.seed).to(a.dtype))


def _check_overrides(config: LoRAConfig, plans: list[tuple[nn.Module, list[tuple[str, nn.Module, str]]]]) -> None:
    """Refuse an override that names no adapted linear (checked where its layer lives: each pipeline
    stage checks its own layers; a layer index past the model's on every rank)."""
    if not config.overrides:
        return
    adapted, local, layers = set(), set(), 0
    for core, found in plans:
        layers = core.config.num_layers
        for name, _ in core.named_modules():
            if _LAYER.search(name) and name.rpartition(".")[2].isdigit():
                local.add(int(_LAYER.search(global_name(core, name + ".x")).group(1)))
        for name, _, role in found:
            if role != "stacked":
                adapted.add(linear_name(core, name))
                continue
            for proj in ("linear_fc1", "linear_fc2"):
                if proj in config.targets:
                    adapted.add(f"{linear_name(core, name)}.{proj}")
    for name, _, _ in config.overrides:
        layer = int(_LAYER.search(name).group(1))
        if name not in adapted and (layer in local or layer >= layers):
            raise input_error(
                _FN,
                "config.overrides",
                "names of linears the config adapts in this model",
                f"{name!r} (no such linear)",
            )


def apply_lora(model_chunks: Sequence[nn.Module], config: LoRAConfig) -> list[nn.Module]:
    """Put LoRA adapters on built model chunks; freeze and tag every other parameter.

    Call after :func:`fnppo.build_gpt` (and after loading base weights, or before: the full-weight
    and Hugging Face loaders read and write the base weights only) and before :func:`fnppo.wrap_ddp`.
    Every linear named in ``config.targets`` (inside MoE experts too with ``config.experts``) gets
    ``lora_A`` and ``lora_B`` (:mod:`fnppo.megatron.lora_linear`: sharded like its weight under
    tensor parallelism, with Megatron's ``tensor_model_parallel`` / ``partition_dim`` /
    ``sequence_parallel`` / ``allreduce`` attributes so DDP, the optimizer and the finalize treat
    them right); ``A`` is initialized layout-invariantly (see :class:`LoRAConfig`), ``B`` to zero.
    All other parameters get ``requires_grad=False`` and ``fnppo_lora_base = True``.

    Returns:
        The same chunks (their modules changed in place), ready for :func:`fnppo.wrap_ddp`.

    Raises:
        InputError: DDP-wrapped chunks, chunks that already carry adapters, a target that is not a
            Megatron column/row-parallel linear (e.g. grouped or stacked experts), adapters in
            experts under expert tensor parallelism > 1, no linear matched.
    """
    if not isinstance(model_chunks, (list, tuple)) or not all(isinstance(c, nn.Module) for c in model_chunks):
        received = type(model_chunks).__name__
        if isinstance(model_chunks, (list, tuple)):
            received = f"a {received} of {sorted({type(c).__name__ for c in model_chunks})}"
        raise input_error(_FN, "model_chunks", "a list of model chunks (nn.Module, from fnppo.build_gpt)", received)
    if not isinstance(config, LoRAConfig):
        raise input_error(_FN, "config", "a fnppo.lora.LoRAConfig", type(config).__name__)
    chunks = list(model_chunks)
    if any(isinstance(c, DistributedDataParallel) for c in chunks):
        raise input_error(_FN, "model_chunks", "chunks before fnppo.wrap_ddp", "DistributedDataParallel chunks")
    if any(is_adapter(p) for c in chunks for p in c.parameters()):
        raise input_error(_FN, "model_chunks", "chunks without adapters", "chunks that already carry adapters")
    plans = [(unwrap_model(c), _targets(_FN, unwrap_model(c), config)) for c in chunks]
    if not any(found for _, found in plans):
        raise input_error(_FN, "config.targets", "names of linears of the model", repr(config.targets))
    _check_overrides(config, plans)
    for core, found in plans:
        for p in core.parameters():
            p.requires_grad_(False)
            p.fnppo_lora_base = True
        for name, module, role in found:
            if role == "stacked":
                add_stacked_adapters(core, name, module, config)
            else:
                _add_adapter(core, name, module, role, config)
        core.fnppo_lora_config = config
    return chunks


def lora_config_of(model_chunks: Sequence[nn.Module]) -> LoRAConfig | None:
    """The :class:`LoRAConfig` the chunks were adapted with, or None."""
    return getattr(unwrap_model(model_chunks[0]), "fnppo_lora_config", None)


def adapter_names(model_chunks: Sequence[nn.Module]) -> list[list[str]]:
    """Per chunk, the names (of the unwrapped model) of its adapter tensors."""
    return [[n for n, p in unwrap_model(c).named_parameters() if is_adapter(p)] for c in model_chunks]


def adapters_off(model_chunks: Sequence[nn.Module]) -> list[dict[str, Tensor]]:
    """A parameter set that switches every adapter off: per chunk, each ``lora_B`` as zeros.

    Pass it as ``params=`` to ``compute_logprobs`` (or ``forward_logits``): the same modules then
    compute the base model, the reference policy of the KL term without a second model. The zeros
    are one expanded scalar per tensor (no memory the size of ``B``); the adapter's term is then
    exactly zero, so the result equals the base model's bit for bit.
    """
    return [
        {
            n: torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
            for n, p in unwrap_model(c).named_parameters()
            if is_adapter(p) and n.endswith("lora_B")
        }
        for c in model_chunks
    ]


def snapshot_adapters(model_chunks: Sequence[nn.Module]) -> list[dict[str, Tensor]]:
    """Detached copies of every chunk's adapter tensors (names of the unwrapped model): a parameter
    set (``params=``) that evaluates the model with these adapters later."""
    return [
        {n: p.detach().clone() for n, p in unwrap_model(c).named_parameters() if is_adapter(p)} for c in model_chunks
    ]
