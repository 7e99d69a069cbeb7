"""Building models and their training wrappers: ``build_gpt``, ``wrap_ddp``, ``build_optimizer``.

:func:`build_gpt` builds this rank's chunks of a Megatron ``GPTModel`` (or of the value model of
:mod:`fnppo.megatron.value`) from a :class:`~fnppo.megatron.config.ModelConfig`;
:func:`wrap_ddp` wraps them in Megatron's ``DistributedDataParallel`` and :func:`build_optimizer`
builds Megatron's optimizer over them. Everything here is a function of its arguments; Megatron's
parallel state is read through :func:`fnppo.megatron.parallel.current_layout`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import transformer_block as tb
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.moe.router_replay import RouterReplay
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import BaseTransformerLayer
from torch import nn

from fnppo.core.errors import input_error
from fnppo.core.typing import Tensor
from fnppo.megatron.config import ModelConfig
from fnppo.megatron.layer_specs import choose_layer_spec
from fnppo.megatron.megatron_config import moe_experts_choice, transformer_config
from fnppo.megatron.norms import SequenceParallelNorm
from fnppo.megatron.numerics import invariant_layer_spec, prepare_model
from fnppo.megatron.parallel import ParallelLayout, current_layout
from fnppo.megatron.patches import (
    patch_grad_clip_l2_norm,
    patch_moe_dispatch_numpy,
    patch_moe_router_gemm,
)
from fnppo.megatron.routing import replay_slot
from fnppo.megatron.unwrap import HEADS, unwrap_model
from fnppo.megatron.value import GPTValueModel

__all__ = ["build_gpt", "wrap_ddp", "build_optimizer"]


def build_gpt(
    cfg: ModelConfig,
    *,
    head: str = "lm",
    layer_spec: Any = None,
    layout: ParallelLayout | None = None,
    **config_overrides: Any,
) -> list[nn.Module]:
    """Build this rank's model chunks (one per virtual pipeline stage) of a Megatron ``GPTModel``.

    ``head="lm"``: a ``GPTModel`` (logits, :func:`fnppo.megatron.forward.forward_logits`).
    ``head="value"``: the critic of
    PPO, a :class:`fnppo.megatron.value.GPTValueModel` with the same trunk and a scalar head per token on the
    last stage instead of the vocabulary output layer (values, :func:`fnppo.megatron.forward.forward_values`); it never
    ties its embedding (``cfg.tie_embeddings`` is ignored), and its fresh head can sit on an actor's
    or a Hugging Face policy's trunk (:func:`fnppo.megatron.weights.load_full_weights` with ``fresh_head=True``,
    :func:`fnppo.io.hf.load_hf_weights`), or trunk and head come from a Hugging Face value or reward
    model (``*ForTokenClassification`` / ``*ForSequenceClassification``, ``num_labels=1``).

    ``layer_spec`` defaults to :func:`fnppo.megatron.layer_specs.choose_layer_spec`: Transformer Engine's
    spec when installed,
    else the local spec with packed-sequence attention, and the local spec under context
    parallelism; pass ``layer_spec=fnppo.models.local_layer_spec(cfg)`` or
    ``layer_spec=fnppo.models.default_layer_spec(cfg)`` to force either. With MoE layers ``layer_spec`` is the
    spec of the MoE layers, and dense layers
    (``moe_layer_freq``) get the default dense spec. Every router's replay slot is its own
    (``fnppo.megatron.routing``): it is taken off Megatron's global list of replay instances, so models built
    earlier never see a later replay. Half-precision models are
    wrapped in ``Float16Module``. Returns unwrapped-by-DDP chunks; see :func:`wrap_ddp`. Each
    ``GPTModel`` keeps ``cfg`` as ``fnppo_config`` (its ``vocab_size`` is the real vocabulary; the
    model's own ``vocab_size`` is the padded one).

    Raises:
        InputError: an unknown ``head``; the configuration errors of :func:`transformer_config`; with
            ``batch_invariant`` and context parallelism, a ``layer_spec`` whose core attention is not
            fnppo's ``PackedDotProductAttention`` (Transformer Engine's spec).
    """
    if head not in HEADS:
        raise input_error("fnppo.build_gpt", "head", f"one of {HEADS}", repr(head))
    model_class = GPTValueModel if head == "value" else GPTModel
    layout = layout or current_layout()
    tcfg = transformer_config(cfg, layout, **config_overrides)
    if tcfg.deterministic_mode:  # Transformer Engine's attention refuses deterministic_mode without it
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    dense_spec = None
    if cfg.num_experts is not None:
        patch_moe_router_gemm()
        patch_moe_dispatch_numpy()
        spec = (
            layer_spec
            if layer_spec is not None
            else choose_layer_spec(cfg, layout, moe_experts=moe_experts_choice(cfg, layout))
        )
        if len(cfg.moe_layers) < cfg.num_layers:
            dense_spec = choose_layer_spec(dataclasses.replace(cfg, num_experts=None), layout)
    else:
        spec = layer_spec if layer_spec is not None else choose_layer_spec(cfg, layout)
    # the batch-invariant mode's attention (and its checks of a given spec): fnppo.megatron.numerics
    spec = invariant_layer_spec(spec, tcfg)
    dense_spec = None if dense_spec is None else invariant_layer_spec(dense_spec, tcfg)
    chunks: list[nn.Module] = []
    stages = range(layout.vpp) if layout.vpp else [None]
    for vp in stages:
        pre, post = layout.holds_stage_ends(vp)
        model = model_class(
            config=tcfg,
            transformer_layer_spec=_block_spec(spec, tcfg, vp, dense_spec=dense_spec, moe_layers=cfg.moe_layers),
            vocab_size=cfg.padded_vocab_size,
            max_sequence_length=cfg.max_seq_len,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=cfg.tie_embeddings and head == "lm",
            position_embedding_type=cfg.position_embedding_type,
            rotary_percent=cfg.rotary_percent,
            rotary_base=int(cfg.rotary_base) if float(cfg.rotary_base).is_integer() else cfg.rotary_base,
            rope_scaling=cfg.rope_scaling,
            rope_scaling_factor=cfg.rope_scaling_factor,
            vp_stage=vp,
        )
        prepare_model(model)  # the mode's MoE routers
        model.fnppo_config = cfg  # what it was built for: real vocabulary (fnppo.steps.plan), rope (fnppo.io.hf)
        _own_replay_slots(model)
        if post and head == "lm":
            model.output_layer.register_forward_hook(_row_major_grad_hook)
        if cfg.moe_freeze_router:
            _freeze_routers(model)
        if tcfg.fp16 or tcfg.bf16:
            model = Float16Module(tcfg, model)
        if torch.cuda.is_available() and layout.backend == "nccl":
            model = model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


class _RowMajorGrad(torch.autograd.Function):
    """Identity whose backward hands the gradient on in row-major strides.

    ``GPTModel`` returns ``logits.transpose(0, 1)``, so the gradient reaching its output layer is
    ``[s, b, V]`` with the strides of a ``[b, s, V]`` tensor. A trainable output layer reshapes it to
    2-D; a frozen one (LoRA, a frozen embedding) computes ``grad_output.matmul(weight)``, and
    ``torch.matmul`` folds ``[s, b, V] @ [V, h]`` into one matrix product only when the strides
    allow it (``stride[0] == b * stride[1]``, checked even when ``b == 1``); otherwise it runs a
    batched product over the ``s`` tokens against the weight broadcast ``s`` times (0.69 s per
    8,192-token micro-batch at Qwen2.5-1.5B's vocabulary on an H200: a LoRA step took 3.8 s
    instead of 1.3 s, docs/lora.md). With ``b == 1`` the fix is a view (no copy); otherwise a
    row-major copy."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        if grad.dim() == 3 and grad.shape[1] == 1:
            return grad.squeeze(1).unsqueeze(1)
        return grad.contiguous()


def _row_major_grad_hook(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of the output layer: its logits through :class:`_RowMajorGrad`."""
    logits = output[0] if isinstance(output, tuple) else output
    if not (torch.is_tensor(logits) and logits.requires_grad):
        return None
    logits = _RowMajorGrad.apply(logits)
    return (logits, *output[1:]) if isinstance(output, tuple) else logits


def _own_replay_slots(model: nn.Module) -> None:
    """Give every router of ``model`` its own replay slot (:func:`fnppo.megatron.routing.replay_slot`) in place
    of the one Megatron put on its global list (which would keep every model ever built alive and
    let one replay reach every model)."""
    for m in model.modules():
        old = getattr(m, "router_replay", None)
        if old is not None:
            RouterReplay.global_router_replay_instances[:] = [
                r for r in RouterReplay.global_router_replay_instances if r is not old
            ]
            m.router_replay = replay_slot()


def _freeze_routers(model: nn.Module) -> None:
    """Router weights (and bias) get no gradient: DDP and the optimizer then leave them out."""
    for module in model.modules():
        if isinstance(module, Router):
            for p in module.parameters(recurse=False):
                p.requires_grad_(False)


def _block_spec(spec: Any, tcfg: Any, vp: int | None, *, dense_spec: Any = None, moe_layers: Sequence[int] = ()) -> Any:
    """``spec`` as Megatron's block submodules with a sequence-parallel final norm when it needs one.

    Megatron gives a block built from a layer spec its default final norm; without Transformer
    Engine or Apex that is ``WrappedTorchNorm``, which refuses sequence parallelism. Then the block
    gets :class:`fnppo.megatron.norms.SequenceParallelNorm` (the same norm) instead; otherwise ``spec``.
    With ``dense_spec`` (a model whose MoE layers are ``moe_layers`` only), the block's local layers
    (this stage's global layers, Megatron's ``get_transformer_layer_offset``) get ``spec`` where
    they are MoE layers and ``dense_spec`` elsewhere, as Megatron's ``get_gpt_decoder_block_spec``.
    """
    layer_spec = (
        isinstance(spec, ModuleSpec) and isinstance(spec.module, type) and issubclass(spec.module, BaseTransformerLayer)
    )
    sp_norm = tcfg.sequence_parallel and tb.LayerNormImpl is WrappedTorchNorm
    if not layer_spec or (dense_spec is None and not sp_norm):
        return spec
    layers = tb.get_num_layers_to_build(tcfg, vp_stage=vp)
    specs = [spec] * layers
    if dense_spec is not None:
        offset = tb.get_transformer_layer_offset(tcfg, vp_stage=vp)
        specs = [spec if offset + i in moe_layers else dense_spec for i in range(layers)]
    return tb.TransformerBlockSubmodules(
        layer_specs=specs, layer_norm=SequenceParallelNorm if sp_norm else tb.LayerNormImpl
    )


def wrap_ddp(
    chunks: Sequence[nn.Module],
    *,
    use_distributed_optimizer: bool = True,
    overlap_grad_reduce: bool = False,
    **ddp_kwargs: Any,
) -> list[nn.Module]:
    """Wrap model chunks in Megatron's ``DistributedDataParallel`` (fp32 grad buffers)."""
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=overlap_grad_reduce,
        **ddp_kwargs,
    )
    out = []
    for i, chunk in enumerate(chunks):
        out.append(
            DistributedDataParallel(
                unwrap_model(chunk).config,
                ddp_cfg,
                chunk,
                disable_bucketing=i > 0,
            )
        )
    return out


def build_optimizer(
    chunks: Sequence[nn.Module],
    *,
    optimizer: str = "adam",
    lr: float = 1e-5,
    weight_decay: float = 0.0,
    clip_grad: float = 1.0,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_eps: float = 1e-8,
    **kwargs: Any,
):
    """Megatron's optimizer (``"adam"`` or ``"sgd"``; distributed when the chunks' DDP config says so).

    ``clip_grad`` > 0 clips the global grad norm (Megatron's own clipping); 0 disables it. On CUDA
    without Transformer Engine or Apex, Megatron's fallback for the grad norm of the clipping reads
    every parameter's norm to the host (one device sync per tensor); it is replaced by
    :func:`fnppo.megatron.patches.l2_norm_without_syncs` (see there).
    """
    if torch.cuda.is_available() and current_layout().backend == "nccl":
        patch_grad_clip_l2_norm()

    core = unwrap_model(chunks[0])
    ddp_cfg = getattr(chunks[0], "ddp_config", None)
    ocfg = OptimizerConfig(
        optimizer=optimizer,
        lr=lr,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        bf16=core.config.bf16,
        fp16=core.config.fp16,
        params_dtype=core.config.params_dtype,
        use_distributed_optimizer=bool(ddp_cfg and ddp_cfg.use_distributed_optimizer),
        **kwargs,
    )
    return get_megatron_optimizer(ocfg, list(chunks))
