"""Vision-language policies: the vision config, the collate stage that expands image placeholders,
the model. Implementation: :mod:`fnppo.megatron.vlm_collate`, :mod:`fnppo.megatron.vlm_model`."""

from __future__ import annotations

from fnppo.megatron.vlm_collate import VisionConfig as VisionConfig
from fnppo.megatron.vlm_collate import VLMCollate as VLMCollate
from fnppo.megatron.vlm_collate import expand_image_placeholders as expand_image_placeholders
from fnppo.megatron.vlm_collate import expand_image_routes as expand_image_routes
from fnppo.megatron.vlm_model import VisionLanguageGPT as VisionLanguageGPT
from fnppo.megatron.vlm_model import build_vlm as build_vlm

__all__ = [
    "VisionConfig",
    "VLMCollate",
    "expand_image_placeholders",
    "expand_image_routes",
    "build_vlm",
    "VisionLanguageGPT",
]
