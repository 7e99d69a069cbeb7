# temporary re-export shim (redesign): removed at integration
"""Re-exports of the names that moved to :mod:`fnppo.megatron.packed_attention` (the kernel),
:mod:`fnppo.megatron.core_attention` (Megatron's module) and :mod:`fnppo.megatron.layer_specs`."""

from fnppo.megatron.core_attention import PackedDotProductAttention as PackedDotProductAttention
from fnppo.megatron.core_attention import thd_packed_seq_params as thd_packed_seq_params
from fnppo.megatron.layer_specs import default_layer_spec as default_layer_spec
from fnppo.megatron.layer_specs import local_layer_spec as local_layer_spec
from fnppo.megatron.layer_specs import te_available as te_available
from fnppo.megatron.packed_attention import document_causal_mask as document_causal_mask
from fnppo.megatron.packed_attention import flex_bucket_length as flex_bucket_length
from fnppo.megatron.packed_attention import flex_compile_count as flex_compile_count
from fnppo.megatron.packed_attention import packed_causal_attention as packed_causal_attention
from fnppo.megatron.packed_attention import segment_ids as segment_ids
