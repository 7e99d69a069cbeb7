"""Megatron models: config, build, DDP and optimizer, the forward stages and full weights.
Implementation: :mod:`fnppo.megatron`."""

from __future__ import annotations

from fnppo.core.kernels.invariant import sequence_attention as sequence_attention
from fnppo.core.ops.batch_invariant import batch_invariant as batch_invariant
from fnppo.megatron.build import build_gpt as build_gpt
from fnppo.megatron.build import build_optimizer as build_optimizer
from fnppo.megatron.build import wrap_ddp as wrap_ddp
from fnppo.megatron.config import InvariantKernels as InvariantKernels
from fnppo.megatron.config import ModelConfig as ModelConfig
from fnppo.megatron.core_attention import PackedDotProductAttention as PackedDotProductAttention
from fnppo.megatron.forward import forward_hidden as forward_hidden
from fnppo.megatron.forward import forward_logits as forward_logits
from fnppo.megatron.forward import forward_values as forward_values
from fnppo.megatron.forward import snapshot_params as snapshot_params
from fnppo.megatron.grads import FinalizeNotCalledError as FinalizeNotCalledError
from fnppo.megatron.grads import GradStats as GradStats
from fnppo.megatron.grads import finalize_grads as finalize_grads
from fnppo.megatron.grads import grad_norm as grad_norm
from fnppo.megatron.layer_specs import default_layer_spec as default_layer_spec
from fnppo.megatron.layer_specs import local_layer_spec as local_layer_spec
from fnppo.megatron.layer_specs import te_available as te_available
from fnppo.megatron.numerics import batch_invariant_numerics as batch_invariant_numerics
from fnppo.megatron.packed_attention import flex_compile_count as flex_compile_count
from fnppo.megatron.packed_attention import packed_causal_attention as packed_causal_attention
from fnppo.megatron.unwrap import unwrap_model as unwrap_model
from fnppo.megatron.weights import gather_full_weights as gather_full_weights
from fnppo.megatron.weights import layout_invariant_init as layout_invariant_init
from fnppo.megatron.weights import load_full_weights as load_full_weights

__all__ = [
    "ModelConfig",
    "InvariantKernels",
    "build_gpt",
    "wrap_ddp",
    "build_optimizer",
    "local_layer_spec",
    "default_layer_spec",
    "te_available",
    "forward_logits",
    "forward_values",
    "forward_hidden",
    "snapshot_params",
    "gather_full_weights",
    "load_full_weights",
    "layout_invariant_init",
    "unwrap_model",
    "finalize_grads",
    "grad_norm",
    "GradStats",
    "FinalizeNotCalledError",
    "PackedDotProductAttention",
    "packed_causal_attention",
    "flex_compile_count",
    "batch_invariant_numerics",
    "batch_invariant",
    "sequence_attention",
]
