# temporary re-export shim (redesign): removed at integration
"""Re-exports of the names that moved to :mod:`fnppo.megatron.vlm_collate` (config and collate stage)
and :mod:`fnppo.megatron.vlm_model` (the model)."""

from fnppo.megatron.vlm_collate import VisionConfig as VisionConfig
from fnppo.megatron.vlm_collate import VLMCollate as VLMCollate
from fnppo.megatron.vlm_collate import check_images as check_images
from fnppo.megatron.vlm_collate import expand_image_placeholders as expand_image_placeholders
from fnppo.megatron.vlm_collate import expand_image_routes as expand_image_routes
from fnppo.megatron.vlm_model import VisionLanguageGPT as VisionLanguageGPT
from fnppo.megatron.vlm_model import build_vlm as build_vlm
from fnppo.megatron.vlm_model import scatter_image_features as scatter_image_features
from fnppo.megatron.vlm_model import vision_layer_spec as vision_layer_spec
