"""A :class:`~fnppo.megatron.config.ModelConfig` in Megatron's terms: ``TransformerConfig`` for a layout.

:func:`transformer_config` maps a :class:`~fnppo.megatron.config.ModelConfig` and a
:class:`~fnppo.megatron.parallel.ParallelLayout` to Megatron's ``TransformerConfig``: sizes and
numerics, the parallel layout, the MoE fields (:func:`_moe_kwargs`), the fused kernels
(:func:`fusion_fields`), FP8 (:func:`fp8_fields`), the experts module (:func:`moe_experts_choice`),
and the checks Megatron would only fail on later (divisibility by the layout, selective
recomputation without Transformer Engine, the layouts the batch-invariant mode cannot hold on).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer import TransformerConfig

from fnppo.core.errors import input_error
from fnppo.megatron.config import ModelConfig
from fnppo.megatron.layer_specs import default_experts, te_available
from fnppo.megatron.numerics import choose_kernels, fusions_default, invariant_experts, mark_config
from fnppo.megatron.parallel import ParallelLayout, current_layout
from fnppo.megatron.patches import patch_fused_rope

__all__ = ["transformer_config", "fusion_fields", "fp8_fields", "moe_experts_choice"]


def fusion_fields(cfg: ModelConfig, layout: ParallelLayout) -> dict[str, bool]:
    """The ``TransformerConfig`` fusion switches for ``cfg`` on ``layout``.

    With ``cfg.fusions`` (None: whether the model is built for CUDA, i.e. CUDA is present and the
    backend is NCCL): ``bias_activation_fusion`` (SwiGLU, or GeLU with a bias, as one compiled
    kernel that saves only its input for backward), ``bias_dropout_fusion`` (bias + dropout +
    residual add in one kernel) and ``apply_rope_fusion`` (RoPE in one kernel: Transformer
    Engine's when installed, else :func:`fnppo.core.ops.rope.apply_rotary`, installed by
    :func:`fnppo.megatron.patches.patch_fused_rope`). Megatron compiles the first two with ``torch.compile``.
    Always off: ``masked_softmax_fusion`` and ``persist_layer_norm`` (Apex or Megatron's own CUDA
    extensions; fnppo's packed attention has no masked softmax) and ``gradient_accumulation_fusion``
    (the output layer, a ``ColumnParallelLinear``, needs Apex's ``fused_weight_gradient_mlp_cuda``
    for it).
    """
    default = fusions_default(_kernels(cfg, layout), cuda=_on_cuda(layout))
    on = cfg.fusions if cfg.fusions is not None else default
    return dict(
        bias_activation_fusion=bool(on and (cfg.swiglu or cfg.add_bias_linear)),
        bias_dropout_fusion=bool(on),
        apply_rope_fusion=bool(on and cfg.position_embedding_type == "rope"),
    )


def transformer_config(cfg: ModelConfig, layout: ParallelLayout | None = None, **overrides: Any):
    """Megatron ``TransformerConfig`` for ``cfg`` under ``layout``.

    ``variable_seq_lengths`` is on, so pipeline stages exchange the shape of every micro-batch
    (packed micro-batches differ in length); fnppo's steps run the interleaved schedule (``vpp``)
    without it, on micro-batches of one shape (``fnppo.steps.schedule.run_schedule`` says why).
    Fusions: :func:`fusion_fields` (on where the model is
    built for CUDA unless ``cfg.fusions`` is False; off on CPU).
    """
    layout = layout or current_layout()
    _check_divisible(cfg, layout)
    groups = cfg.num_query_groups or cfg.num_attention_heads
    dtype = cfg.torch_dtype
    kwargs: dict[str, Any] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.kv_channels,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.layernorm_epsilon,
        gated_linear_unit=cfg.swiglu,
        activation_func=torch.nn.functional.silu if cfg.swiglu else torch.nn.functional.gelu,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        init_method_std=cfg.init_method_std,
        attention_dropout=cfg.attention_dropout,
        hidden_dropout=cfg.hidden_dropout,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available() or layout.backend == "gloo",
        variable_seq_lengths=True,  # off while fnppo runs the interleaved schedule (see step._run_schedule)
        moe_token_dispatcher_type="alltoall",
        cuda_graph_scope=[],  # the default ("full") is deprecated and warns on every build
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **fusion_fields(cfg, layout),
        deterministic_mode=cfg.deterministic,
        deallocate_pipeline_outputs=layout.backend != "gloo",
        # gloo mismatches concurrent batched p2p messages between the same pair of ranks
        # (seen with the interleaved schedule: later micro-batches got wrong activations).
        batch_p2p_comm=layout.backend != "gloo",
    )
    kwargs.update(expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)
    if cfg.num_experts is not None:
        kwargs.update(_moe_kwargs(cfg, layout))
    kwargs.update(_fp8_kwargs(cfg, layout))
    kwargs.update(dict(cfg.extra))
    kwargs.update(overrides)
    _check_recompute_modules(kwargs)
    if kwargs.get("apply_rope_fusion"):
        patch_fused_rope()  # Megatron checks for a fused RoPE when the config is built
    kernels = _kernels(cfg, layout)  # the batch-invariant mode's record, chosen once (fnppo.megatron.numerics)
    tc = TransformerConfig(**kwargs)
    mark_config(tc, kernels)
    return tc


def _check_divisible(cfg: ModelConfig, layout: ParallelLayout) -> None:
    """Refuse sizes that the layout does not divide (Megatron would only fail on them later)."""
    groups = cfg.num_query_groups or cfg.num_attention_heads
    for name, n in (("num_attention_heads", cfg.num_attention_heads), ("num_query_groups", groups)):
        if n % layout.tp:
            raise input_error("transformer_config", name, f"a multiple of tp={layout.tp}", repr(n))
    if cfg.padded_vocab_size % layout.tp:
        raise input_error(
            "transformer_config",
            "vocab_size",
            f"a multiple of tp={layout.tp} (set make_vocab_size_divisible_by)",
            repr(cfg.vocab_size),
        )
    if layout.tp > 1 and cfg.padded_vocab_size // layout.tp >= cfg.vocab_size:
        raise input_error(
            "transformer_config",
            "make_vocab_size_divisible_by",
            f"a padding that leaves real tokens on more than one of tp={layout.tp} ranks (padded vocabulary "
            f"{cfg.padded_vocab_size} / tp >= vocab_size {cfg.vocab_size}; lower it)",
            repr(cfg.make_vocab_size_divisible_by),
        )
    if cfg.num_layers % (layout.pp * (layout.vpp or 1)):
        raise input_error(
            "transformer_config",
            "num_layers",
            f"a multiple of pp*vpp={layout.pp}*{layout.vpp or 1}",
            repr(cfg.num_layers),
        )


# Megatron-core 0.16's output-discarding checkpoint (``CheckpointWithoutOutput``) takes its FP8 path
# whatever the precision (``self.fp8 = fp8 is not None`` with ``fp8=False``) and needs Transformer
# Engine there: these selective-recomputation modules fail at the first forward without it.
_TE_ONLY_RECOMPUTE = ("layernorm", "moe_act", "mla_up_proj")


def _check_recompute_modules(kwargs: dict[str, Any]) -> None:
    """Refuse, at build time, selective recomputation that Megatron cannot run without Transformer Engine."""
    if kwargs.get("recompute_granularity") != "selective":
        return
    bad = [m for m in kwargs.get("recompute_modules") or () if m in _TE_ONLY_RECOMPUTE]
    if bad and not te_available():
        raise input_error(
            "transformer_config",
            "recompute_modules",
            "modules that run without Transformer Engine (e.g. 'mlp', 'core_attn', 'moe', 'shared_experts'; "
            f"Megatron's {', '.join(repr(m) for m in _TE_ONLY_RECOMPUTE)} need it)",
            repr(list(kwargs["recompute_modules"])),
        )


def _moe_kwargs(cfg: ModelConfig, layout: ParallelLayout) -> dict[str, Any]:
    """Megatron ``TransformerConfig`` fields of ``cfg``'s MoE settings (no token dropping)."""
    if cfg.num_experts % layout.ep:
        raise input_error("transformer_config", "num_experts", f"a multiple of ep={layout.ep}", repr(cfg.num_experts))
    extra: dict[str, Any] = {}
    if cfg.moe_dispatcher == "allgather":
        # Megatron's allgather dispatcher refuses variable_seq_lengths, which fnppo needs only to
        # exchange per-micro-batch shapes between pipeline stages.
        if layout.pp > 1:
            raise input_error(
                "transformer_config", "moe_dispatcher", "'alltoall' under pipeline parallelism (pp > 1)", "'allgather'"
            )
        extra["variable_seq_lengths"] = False
    return dict(
        extra,
        num_moe_experts=cfg.num_experts,
        moe_layer_freq=list(cfg.moe_layer_freq) if isinstance(cfg.moe_layer_freq, tuple) else cfg.moe_layer_freq,
        moe_router_topk=cfg.moe_topk,
        moe_router_pre_softmax=cfg.moe_pre_softmax,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_size,
        moe_shared_expert_gate=cfg.moe_shared_expert_gate,
        # every router gets its own replay slot (fnppo.megatron.routing); inactive unless a step sets it
        moe_enable_routing_replay=True,
        moe_router_load_balancing_type=cfg.moe_load_balancing,
        moe_aux_loss_coeff=float(cfg.moe_aux_loss_coeff),
        moe_z_loss_coeff=cfg.moe_z_loss_coeff,
        moe_router_score_function=cfg.moe_score_function,
        moe_router_dtype=cfg.moe_router_dtype,
        moe_router_enable_expert_bias=cfg.moe_expert_bias,
        moe_router_bias_update_rate=float(cfg.moe_bias_update_rate),
        moe_token_dispatcher_type=cfg.moe_dispatcher,
        moe_grouped_gemm=moe_experts_choice(cfg, layout) == "te_grouped",
        # Transformer Engine's fused token (un)permutation: fewer kernels and no host syncs
        # (measured on an H200: BENCHMARKS.md, the MoE step); CUDA models only.
        moe_permute_fusion=_on_cuda(layout) and te_available(),
        moe_expert_capacity_factor=None,
    )


def moe_experts_choice(cfg: ModelConfig, layout: ParallelLayout) -> str:
    """The experts module of ``cfg`` on ``layout`` (``cfg.moe_experts``; None: ``"stacked"`` for a
    CUDA model without FP8, ``"te_grouped"`` with FP8, ``"sequential"`` on CPU)."""
    kernels = _kernels(cfg, layout)
    invariant = None if kernels is None else invariant_experts(kernels)
    if cfg.moe_experts is not None:
        if cfg.moe_experts == "te_grouped" and not te_available():
            raise input_error(
                "transformer_config",
                "moe_experts",
                "'stacked' or 'sequential' (Transformer Engine is not installed)",
                "'te_grouped'",
            )
        if invariant is not None and cfg.moe_experts != invariant:
            raise input_error(
                "transformer_config",
                "moe_experts",
                f"{invariant!r} or None with batch_invariant and the {kernels.name!r} kernels "
                "(the experts' products must give a token the same bits whatever the other tokens)",
                repr(cfg.moe_experts),
            )
        if cfg.fp8 is not None and cfg.moe_experts != "te_grouped":
            raise input_error(
                "transformer_config", "moe_experts", "'te_grouped' (or None) with fp8 set", repr(cfg.moe_experts)
            )
        return cfg.moe_experts
    return invariant or default_experts(fp8=cfg.fp8 is not None, cuda=_on_cuda(layout))


def _kernels(cfg: ModelConfig, layout: ParallelLayout) -> Any:
    """The batch-invariant mode's record for ``cfg`` on ``layout`` (None outside the mode), the layouts it
    cannot hold on refused (:func:`fnppo.megatron.numerics.choose_kernels`)."""
    return choose_kernels(cfg.batch_invariant, layout, cuda=_on_cuda(layout))


def _on_cuda(layout: ParallelLayout) -> bool:
    return torch.cuda.is_available() and layout.backend == "nccl"


def fp8_fields(cfg: ModelConfig) -> dict[str, Any]:
    """``TransformerConfig``'s FP8 fields for ``cfg.fp8`` (none when it is None); FP8 weight
    gradients too (``fp8_wgrad``), the output layer stays in bf16 (it is not a Transformer Engine
    module)."""
    if cfg.fp8 is None:
        return {}
    return dict(fp8=cfg.fp8, fp8_recipe=cfg.fp8_recipe, fp8_wgrad=True)


def _fp8_kwargs(cfg: ModelConfig, layout: ParallelLayout) -> dict[str, Any]:
    """:func:`fp8_fields`, refused on CPU and without Transformer Engine."""
    if cfg.fp8 is None:
        return {}
    if not _on_cuda(layout):
        raise input_error(
            "transformer_config", "fp8", "None on CPU (FP8 GEMMs need a CUDA GPU, Hopper or newer)", repr(cfg.fp8)
        )
    if not te_available():
        raise input_error(
            "transformer_config", "fp8", "None without Transformer Engine (it runs the FP8 GEMMs)", repr(cfg.fp8)
        )
    return fp8_fields(cfg)
