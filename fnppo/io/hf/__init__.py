"""Hugging Face checkpoints of the Llama / Qwen2 / Qwen3 families and their Mixture-of-Experts
siblings (Qwen2-MoE, Qwen3-MoE, Mixtral) <-> Megatron ``GPTModel``.

* :func:`model_config_from_hf` reads a ``config.json`` into a :class:`fnppo.megatron.config.ModelConfig`;
* :func:`build_gpt_from_hf` builds this rank's model chunks from it;
* :func:`load_hf_weights` streams the safetensors shards into this rank's TP/PP shard. A value
  model (``build_gpt_from_hf(path, head="value")``, the critic of PPO) takes a value or reward
  model's trunk and scalar head (``*ForTokenClassification`` or ``*ForSequenceClassification`` with
  ``num_labels=1``: ``score.weight`` ``[1, hidden]``, ``score.bias`` ``[1]`` when stored), a critic
  saved by TRL (``v_head.summary.*``), OpenRLHF (``CriticModel`` / ``RewardModel``, its reward
  normalisation folded into the head) or verl's Megatron critic (``lm_head.weight`` ``[1, hidden]``)
  (:data:`VALUE_HEAD_LAYOUTS`), or a policy checkpoint's trunk with a fresh value head (``lm_head``
  skipped); the loader returns what it skipped;
* :func:`export_hf_weights` writes the inverse (HF names, safetensors shards, ``config.json``), so
  a trained policy can be served by an inference engine, and a trained critic is a
  ``*ForTokenClassification`` checkpoint with ``num_labels=1`` (transformers'
  ``AutoModelForTokenClassification``: ``logits[..., 0]`` are the values);
* :func:`stream_hf_weights` hands the same tensors to an inference engine without files: buckets of
  ``(name, tensor)`` pairs on one rank (vLLM's ``model.load_weights``), never the whole model at once;
* :func:`stream_hf_deltas` streams only what changed since a :class:`WeightSnapshot` (tensors, blocks
  or elements, each with its SHA-256 digest), :func:`apply_hf_deltas` rebuilds and checks the new
  weights on the receiving side;
* ``fp8=FP8Blocks()`` (export and both streams): projection weights as E4M3 codes with a
  ``weight_scale_inv`` per 128 x 128 block, transformers' fine-grained FP8 layout.

The modules, one job each (each imports only the ones above it)::

    config_keys the allow-list a family reads its config.json through (understood / irrelevant / refused)
    families    the supported families, the heads their checkpoints end in, the value-head layouts
    config      config.json -> ModelConfig (families, rope, MoE router); build_gpt_from_hf
    arch        a built model's architecture and the Hugging Face tensor names and shapes it has
    keys        Megatron <-> Hugging Face parameter names (and the layout kind of each)
    layouts     one tensor's layout conversion (fused QKV, [gate; up], padded vocabulary, TP shards)
    shards      safetensors files, headers and slices
    checks      a config.json against the model it is loaded into or exported from
    value_head  which value head a checkpoint holds; a value model's exported config.json
    load        load_hf_weights
    sources     the parameters an export reads, each through one function; TP shard placement
    fp8         FP8 E4M3 blockwise weights: quantize, dequantize, which tensors, quantization_config
    export      export_hf_weights
    stream      stream_hf_weights
    snapshot    tensor digests (SHA-256), WeightSnapshot and the records of a delta stream
    delta       stream_hf_deltas (the sending side)
    apply       apply_hf_deltas (the receiving side)
    peft_rules  PEFT's rules for which module or parameter a config names, and with what rank and alpha
    peft_experts  MoE expert adapters in PEFT's target_parameters form (fused and split)
    peft_config adapter_config.json and the safetensors header read and checked; lora_config_from_peft
    peft        LoRA adapters in PEFT's format: save_peft_adapter, load_peft_adapter
    peft_stream stream_peft_adapter: a LoRA run's adapters to an engine, per step, in PEFT's layout

Nothing here touches the network: ``config_or_path`` and ``path`` are local files.
"""

from fnppo.io.hf.apply import apply_hf_deltas
from fnppo.io.hf.arch import hf_tensor_shapes
from fnppo.io.hf.config import build_gpt_from_hf, model_config_from_hf
from fnppo.io.hf.delta import DeltaStream, stream_hf_deltas
from fnppo.io.hf.export import export_hf_weights
from fnppo.io.hf.families import (
    MOE_FAMILIES,
    OPENRLHF_ARCHITECTURES,
    SEQUENCE_CLASSIFICATION_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    TOKEN_CLASSIFICATION_ARCHITECTURES,
    VALUE_HEAD_LAYOUTS,
)
from fnppo.io.hf.fp8 import FP8Blocks, dequantize_fp8_blockwise, quantize_fp8_blockwise
from fnppo.io.hf.load import load_hf_weights
from fnppo.io.hf.peft_stream import stream_peft_adapter
from fnppo.io.hf.snapshot import DeltaEnd, DeltaHeader, TensorDelta, WeightSnapshot, tensor_digest
from fnppo.io.hf.stream import stream_hf_weights

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TOKEN_CLASSIFICATION_ARCHITECTURES",
    "SEQUENCE_CLASSIFICATION_ARCHITECTURES",
    "OPENRLHF_ARCHITECTURES",
    "VALUE_HEAD_LAYOUTS",
    "MOE_FAMILIES",
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
