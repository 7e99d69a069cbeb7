"""fnppo: functional, shape-checked PPO/GRPO training steps for Megatron-core models.

The public API is :data:`__all__`. Stages (pure functions): ``collate_microbatch``,
``forward_logits``, ``logprob_and_entropy``, ``ppo_loss``, ``finalize_grads``; composed by
``train_step`` / ``compute_logprobs`` (and, for a critic, ``forward_values`` and ``value_loss``
composed by ``critic_step`` / ``compute_values``) inside Megatron's own pipeline schedule.

The pure-torch core (losses, advantages, log-probs, batching, metrics, type checks) is imported
with the package and needs no Megatron. Everything that touches Megatron (attention, model, step,
grads, checkpoint, hf, parallel, testing) is imported on first use of one of its names, so
``import fnppo`` and ``from fnppo.loss import ppo_loss`` work without megatron-core installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from fnppo.quiet import install_warning_filters as _install_warning_filters

_install_warning_filters()  # before Megatron is imported: see fnppo/quiet.py for the list

from fnppo.advantages import broadcast_to_tokens as broadcast_to_tokens
from fnppo.advantages import gae_advantages as gae_advantages
from fnppo.advantages import grpo_advantages as grpo_advantages
from fnppo.advantages import reinforce_pp_advantages as reinforce_pp_advantages
from fnppo.advantages import rloo_advantages as rloo_advantages
from fnppo.batch import Microbatch as Microbatch
from fnppo.batch import Sample as Sample
from fnppo.batch import collate_microbatch as collate_microbatch
from fnppo.batch import padding_multiple as padding_multiple
from fnppo.batch import unpack_per_sample as unpack_per_sample
from fnppo.logprob import logprob_and_entropy as logprob_and_entropy
from fnppo.linear_logprob import BackwardGraphs as BackwardGraphs
from fnppo.linear_logprob import linear_logprob_and_entropy as linear_logprob_and_entropy
from fnppo.rope import apply_rotary as apply_rotary
from fnppo.rope import thd_positions as thd_positions
from fnppo.loss import PolicyLossConfig as PolicyLossConfig
from fnppo.loss import compute_tis_weights as compute_tis_weights
from fnppo.loss import kl_penalty as kl_penalty
from fnppo.loss import loss_normalizer as loss_normalizer
from fnppo.loss import ppo_loss as ppo_loss
from fnppo.loss import value_loss as value_loss
from fnppo.loss import ValueLossConfig as ValueLossConfig
from fnppo.metrics import finalize_metrics as finalize_metrics
from fnppo.metrics import merge_metrics as merge_metrics
from fnppo.policy_losses import PolicyLossInputs as PolicyLossInputs
from fnppo.policy_losses import get_policy_loss as get_policy_loss
from fnppo.policy_losses import register_policy_loss as register_policy_loss
from fnppo.policy_losses import registered_policy_losses as registered_policy_losses
from fnppo.split import SplitPlan as SplitPlan
from fnppo.split import split_batch as split_batch
from fnppo.typing import InputError as InputError
from fnppo.typing import ShapeError as ShapeError
from fnppo.typing import set_typechecking as set_typechecking
from fnppo.typing import typechecking as typechecking
from fnppo.advantages import pass_at_k_advantages as pass_at_k_advantages
from fnppo.advantages import reinforce_pp_baseline_advantages as reinforce_pp_baseline_advantages
from fnppo.advantages import masked_moments as masked_moments
from fnppo.advantages import remax_advantages as remax_advantages
from fnppo.advantages import opo_advantages as opo_advantages
from fnppo.advantages import gpg_advantages as gpg_advantages
from fnppo.advantages import gpg_batch_counts as gpg_batch_counts
from fnppo.advantages import optimal_token_baseline_advantages as optimal_token_baseline_advantages
from fnppo.kl_control import KLControllerState as KLControllerState
from fnppo.kl_control import adaptive_kl_init as adaptive_kl_init
from fnppo.kl_control import adaptive_kl_update as adaptive_kl_update
from fnppo.kl_control import fixed_kl_init as fixed_kl_init
from fnppo.kl_control import fixed_kl_update as fixed_kl_update
from fnppo.kl_control import with_kl_coef as with_kl_coef
from fnppo.loss import tis_batch_stats as tis_batch_stats

__version__ = "0.1.0"

# Names of the Megatron-dependent modules, imported by ``__getattr__`` on first use.
_LAZY: dict[str, str] = {
    "PackedDotProductAttention": "attention",
    "default_layer_spec": "attention",
    "local_layer_spec": "attention",
    "packed_causal_attention": "attention",
    "te_available": "attention",
    "flex_compile_count": "attention",
    "CheckpointError": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "FinalizeNotCalledError": "grads",
    "GradStats": "grads",
    "finalize_grads": "grads",
    "grad_norm": "grads",
    "build_gpt_from_hf": "hf",
    "export_hf_weights": "hf",
    "load_hf_weights": "hf",
    "model_config_from_hf": "hf",
    "ModelConfig": "model",
    "build_gpt": "model",
    "build_optimizer": "model",
    "forward_logits": "model",
    "forward_values": "model",
    "gather_full_weights": "model",
    "layout_invariant_init": "model",
    "load_full_weights": "model",
    "snapshot_params": "model",
    "wrap_ddp": "model",
    "ParallelLayout": "parallel",
    "current_layout": "parallel",
    "init_parallel": "parallel",
    "StepConfig": "step",
    "StepFns": "step",
    "TrainState": "step",
    "CollateFn": "step",
    "ForwardFn": "step",
    "LogprobFn": "step",
    "LossFn": "step",
    "compute_logprobs": "step",
    "CriticConfig": "step",
    "CriticFns": "step",
    "ValueLossFn": "step",
    "compute_values": "step",
    "critic_step": "step",
    "forward_only": "step",
    "shard_for_data_parallel": "step",
    "train_step": "step",
    "VLMCollate": "vlm",
    "VisionConfig": "vlm",
    "build_vlm": "vlm",
}
_LAZY_MODULES = ("attention", "checkpoint", "grads", "hf", "model", "moe", "parallel", "routing", "step", "testing", "value", "vlm")

__all__ = [
    # advantages
    "broadcast_to_tokens", "gae_advantages", "grpo_advantages", "reinforce_pp_advantages", "rloo_advantages",
    # batching
    "Microbatch", "Sample", "SplitPlan", "collate_microbatch", "padding_multiple", "split_batch", "unpack_per_sample",
    # log-probs, losses, metrics
    "logprob_and_entropy", "linear_logprob_and_entropy", "BackwardGraphs", "apply_rotary", "thd_positions", "PolicyLossConfig", "PolicyLossInputs", "compute_tis_weights", "finalize_metrics",
    "get_policy_loss", "kl_penalty", "loss_normalizer", "merge_metrics", "ppo_loss", "register_policy_loss",
    "registered_policy_losses", "value_loss", "ValueLossConfig",
    # more advantage estimators, KL control
    "pass_at_k_advantages", "reinforce_pp_baseline_advantages", "masked_moments", "remax_advantages",
    "opo_advantages", "gpg_advantages", "gpg_batch_counts", "optimal_token_baseline_advantages",
    "KLControllerState", "adaptive_kl_init", "adaptive_kl_update", "fixed_kl_init", "fixed_kl_update", "with_kl_coef",
    # rollout correction: batch-normalized importance weights
    "tis_batch_stats",
    # checking
    "InputError", "ShapeError", "set_typechecking", "typechecking",
    # Megatron-dependent (lazy)
    *_LAZY,
    "parallel",
]


def __getattr__(name: str) -> Any:
    """Import a Megatron-dependent name (or module) on first use and cache it in the package."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f"fnppo.{_LAZY[name]}"), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(f"fnppo.{name}")
    else:
        raise AttributeError(f"module 'fnppo' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_LAZY_MODULES))
