"""fnppo: functional, shape-checked PPO/GRPO training steps for Megatron-core models.

The public API, one name per line. Stages (pure functions): ``collate_microbatch``,
``forward_logits``, ``logprob_and_entropy``, ``ppo_loss``, ``finalize_grads``; composed by
``train_step`` / ``compute_logprobs`` inside Megatron's own pipeline schedule.
"""

from fnppo import parallel as parallel
from fnppo.advantages import broadcast_to_tokens as broadcast_to_tokens
from fnppo.advantages import gae_advantages as gae_advantages
from fnppo.advantages import grpo_advantages as grpo_advantages
from fnppo.advantages import reinforce_pp_advantages as reinforce_pp_advantages
from fnppo.advantages import rloo_advantages as rloo_advantages
from fnppo.attention import PackedDotProductAttention as PackedDotProductAttention
from fnppo.attention import default_layer_spec as default_layer_spec
from fnppo.attention import local_layer_spec as local_layer_spec
from fnppo.attention import packed_causal_attention as packed_causal_attention
from fnppo.attention import te_available as te_available
from fnppo.batch import Microbatch as Microbatch
from fnppo.batch import Sample as Sample
from fnppo.batch import SplitPlan as SplitPlan
from fnppo.batch import collate_microbatch as collate_microbatch
from fnppo.batch import padding_multiple as padding_multiple
from fnppo.batch import split_batch as split_batch
from fnppo.batch import unpack_per_sample as unpack_per_sample
from fnppo.checkpoint import CheckpointError as CheckpointError
from fnppo.checkpoint import latest_checkpoint as latest_checkpoint
from fnppo.checkpoint import load_checkpoint as load_checkpoint
from fnppo.checkpoint import save_checkpoint as save_checkpoint
from fnppo.grads import FinalizeNotCalledError as FinalizeNotCalledError
from fnppo.grads import GradStats as GradStats
from fnppo.grads import finalize_grads as finalize_grads
from fnppo.grads import grad_norm as grad_norm
from fnppo.hf import build_gpt_from_hf as build_gpt_from_hf
from fnppo.hf import export_hf_weights as export_hf_weights
from fnppo.hf import load_hf_weights as load_hf_weights
from fnppo.hf import model_config_from_hf as model_config_from_hf
from fnppo.linear_logprob import linear_logprob_and_entropy as linear_logprob_and_entropy
from fnppo.logprob import logprob_and_entropy as logprob_and_entropy
from fnppo.loss import PolicyLossConfig as PolicyLossConfig
from fnppo.loss import PolicyLossInputs as PolicyLossInputs
from fnppo.loss import get_policy_loss as get_policy_loss
from fnppo.loss import registered_policy_losses as registered_policy_losses
from fnppo.loss import compute_tis_weights as compute_tis_weights
from fnppo.loss import finalize_metrics as finalize_metrics
from fnppo.loss import kl_penalty as kl_penalty
from fnppo.loss import loss_normalizer as loss_normalizer
from fnppo.loss import merge_metrics as merge_metrics
from fnppo.loss import ppo_loss as ppo_loss
from fnppo.loss import register_policy_loss as register_policy_loss
from fnppo.loss import value_loss as value_loss
from fnppo.model import ModelConfig as ModelConfig
from fnppo.model import build_gpt as build_gpt
from fnppo.model import build_optimizer as build_optimizer
from fnppo.model import forward_logits as forward_logits
from fnppo.model import gather_full_weights as gather_full_weights
from fnppo.model import layout_invariant_init as layout_invariant_init
from fnppo.model import load_full_weights as load_full_weights
from fnppo.model import snapshot_params as snapshot_params
from fnppo.model import wrap_ddp as wrap_ddp
from fnppo.parallel import ParallelLayout as ParallelLayout
from fnppo.parallel import current_layout as current_layout
from fnppo.parallel import init_parallel as init_parallel
from fnppo.step import StepConfig as StepConfig
from fnppo.step import StepFns as StepFns
from fnppo.step import TrainState as TrainState
from fnppo.step import compute_logprobs as compute_logprobs
from fnppo.step import forward_only as forward_only
from fnppo.step import shard_for_data_parallel as shard_for_data_parallel
from fnppo.step import train_step as train_step
from fnppo.typing import InputError as InputError
from fnppo.typing import ShapeError as ShapeError
from fnppo.typing import set_typechecking as set_typechecking
from fnppo.typing import typechecking as typechecking

__version__ = "0.1.0"
