"""Hugging Face interop: config.json to ModelConfig, safetensors in and out (dense, MoE, value heads),
weights streamed to an inference engine (in full, as deltas since a snapshot, in FP8 blocks).
Implementation: :mod:`fnppo.io.hf`."""

from __future__ import annotations

from fnppo.io.hf import DeltaEnd as DeltaEnd
from fnppo.io.hf import DeltaHeader as DeltaHeader
from fnppo.io.hf import DeltaStream as DeltaStream
from fnppo.io.hf import FP8Blocks as FP8Blocks
from fnppo.io.hf import TensorDelta as TensorDelta
from fnppo.io.hf import WeightSnapshot as WeightSnapshot
from fnppo.io.hf import apply_hf_deltas as apply_hf_deltas
from fnppo.io.hf import build_gpt_from_hf as build_gpt_from_hf
from fnppo.io.hf import dequantize_fp8_blockwise as dequantize_fp8_blockwise
from fnppo.io.hf import export_hf_weights as export_hf_weights
from fnppo.io.hf import hf_tensor_shapes as hf_tensor_shapes
from fnppo.io.hf import load_hf_weights as load_hf_weights
from fnppo.io.hf import model_config_from_hf as model_config_from_hf
from fnppo.io.hf import quantize_fp8_blockwise as quantize_fp8_blockwise
from fnppo.io.hf import stream_hf_deltas as stream_hf_deltas
from fnppo.io.hf import stream_hf_weights as stream_hf_weights
from fnppo.io.hf import stream_peft_adapter as stream_peft_adapter
from fnppo.io.hf import tensor_digest as tensor_digest

__all__ = [
    "model_config_from_hf",
    "build_gpt_from_hf",
    "load_hf_weights",
    "export_hf_weights",
    "stream_hf_weights",
    "hf_tensor_shapes",
    "stream_hf_deltas",
    "apply_hf_deltas",
    "DeltaStream",
    "WeightSnapshot",
    "DeltaHeader",
    "TensorDelta",
    "DeltaEnd",
    "tensor_digest",
    "FP8Blocks",
    "quantize_fp8_blockwise",
    "dequantize_fp8_blockwise",
    "stream_peft_adapter",
]
