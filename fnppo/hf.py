"""Hugging Face interop: config.json to ModelConfig, safetensors in and out (dense, MoE, value heads),
weights streamed to an inference engine.
Implementation: :mod:`fnppo.io.hf`."""

from __future__ import annotations

from fnppo.io.hf import build_gpt_from_hf as build_gpt_from_hf
from fnppo.io.hf import export_hf_weights as export_hf_weights
from fnppo.io.hf import hf_tensor_shapes as hf_tensor_shapes
from fnppo.io.hf import load_hf_weights as load_hf_weights
from fnppo.io.hf import model_config_from_hf as model_config_from_hf
from fnppo.io.hf import stream_hf_weights as stream_hf_weights

__all__ = [
    "model_config_from_hf",
    "build_gpt_from_hf",
    "load_hf_weights",
    "export_hf_weights",
    "stream_hf_weights",
    "hf_tensor_shapes",
]
