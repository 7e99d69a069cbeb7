"""Layer specs: Megatron's GPT layer specs with fnppo's packed attention and sequence-parallel norms.

:func:`local_layer_spec` is Megatron's local spec with
:class:`fnppo.megatron.core_attention.PackedDotProductAttention` as core attention and
:class:`fnppo.megatron.norms.SequenceParallelNorm` as norms; :func:`default_layer_spec` is
Transformer Engine's spec where TE is installed (:func:`te_available`), else the local one;
:func:`choose_layer_spec` is the spec :func:`fnppo.megatron.build.build_gpt` builds when given none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from fnppo.core.errors import input_error
from fnppo.megatron.core_attention import PackedDotProductAttention
from fnppo.megatron.norms import SequenceParallelNorm
from fnppo.megatron.parallel import ParallelLayout
from fnppo.megatron.stacked_experts import StackedExperts

__all__ = ["te_available", "local_layer_spec", "default_layer_spec", "choose_layer_spec", "default_experts"]


def te_available() -> bool:
    """Whether Megatron found Transformer Engine (its own import check in the GPT layer specs)."""
    return bool(getattr(gpt_layer_specs, "HAVE_TE", False))


Normalization = Literal["LayerNorm", "RMSNorm"]

_SPEC_DEFAULTS: dict[str, Any] = {
    "qk_layernorm": False,
    "normalization": "LayerNorm",
    "num_experts": None,
    "moe_experts": None,
    "qk_l2_norm": False,
}
MoEExperts = Literal["stacked", "te_grouped", "sequential"]


def default_experts(*, fp8: bool, cuda: bool) -> str:
    """The experts module when none is asked for: ``"te_grouped"`` with FP8, else ``"stacked"`` on CUDA and
    ``"sequential"`` on CPU (a model in the batch-invariant mode takes its record's:
    :func:`fnppo.megatron.numerics.invariant_experts`)."""
    if fp8:
        return "te_grouped"
    return "stacked" if cuda else "sequential"


def _experts(config: Any, given: str | None) -> str:
    """The experts module: ``given``, else the config's ``moe_experts`` (a Megatron config's
    ``moe_grouped_gemm=True`` means ``"te_grouped"``), else :func:`default_experts` for the config
    where CUDA is present or not."""
    if given is None and getattr(config, "moe_grouped_gemm", None) is True:
        given = "te_grouped"
    if given is None:
        given = default_experts(fp8=bool(getattr(config, "fp8", None)), cuda=torch.cuda.is_available())
    if given not in ("stacked", "te_grouped", "sequential"):
        raise input_error(
            "fnppo.models.default_layer_spec", "moe_experts", "'stacked', 'te_grouped' or 'sequential'", repr(given)
        )
    return given


def _with_experts(spec: ModuleSpec, experts: str) -> ModuleSpec:
    """``spec`` (an MoE layer's) with :class:`~fnppo.megatron.stacked_experts.StackedExperts` as its
    experts module when ``experts == "stacked"``."""
    if experts != "stacked":
        return spec
    mlp = spec.submodules.mlp
    if not dataclasses.is_dataclass(getattr(mlp, "submodules", None)):
        return spec
    if not hasattr(mlp.submodules, "experts"):
        return spec
    new_mlp = dataclasses.replace(
        mlp, submodules=dataclasses.replace(mlp.submodules, experts=ModuleSpec(module=StackedExperts))
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=new_mlp))


def _spec_options(config: Any, **explicit: Any) -> dict[str, Any]:
    """Explicit keyword > attribute of ``config`` (a model config) > default, per option."""
    out = {}
    for name, default in _SPEC_DEFAULTS.items():
        value = explicit.get(name)
        if value is None and config is not None:
            # TransformerConfig calls the expert count num_moe_experts.
            for attr in (name, "num_moe_experts") if name == "num_experts" else (name,):
                value = getattr(config, attr, None)
                if value is not None:
                    break
        out[name] = default if value is None else value
    return out


def local_layer_spec(
    config: Any = None,
    *,
    packed_attention: bool = True,
    qk_layernorm: bool | None = None,
    normalization: Normalization | None = None,
    num_experts: int | None = None,
    moe_experts: MoEExperts | None = None,
    qk_l2_norm: bool | None = None,
) -> ModuleSpec:
    """Megatron's ``get_gpt_layer_local_spec(...)`` with :class:`PackedDotProductAttention` as core attention.

    Options left ``None`` are read from ``config`` (any object with attributes of those names, e.g.
    a ``TransformerConfig`` or :class:`fnppo.megatron.config.ModelConfig`), else Megatron's defaults
    (``normalization="LayerNorm"``, no qk norm, dense MLP). ``normalization`` must match the model
    config's. A new spec is built (Megatron's is not modified); its norms are
    :class:`fnppo.megatron.norms.SequenceParallelNorm` (Megatron's torch norms, usable with sequence
    parallelism). ``packed_attention=False`` keeps Megatron's local core attention. Multi-latent
    attention is not offered.
    """
    fn = "fnppo.megatron.layer_specs.local_layer_spec"
    opts = _spec_options(
        config,
        qk_layernorm=qk_layernorm,
        normalization=normalization,
        num_experts=num_experts,
        moe_experts=moe_experts,
        qk_l2_norm=qk_l2_norm,
    )
    experts = _experts(config, opts["moe_experts"])
    if opts["normalization"] not in ("LayerNorm", "RMSNorm"):
        raise input_error(fn, "normalization", "'LayerNorm' or 'RMSNorm'", repr(opts["normalization"]))
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=opts["num_experts"],
        moe_grouped_gemm=experts == "te_grouped",
        qk_layernorm=bool(opts["qk_layernorm"]),
        normalization=opts["normalization"],
        qk_l2_norm=bool(opts["qk_l2_norm"]),
    )
    spec = _with_experts(_with_sequence_parallel_norms(spec), experts)
    if not packed_attention:
        return spec
    attn = spec.submodules.self_attention
    if attn.submodules.core_attention is not DotProductAttention:
        raise input_error(
            fn,
            "packed_attention",
            "a local spec whose core attention is DotProductAttention",
            repr(attn.submodules.core_attention),
        )
    new_attn = dataclasses.replace(
        attn,
        params=dict(attn.params),
        submodules=dataclasses.replace(attn.submodules, core_attention=PackedDotProductAttention),
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=new_attn))


def _with_sequence_parallel_norms(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` with Megatron's ``WrappedTorchNorm`` replaced by :class:`fnppo.megatron.norms.SequenceParallelNorm`
    (the same torch norms, usable with ``sequence_parallel=True``)."""

    def swap(sub: Any) -> Any:
        if not dataclasses.is_dataclass(sub):
            return sub
        changes = {
            f.name: SequenceParallelNorm for f in dataclasses.fields(sub) if getattr(sub, f.name) is WrappedTorchNorm
        }
        attn = getattr(sub, "self_attention", None)
        if isinstance(attn, ModuleSpec) and dataclasses.is_dataclass(attn.submodules):
            changes["self_attention"] = dataclasses.replace(
                attn, params=dict(attn.params), submodules=swap(attn.submodules)
            )
        return dataclasses.replace(sub, **changes) if changes else sub

    return dataclasses.replace(spec, submodules=swap(spec.submodules))


def default_layer_spec(
    config: Any = None,
    *,
    qk_layernorm: bool | None = None,
    normalization: Normalization | None = None,
    num_experts: int | None = None,
    moe_experts: MoEExperts | None = None,
    qk_l2_norm: bool | None = None,
) -> ModuleSpec:
    """Transformer Engine's GPT layer spec when TE is installed, else :func:`local_layer_spec`.

    Both take packed (THD) micro-batches. Options as in :func:`local_layer_spec`; with TE the norm
    follows the model config's ``normalization`` (TE's norm module reads it). ``moe_experts``
    (MoE models): ``"stacked"``, ``"te_grouped"`` or ``"sequential"``, see
    :class:`fnppo.megatron.config.ModelConfig`; None reads the config's, else chooses as
    :func:`fnppo.megatron.megatron_config.moe_experts_choice` does without a layout (CUDA present or not).
    """
    opts = _spec_options(
        config,
        qk_layernorm=qk_layernorm,
        normalization=normalization,
        num_experts=num_experts,
        moe_experts=moe_experts,
        qk_l2_norm=qk_l2_norm,
    )
    experts = _experts(config, opts["moe_experts"])
    if te_available():
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=opts["num_experts"],
            moe_grouped_gemm=experts == "te_grouped",
            qk_layernorm=bool(opts["qk_layernorm"]),
            qk_l2_norm=bool(opts["qk_l2_norm"]),
        )
        return _with_experts(spec, experts)
    return local_layer_spec(packed_attention=True, **dict(opts, moe_experts=experts))


def choose_layer_spec(cfg: Any, layout: ParallelLayout, **options: Any):
    """The layer spec :func:`fnppo.megatron.build.build_gpt` builds when it is given none.

    :func:`fnppo.megatron.layer_specs.default_layer_spec` (Transformer Engine's spec where TE is installed,
    else the local spec), except under context parallelism (``layout.cp > 1``): there the local
    spec, whose packed attention computes exact document-causal attention across the CP group
    (:func:`fnppo.core.batching.context_parallel.context_parallel_attention`, tested against one process).
    Megatron's own CP inside Transformer Engine's attention stays selectable with
    ``layer_spec=fnppo.models.default_layer_spec(cfg)``; its agreement with fnppo's CP has not been
    measured (it needs two GPUs).
    """
    if layout.cp > 1:
        return local_layer_spec(cfg, **options)
    return default_layer_spec(cfg, **options)
