# temporary re-export shim (redesign): removed at integration
"""Re-exports of the names that moved to :mod:`fnppo.megatron.config`, :mod:`fnppo.megatron.build`,
:mod:`fnppo.megatron.forward`, :mod:`fnppo.megatron.weights`, :mod:`fnppo.megatron.unwrap`,
:mod:`fnppo.megatron.layer_specs` and :mod:`fnppo.megatron.fused_rope`."""

from fnppo.megatron.build import build_gpt as build_gpt
from fnppo.megatron.build import build_optimizer as build_optimizer
from fnppo.megatron.build import wrap_ddp as wrap_ddp
from fnppo.megatron.config import ModelConfig as ModelConfig
from fnppo.megatron.config import fusion_fields as fusion_fields
from fnppo.megatron.config import transformer_config as transformer_config
from fnppo.megatron.forward import deterministic_algorithms as deterministic_algorithms
from fnppo.megatron.forward import forward_hidden as forward_hidden
from fnppo.megatron.forward import forward_logits as forward_logits
from fnppo.megatron.forward import forward_values as forward_values
from fnppo.megatron.forward import packed_seq_params as packed_seq_params
from fnppo.megatron.forward import snapshot_params as snapshot_params
from fnppo.megatron.fused_rope import _fused_rope_bshd as _fused_rope_bshd
from fnppo.megatron.fused_rope import _fused_rope_thd as _fused_rope_thd
from fnppo.megatron.fused_rope import install_fused_rope as install_fused_rope
from fnppo.megatron.layer_specs import choose_layer_spec as choose_layer_spec
from fnppo.megatron.unwrap import HEADS as HEADS
from fnppo.megatron.unwrap import check_head as check_head
from fnppo.megatron.unwrap import model_head as model_head
from fnppo.megatron.unwrap import unwrap_model as unwrap_model
from fnppo.megatron.weights import gather_full_weights as gather_full_weights
from fnppo.megatron.weights import global_name as _global_name
from fnppo.megatron.weights import is_expert as _is_expert
from fnppo.megatron.weights import is_gated_fc1 as _is_gated_fc1
from fnppo.megatron.weights import layout_invariant_init as layout_invariant_init
from fnppo.megatron.weights import load_full_weights as load_full_weights
from fnppo.megatron.weights import tp_of as _tp_of
