"""fnppo: functional, shape-checked PPO/GRPO training steps for Megatron-core models.

The public API is :data:`__all__`. Stages (pure functions): ``collate_microbatch``,
``forward_logits``, ``logprob_and_entropy``, ``ppo_loss``, ``finalize_grads``; composed by
``train_step`` / ``compute_logprobs`` (and, for a critic, ``forward_values`` and ``value_loss``
composed by ``critic_step`` / ``compute_values``) inside Megatron's own pipeline schedule.

The pure-torch core (losses, advantages, log-probs, batching, metrics, type checks) is imported
with the package and needs no Megatron. Everything that touches Megatron (attention, model, step,
grads, checkpoint, hf, parallel, testing) is imported on first use of one of its names, so
``import fnppo`` and ``from fnppo.core.loss import ppo_loss`` work without megatron-core installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from fnppo.megatron.quiet import install_warning_filters as _install_warning_filters

_install_warning_filters()  # before Megatron is imported: see fnppo/megatron/quiet.py for the list

from fnppo.core.advantages import broadcast_to_tokens as broadcast_to_tokens
from fnppo.core.advantages import gae_advantages as gae_advantages
from fnppo.core.advantages import grpo_advantages as grpo_advantages
from fnppo.core.advantages import reinforce_pp_advantages as reinforce_pp_advantages
from fnppo.core.advantages import rloo_advantages as rloo_advantages
from fnppo.core.batch import Microbatch as Microbatch
from fnppo.core.batch import Sample as Sample
from fnppo.core.batch import collate_microbatch as collate_microbatch
from fnppo.core.batch import padding_multiple as padding_multiple
from fnppo.core.batch import unpack_per_sample as unpack_per_sample
from fnppo.core.logprob import logprob_and_entropy as logprob_and_entropy
from fnppo.core.linear_logprob import BackwardGraphs as BackwardGraphs
from fnppo.core.linear_logprob import linear_logprob_and_entropy as linear_logprob_and_entropy
from fnppo.core.rope import apply_rotary as apply_rotary
from fnppo.core.rope import thd_positions as thd_positions
from fnppo.core.loss import PolicyLossConfig as PolicyLossConfig
from fnppo.core.loss import compute_tis_weights as compute_tis_weights
from fnppo.core.loss import kl_penalty as kl_penalty
from fnppo.core.loss import loss_normalizer as loss_normalizer
from fnppo.core.loss import ppo_loss as ppo_loss
from fnppo.core.loss import value_loss as value_loss
from fnppo.core.loss import ValueLossConfig as ValueLossConfig
from fnppo.core.metrics import finalize_metrics as finalize_metrics
from fnppo.core.metrics import merge_metrics as merge_metrics
from fnppo.core.policy_losses import PolicyLossInputs as PolicyLossInputs
from fnppo.core.policy_losses import get_policy_loss as get_policy_loss
from fnppo.core.policy_losses import register_policy_loss as register_policy_loss
from fnppo.core.policy_losses import registered_policy_losses as registered_policy_losses
from fnppo.core.split import SplitPlan as SplitPlan
from fnppo.core.split import split_batch as split_batch
from fnppo.core.typing import InputError as InputError
from fnppo.core.typing import ShapeError as ShapeError
from fnppo.core.typing import set_typechecking as set_typechecking
from fnppo.core.typing import typechecking as typechecking
from fnppo.core.advantages import pass_at_k_advantages as pass_at_k_advantages
from fnppo.core.advantages import reinforce_pp_baseline_advantages as reinforce_pp_baseline_advantages
from fnppo.core.advantages import masked_moments as masked_moments
from fnppo.core.advantages import remax_advantages as remax_advantages
from fnppo.core.advantages import opo_advantages as opo_advantages
from fnppo.core.advantages import gpg_advantages as gpg_advantages
from fnppo.core.advantages import gpg_batch_counts as gpg_batch_counts
from fnppo.core.advantages import optimal_token_baseline_advantages as optimal_token_baseline_advantages
from fnppo.core.kl_control import KLControllerState as KLControllerState
from fnppo.core.kl_control import adaptive_kl_init as adaptive_kl_init
from fnppo.core.kl_control import adaptive_kl_update as adaptive_kl_update
from fnppo.core.kl_control import fixed_kl_init as fixed_kl_init
from fnppo.core.kl_control import fixed_kl_update as fixed_kl_update
from fnppo.core.kl_control import with_kl_coef as with_kl_coef
from fnppo.core.loss import tis_batch_stats as tis_batch_stats

__version__ = "0.1.0"

# Names of the Megatron-dependent modules, imported by ``__getattr__`` on first use.
_LAZY: dict[str, str] = {
    "PackedDotProductAttention": "megatron.attention",
    "default_layer_spec": "megatron.attention",
    "local_layer_spec": "megatron.attention",
    "packed_causal_attention": "megatron.attention",
    "te_available": "megatron.attention",
    "flex_compile_count": "megatron.attention",
    "CheckpointError": "io.checkpoint",
    "latest_checkpoint": "io.checkpoint",
    "load_checkpoint": "io.checkpoint",
    "save_checkpoint": "io.checkpoint",
    "FinalizeNotCalledError": "megatron.grads",
    "GradStats": "megatron.grads",
    "finalize_grads": "megatron.grads",
    "grad_norm": "megatron.grads",
    "build_gpt_from_hf": "io.hf",
    "export_hf_weights": "io.hf",
    "load_hf_weights": "io.hf",
    "model_config_from_hf": "io.hf",
    "ModelConfig": "megatron.model",
    "build_gpt": "megatron.model",
    "build_optimizer": "megatron.model",
    "forward_logits": "megatron.model",
    "forward_values": "megatron.model",
    "gather_full_weights": "megatron.model",
    "layout_invariant_init": "megatron.model",
    "load_full_weights": "megatron.model",
    "snapshot_params": "megatron.model",
    "wrap_ddp": "megatron.model",
    "ParallelLayout": "megatron.parallel",
    "current_layout": "megatron.parallel",
    "init_parallel": "megatron.parallel",
    "StepConfig": "steps.step",
    "StepFns": "steps.step",
    "TrainState": "steps.step",
    "CollateFn": "steps.step",
    "ForwardFn": "steps.step",
    "LogprobFn": "steps.step",
    "LossFn": "steps.step",
    "compute_logprobs": "steps.step",
    "CriticConfig": "steps.step",
    "CriticFns": "steps.step",
    "ValueLossFn": "steps.step",
    "compute_values": "steps.step",
    "critic_step": "steps.step",
    "forward_only": "steps.step",
    "shard_for_data_parallel": "steps.step",
    "train_step": "steps.step",
    "VLMCollate": "megatron.vlm",
    "VisionConfig": "megatron.vlm",
    "build_vlm": "megatron.vlm",
}
_LAZY_MODULES = ("core", "io", "megatron", "steps", "testing")

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
