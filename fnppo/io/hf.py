"""Hugging Face checkpoints of the Llama / Qwen2 / Qwen3 families and their Mixture-of-Experts
siblings (Qwen2-MoE, Qwen3-MoE, Mixtral) <-> Megatron ``GPTModel``.

* :func:`model_config_from_hf` reads a ``config.json`` into a :class:`fnppo.megatron.model.ModelConfig`;
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
  ``AutoModelForTokenClassification``: ``logits[..., 0]`` are the values).

Name and layout conversion (per layer ``i``; ``G`` key/value groups, ``h = heads / G`` query heads
per group, ``d`` the head dimension)::

    model.embed_tokens.weight                      -> embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight          -> decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.{weight,bias}
                                                   -> decoder.layers.i.self_attention.linear_qkv.*
    model.layers.i.self_attn.o_proj.weight         -> decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.self_attn.{q,k}_norm.weight     -> decoder.layers.i.self_attention.{q,k}_layernorm.weight
    model.layers.i.post_attention_layernorm.weight -> decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight       -> decoder.layers.i.mlp.linear_fc1.weight
    model.layers.i.mlp.down_proj.weight            -> decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                              -> decoder.final_layernorm.weight
    lm_head.weight                                 -> output_layer.weight (model.embed_tokens.weight when tied)
    score.weight [1, hidden], score.bias [1]       -> value_head.weight, value_head.bias (a value model;
                                                      other stacks' names: VALUE_HEAD_LAYOUTS)

(with Transformer Engine's layer spec the two layer norms are ``linear_qkv.layer_norm_weight`` and
``linear_fc1.layer_norm_weight``). ``score`` is transformers' per-token scalar head
(``logits = score(norm(h))``, the value model's ``values = value_head(norm(h))``: the same linear
map of the same hidden state); the value head is replicated on the TP ranks of the last pipeline
stage, so each of them reads the whole tensor. A checkpoint without ``score.bias``
(``*ForSequenceClassification``, or ``token_classification_bias=false``) gives a zero bias; export
always writes it. In an MoE layer (``e`` = ``mlp.`` for Qwen-MoE, ``block_sparse_moe.``
for Mixtral; expert ``j`` is global, Megatron's local expert ``j - ep_rank * E / ep`` on its EP rank)::

    model.layers.i.<e>gate.weight                  -> decoder.layers.i.mlp.router.weight
    model.layers.i.<e>experts.j.{gate,up}_proj.weight (Mixtral: w1, w3)
                                                   -> decoder.layers.i.mlp.experts.local_experts.j.linear_fc1.weight
    model.layers.i.<e>experts.j.down_proj.weight (Mixtral: w2)
                                                   -> decoder.layers.i.mlp.experts.local_experts.j.linear_fc2.weight
    model.layers.i.mlp.shared_expert.{gate,up,down}_proj.weight
                                                   -> decoder.layers.i.mlp.shared_experts.linear_fc{1,2}.weight
    model.layers.i.mlp.shared_expert_gate.weight   -> decoder.layers.i.mlp.shared_experts.gate_weight

(grouped-GEMM experts: ``mlp.experts.linear_fc1.weight<j>``; expert weights are split over expert
tensor parallelism like the dense MLP over TP). Megatron's fused QKV stacks, for every group ``g`` in order, the
``h * d`` query rows of the group's heads, then its ``d`` key rows and ``d`` value rows:
``qkv = concat_g [q[g*h*d : (g+1)*h*d]; k[g*d : (g+1)*d]; v[g*d : (g+1)*d]]``. Query head ``j``
belongs to group ``j // h``, as Hugging Face's ``repeat_kv`` (arXiv:2305.13245). The fused MLP input
projection is ``[gate; up]`` (SwiGLU, arXiv:2002.05202); under tensor parallelism each rank holds
``[gate_r; up_r]``. Column-parallel weights (QKV, fc1, embedding, output layer) are split on their
output rows, row-parallel ones (``o_proj``, ``down_proj``) on their input columns (Megatron-LM,
arXiv:1909.08053); a QKV shard is a contiguous range of whole groups.

Loading reads only the safetensors metadata first and validates every name and shape of the
whole checkpoint on every rank (so all ranks fail alike, before anything is written); it then reads,
one parameter at a time, only the rows/columns this rank holds (``safe_open(...).get_slice``), so
host memory never holds more than one parameter beyond the model itself.

Families: Llama (arXiv:2302.13971; RoPE theta and Llama 3 ``"llama3"`` rope scaling), Qwen2
(arXiv:2407.10671; bias on q/k/v) and Qwen3 (arXiv:2505.09388; RMSNorm on queries and keys per head,
``head_dim`` independent of ``hidden_size``). All use RMSNorm, SwiGLU, RoPE (arXiv:2104.09864) and
grouped-query attention, tied or untied embeddings. Refused with a clear error: other
architectures, other activations, rope types other than ``"default"``/``"llama3"`` (and ``"llama3"``
parameters other than the ones Megatron implements), sliding-window attention, biases other than
Qwen2's q/k/v bias.

Mixture of Experts (top-k softmax routers, no token dropping; arXiv:2401.04088, arXiv:2407.10671,
arXiv:2505.09388), each router option mapped to Megatron's exactly:

* Qwen2-MoE / Qwen3-MoE: ``softmax`` over all experts, top-k, renormalized when
  ``norm_topk_prob`` (= Megatron's softmax over the chosen logits, ``moe_router_pre_softmax=False``)
  or not (= ``moe_router_pre_softmax=True``); dense layers where ``mlp_only_layers`` or
  ``decoder_sparse_step`` say (``moe_layer_freq``, dense MLPs of ``intermediate_size``); experts of
  ``moe_intermediate_size``. Qwen2-MoE: q/k/v bias as ``qkv_bias``, an always-on shared expert of
  ``shared_expert_intermediate_size`` whose output is scaled by ``sigmoid(x . shared_expert_gate)``
  (``moe_shared_expert_gate``). Qwen3-MoE: q/k RMSNorm.
* Mixtral: softmax, top-k, renormalized (``moe_router_pre_softmax=False``); every layer an MoE
  layer with experts of ``intermediate_size``; ``router_jitter_noise`` must be 0 (Mixtral scales
  the hidden states of router *and* experts, Megatron's jitter only the router's input).
* The router computes its logits in the model's dtype and its softmax in fp32, as transformers
  does (``moe_router_dtype=None``); the auxiliary losses are off (RL settings are the caller's
  overrides). Models with expert bias, sigmoid scores, group-limited routing or a top-k scaling
  factor have no counterpart in these families and are refused.

Nothing here touches the network: ``config_or_path`` and ``path`` are local files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fnppo.megatron.model import ModelConfig, _global_name, _is_expert, _is_gated_fc1, _tp_of, build_gpt, model_head, unwrap_model
from fnppo.megatron.parallel import ParallelLayout, current_layout
from fnppo.core.typing import Tensor, input_error

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TOKEN_CLASSIFICATION_ARCHITECTURES",
    "SEQUENCE_CLASSIFICATION_ARCHITECTURES",
    "OPENRLHF_ARCHITECTURES",
    "VALUE_HEAD_LAYOUTS",
    "model_config_from_hf",
    "build_gpt_from_hf",
    "load_hf_weights",
    "export_hf_weights",
    "hf_tensor_shapes",
]

SUPPORTED_ARCHITECTURES: Mapping[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
"""``model_type`` -> ``architectures`` entry of the supported Hugging Face families (policies)."""
_CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}
TOKEN_CLASSIFICATION_ARCHITECTURES: Mapping[str, str] = {t: c + "ForTokenClassification" for t, c in _CLASSES.items()}
"""``model_type`` -> transformers' per-token classifier of the family (``score.weight`` ``[num_labels,
hidden]`` and, unless ``token_classification_bias`` is false, ``score.bias``): with ``num_labels=1``
a value model, what :func:`export_hf_weights` writes for one."""
SEQUENCE_CLASSIFICATION_ARCHITECTURES: Mapping[str, str] = {t: c + "ForSequenceClassification" for t, c in _CLASSES.items()}
"""``model_type`` -> transformers' sequence classifier of the family (``score.weight`` ``[num_labels,
hidden]``, no bias, applied per token and read at the last one): with ``num_labels=1`` a reward or
value model, loadable into a value model."""
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # sliding window switched by use_sliding_window

# Megatron 0.16's llama3 rope scaling hard-codes these (RotaryEmbedding._apply_scaling).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


# ---------------------------------------------------------------------------------------------
# config.json -> ModelConfig
# ---------------------------------------------------------------------------------------------
def _read_hf_config(fn: str, arg: str, config_or_path: Any) -> dict[str, Any]:
    """A Hugging Face config as a plain dict: a mapping, a ``PretrainedConfig``, or a local path."""
    if isinstance(config_or_path, Mapping):
        return dict(config_or_path)
    if isinstance(config_or_path, (str, os.PathLike)):
        p = Path(config_or_path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise input_error(fn, arg, "a config.json file or a local directory holding one", repr(str(p)))
        with open(p, encoding="utf-8") as fh:
            return json.load(fh)
    if hasattr(config_or_path, "to_dict"):
        return dict(config_or_path.to_dict())
    raise input_error(fn, arg, "a dict, a transformers PretrainedConfig or a path", type(config_or_path).__name__)


def _family(fn: str, hf: Mapping[str, Any]) -> str:
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    supported = ", ".join(f"{a} (model_type {t!r})" for t, a in SUPPORTED_ARCHITECTURES.items())
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise input_error(fn, "config.model_type", f"one of: {supported}", f"model_type={model_type!r}, architectures={list(archs)!r}")
    _checkpoint_head(fn, model_type, hf, "config")
    return model_type


@dataclasses.dataclass(frozen=True)
class _Head:
    """What a checkpoint's ``config.json`` says it ends in."""

    kind: str  # "lm" (*ForCausalLM), "token" (*ForTokenClassification), "sequence" (*ForSequenceClassification),
    # "openrlhf" (OpenRLHF's CriticModel / RewardModel)
    bias: bool  # a classifier's score.bias (token: token_classification_bias, default true; sequence: never)


OPENRLHF_ARCHITECTURES = ("CriticModel", "RewardModel")
"""``architectures`` of a value or reward model saved by OpenRLHF (``get_llm_for_sequence_regression``:
transformers' ``save_pretrained`` names the class it builds, for every family)."""

VALUE_HEAD_LAYOUTS: Mapping[str, tuple[str, str | None]] = {
    # transformers' *ForTokenClassification, num_labels=1 (what export writes; verl's FSDP critic,
    # built with AutoModelForTokenClassification and saved with save_pretrained)
    "score": ("score.weight", "score.bias"),
    # transformers' *ForSequenceClassification (TRL's reward models); OpenRLHF with
    # value_head_prefix="score" (its default since OpenRLHF commit e742e014, 2024-12): nn.Linear(hidden, 1, bias=False)
    "score-no-bias": ("score.weight", None),
    # OpenRLHF with value_head_prefix="value_head" (its default from 2024-07 to 2024-12)
    "value_head": ("value_head.weight", None),
    # TRL's AutoModelForCausalLMWithValueHead (trl/experimental/ppo/modeling_value_head.py): the causal
    # LM's own state dict plus ValueHead.summary = nn.Linear(hidden, 1) under "v_head."
    "v_head.summary": ("v_head.summary.weight", "v_head.summary.bias"),
    # verl's Megatron critic (verl/models/mcore/saver.py): the output layer [1, hidden] saved as lm_head.weight
    # into the policy's *ForCausalLM config
    "lm_head": ("lm_head.weight", None),
}
"""The one table of value-head layouts a value model loads: name -> (the head's weight ``[1, hidden]``,
its bias ``[1]`` or ``None``: a head without bias). The trunk is the family's (``model.``-prefixed
names) in every one of them; :func:`_value_head` picks the layout of a checkpoint."""


def _key(label: str, name: str) -> str:
    """How an entry of a config is named in errors: ``config.num_labels`` or ``config.json['num_labels']``."""
    return f"{label}.{name}" if label == "config" else f"{label}[{name!r}]"


def _checkpoint_head(fn: str, family: str, hf: Mapping[str, Any], label: str) -> _Head | None:
    """The head a Hugging Face config of ``family`` describes (``None``: no ``architectures``).

    A policy is ``<Family>ForCausalLM``; a value or reward model ``<Family>ForTokenClassification``
    or ``<Family>ForSequenceClassification`` with one label: transformers counts the labels as
    ``len(id2label)`` where ``id2label`` is given, else ``num_labels``, else 2 (its default).
    ``label``: how errors name the config (``"config"``, ``"config.json"``, ``"hf_config"``).

    Raises:
        InputError: another architecture, more than one entry, or a classifier without exactly one
            label (naming the key the config uses).
    """
    archs = list(hf.get("architectures") or [])
    if not archs:
        return None
    kinds = {SUPPORTED_ARCHITECTURES[family]: "lm", TOKEN_CLASSIFICATION_ARCHITECTURES[family]: "token",
             SEQUENCE_CLASSIFICATION_ARCHITECTURES[family]: "sequence", **dict.fromkeys(OPENRLHF_ARCHITECTURES, "openrlhf")}
    if len(archs) != 1 or archs[0] not in kinds:
        names = [repr([a]) for a in kinds]
        raise input_error(fn, _key(label, "architectures"),
                          f"{names[0]} (a policy) or {names[1]} / {names[2]} (a value or reward model, num_labels=1) for model_type {family!r}"
                          f" or {names[3]} / {names[4]} (OpenRLHF's critic / reward model)",
                          repr(archs))
    kind = kinds[archs[0]]
    if kind in ("lm", "openrlhf"):  # OpenRLHF's head has one output whatever the config's labels say
        return _Head(kind, False)
    if hf.get("id2label") is not None:
        key, n, have = "id2label", len(hf["id2label"]), repr(hf["id2label"])
    elif hf.get("num_labels") is not None:
        key, n, have = "num_labels", hf["num_labels"], repr(hf["num_labels"])
    else:
        key, n, have = "num_labels", 2, "neither id2label nor num_labels (transformers' default: 2 labels)"
    if n != 1:
        want = "one entry" if key == "id2label" else "1"
        raise input_error(fn, _key(label, key), f"{want} (num_labels=1: one value per token, the value head; {archs[0]})", have)
    return _Head(kind, kind == "token" and bool(hf.get("token_classification_bias", True)))


def _rope(fn: str, hf: Mapping[str, Any]) -> tuple[float, bool, float]:
    """``(theta, llama3_scaling, factor)`` from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        scaling: Mapping[str, Any] = params
        theta = params.get("rope_theta", hf.get("rope_theta") or 10000.0)
        key = "config.rope_parameters"
    else:
        scaling = hf.get("rope_scaling") or {}
        theta = hf.get("rope_theta") or 10000.0
        key = "config.rope_scaling"
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    partial = hf.get("partial_rotary_factor") or (scaling.get("partial_rotary_factor", 1.0) if scaling else 1.0)
    if float(partial) != 1.0:
        raise input_error(fn, "config.partial_rotary_factor", "1.0", repr(partial))
    if rope_type in (None, "default"):
        return float(theta), False, 8.0
    if rope_type == "llama3":
        for name, value in _LLAMA3_FIXED.items():
            got = scaling.get(name, value)
            if float(got) != value:
                raise input_error(fn, f"{key}[{name!r}]", f"{value:g} (the llama3 scaling Megatron implements)", repr(got))
        if "factor" not in scaling:
            raise input_error(fn, f"{key}['factor']", "a number", "no such key")
        return float(theta), True, float(scaling["factor"])
    raise input_error(fn, key, "rope_type 'default' or 'llama3' (the RoPE variants Megatron implements)", repr(rope_type))


def model_config_from_hf(config_or_path: Any, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` equivalent to a Hugging Face Llama / Qwen2 / Qwen3 ``config.json``.

    ``config_or_path``: a dict, a ``transformers`` config object, a ``config.json`` path or a local
    checkpoint directory. Maps ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``,
    ``num_attention_heads``, ``num_key_value_heads`` (grouped-query attention, arXiv:2305.13245),
    ``head_dim`` (``kv_channels``), ``vocab_size``, ``max_position_embeddings``, ``rms_norm_eps``,
    RoPE theta and Llama 3 scaling (arXiv:2104.09864), ``tie_word_embeddings``, Qwen2's q/k/v bias
    and Qwen3's q/k RMSNorm; RMSNorm + SwiGLU always. ``dtype`` is the checkpoint's ``dtype`` /
    ``torch_dtype`` (fp32 if absent). ``overrides`` replace any :class:`ModelConfig` field.

    Raises ``InputError`` naming the offending key for anything Megatron would compute differently
    (see the module docstring).
    """
    fn = "fnppo.io.hf.model_config_from_hf"
    hf = _read_hf_config(fn, "config_or_path", config_or_path)
    family = _family(fn, hf)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(hf.get(key), int):
            raise input_error(fn, f"config.{key}", "an int", repr(hf.get(key)))
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise input_error(fn, "config.hidden_act", "'silu' (SwiGLU)", repr(act))
    if hf.get("mlp_bias", False):
        raise input_error(fn, "config.mlp_bias", "False", repr(hf.get("mlp_bias")))
    if family not in ("qwen2", "qwen2_moe") and hf.get("attention_bias", False):
        raise input_error(fn, "config.attention_bias", f"False (o_proj bias without MLP bias has no Megatron equivalent) for {family}", repr(hf.get("attention_bias")))
    if hf.get("use_sliding_window", False):
        raise input_error(fn, "config.use_sliding_window", "False (sliding-window attention is not supported)", repr(hf.get("use_sliding_window")))
    if family not in _QWEN and hf.get("sliding_window") is not None:
        raise input_error(fn, "config.sliding_window", "None (sliding-window attention is not supported)", repr(hf.get("sliding_window")))
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise input_error(fn, "config.layer_types", "only 'full_attention'", repr(sorted(set(layer_types))))
    theta, scaling, factor = _rope(fn, hf)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    raw_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    raw_dtype = str(raw_dtype).replace("torch.", "")
    if raw_dtype not in _DTYPES:
        raise input_error(fn, "config.dtype", f"one of {sorted(_DTYPES)}", repr(raw_dtype))
    kwargs: dict[str, Any] = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=int(head_dim),
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_seq_len=int(hf.get("max_position_embeddings") or 4096),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=1.0,
        rope_scaling=scaling,
        rope_scaling_factor=factor,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        dtype=_DTYPES[raw_dtype],
        attention_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
        hidden_dropout=0.0,
    )
    if family in MOE_FAMILIES:
        kwargs.update(_moe_config(fn, family, hf))
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise input_error(fn, "overrides", f"ModelConfig fields ({', '.join(sorted(fields))})", repr(unknown))
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def _experts_key(family: str, hf: Mapping[str, Any]) -> str:
    """The key of the expert count: ``num_local_experts`` (Mixtral; Qwen3-MoE from transformers 5)
    or ``num_experts`` (Qwen2-MoE; Qwen3-MoE from transformers 4)."""
    return "num_local_experts" if family == "mixtral" or "num_local_experts" in hf else "num_experts"


def _hf_moe_layers(family: str, hf: Mapping[str, Any]) -> list[int]:
    """Global indices of a Hugging Face MoE config's MoE layers (Qwen-MoE: not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; Mixtral: every layer)."""
    n = hf["num_hidden_layers"]
    if family == "mixtral":
        return list(range(n))
    if not hf.get(_experts_key(family, hf)):
        return []
    dense = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step") or 1
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def _moe_config(fn: str, family: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    """:class:`ModelConfig` MoE fields of a Qwen2-MoE / Qwen3-MoE / Mixtral config (module docstring)."""
    experts_key = _experts_key(family, hf)
    ffn_key = "intermediate_size" if family == "mixtral" else "moe_intermediate_size"
    for key in (experts_key, "num_experts_per_tok", ffn_key):
        if not isinstance(hf.get(key), int) or hf[key] < 1:
            raise input_error(fn, f"config.{key}", "an int >= 1", repr(hf.get(key)))
    layers = _hf_moe_layers(family, hf)
    if not layers:
        raise input_error(fn, "config.mlp_only_layers", "at least one MoE layer (mlp_only_layers / decoder_sparse_step)", repr(hf.get("mlp_only_layers")))
    if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        raise input_error(fn, "config.router_jitter_noise", "0 (Megatron's input jitter scales the router's input only)", repr(hf.get("router_jitter_noise")))
    n = hf["num_hidden_layers"]
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    return dict(
        num_experts=hf[experts_key],
        moe_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf[ffn_key],
        moe_layer_freq=1 if len(layers) == n else tuple(int(i in layers) for i in range(n)),
        moe_pre_softmax=family != "mixtral" and not hf.get("norm_topk_prob", False),
        moe_shared_expert_size=shared or None,
        moe_shared_expert_gate=bool(shared),
        moe_router_dtype=None,
        moe_load_balancing="none",
        moe_aux_loss_coeff=0.0,
    )


def build_gpt_from_hf(
    config_or_path: Any,
    *,
    tp: int | None = None,
    pp: int | None = None,
    dtype: str | None = None,
    layer_spec: Any = None,
    head: str = "lm",
    **overrides: Any,
) -> list[nn.Module]:
    """This rank's chunks of a Megatron ``GPTModel`` configured like a Hugging Face checkpoint.

    ``head="value"``: the value model of the same trunk (:func:`fnppo.build_gpt`'s ``head``), to be
    filled by :func:`load_hf_weights` from a value or reward model (``*ForTokenClassification`` /
    ``*ForSequenceClassification``, ``num_labels=1``: trunk and head) or from a policy checkpoint
    (the trunk; the head stays fresh, ``lm_head`` is skipped). A classifier's config needs
    ``head="value"``.

    ``model_config_from_hf(config_or_path, **overrides)`` (``dtype``: ``"fp32"``/``"bf16"``/``"fp16"``,
    default the checkpoint's) built with :func:`fnppo.megatron.model.build_gpt` for the current Megatron
    layout (call inside :func:`fnppo.init_parallel`). ``tp``/``pp``, if given, must equal the
    current layout's sizes. ``layer_spec`` defaults to
    ``fnppo.megatron.attention.default_layer_spec(cfg)`` (Transformer Engine's spec when installed, else the
    local spec; RMSNorm, and q/k norms for Qwen3, from the config). Weights are random: load them
    with :func:`load_hf_weights`.
    """
    fn = "fnppo.io.hf.build_gpt_from_hf"
    layout = current_layout()
    for name, want, have in (("tp", tp, layout.tp), ("pp", pp, layout.pp)):
        if want is not None and want != have:
            raise input_error(fn, name, f"{have} (the current Megatron layout; set it with fnppo.init_parallel)", repr(want))
    if dtype is not None:
        overrides["dtype"] = dtype
    hf = _read_hf_config(fn, "config_or_path", config_or_path)
    cfg = model_config_from_hf(hf, **overrides)
    described = _checkpoint_head(fn, hf["model_type"], hf, "config")
    if described is not None and described.kind != "lm" and head != "value":
        raise input_error(fn, "head", f"'value' for a {hf['architectures'][0]} checkpoint (its score head is a value head; it has no lm_head)", repr(head))
    chunks = build_gpt(cfg, head=head, layer_spec=layer_spec, layout=layout)
    for chunk in chunks:  # which family's tensor names the model has (Qwen2-MoE and Mixtral can look alike)
        unwrap_model(chunk).fnppo_hf_family = hf["model_type"]
    return chunks


# ---------------------------------------------------------------------------------------------
# The architecture of a built model, and the HF tensors it corresponds to
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Arch:
    num_layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    padded_vocab: int
    qkv_bias: bool
    qk_norm: bool
    tied: bool  # the checkpoint's tie_word_embeddings (a value model keeps no output layer either way)
    value: bool = False  # a value model: its head is a classifier's score (or fresh on a policy's trunk)
    family: str = "llama"
    moe_layers: tuple[int, ...] = ()  # global indices of the MoE layers (none: a dense model)
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    shared: int = 0  # shared-expert hidden size (0: none)
    pre_softmax: bool = False


def _family_of(core: nn.Module, c: Any, moe_layers: Sequence[int]) -> str:
    """The Hugging Face family of a built model: the one ``build_gpt_from_hf`` recorded, else the one
    its architecture implies (an MoE model without q/k norm, bias, shared expert or dense layers: Mixtral)."""
    recorded = getattr(core, "fnppo_hf_family", None)
    if recorded in SUPPORTED_ARCHITECTURES:
        return recorded
    if not moe_layers:
        return "qwen3" if c.qk_layernorm else "qwen2" if c.add_qkv_bias else "llama"
    if c.qk_layernorm:
        return "qwen3_moe"
    if c.add_qkv_bias or c.moe_shared_expert_intermediate_size or len(moe_layers) < c.num_layers:
        return "qwen2_moe"
    return "mixtral"


def _arch(fn: str, model_chunks: Sequence[nn.Module]) -> _Arch:
    if not model_chunks:
        raise input_error(fn, "model_chunks", "a non-empty list of model chunks", "an empty list")
    core = unwrap_model(model_chunks[0])
    c = getattr(core, "config", None)
    if c is None or not hasattr(core, "decoder"):
        raise input_error(fn, "model_chunks", "Megatron GPTModel chunks", type(core).__name__)
    checks = [
        ("config.gated_linear_unit", c.gated_linear_unit, True),
        ("config.normalization", c.normalization, "RMSNorm"),
        ("config.add_bias_linear", c.add_bias_linear, False),
        ("config.multi_latent_attention", c.multi_latent_attention, False),
        ("position_embedding_type", getattr(core, "position_embedding_type", "rope"), "rope"),
    ]
    from fnppo.megatron.routing import moe_layer_indices

    moe_layers = tuple(moe_layer_indices(c)) if c.num_moe_experts else ()
    family = _family_of(core, c, moe_layers)
    shared = int(c.moe_shared_expert_intermediate_size or 0) if moe_layers else 0
    if moe_layers:  # the router options these families have (module docstring)
        checks += [
            ("config.moe_router_score_function", c.moe_router_score_function, "softmax"),
            ("config.moe_router_enable_expert_bias", c.moe_router_enable_expert_bias, False),
            ("config.moe_router_num_groups", c.moe_router_num_groups, None),
            ("config.moe_router_topk_scaling_factor", c.moe_router_topk_scaling_factor, None),
            ("config.moe_shared_expert_gate", bool(c.moe_shared_expert_gate), bool(shared)),
        ]
        if family == "mixtral":
            checks.append(("config.moe_router_pre_softmax", c.moe_router_pre_softmax, False))
    for name, have, want in checks:
        if have != want:
            raise input_error(fn, f"model_chunks[0].{name}", f"{want!r} (Llama/Qwen/Mixtral layout)", repr(have))
    groups = c.num_query_groups or c.num_attention_heads
    value = model_head(core) == "value"
    return _Arch(
        num_layers=c.num_layers,
        hidden=c.hidden_size,
        heads=c.num_attention_heads,
        groups=groups,
        head_dim=c.kv_channels,
        ffn=c.ffn_hidden_size,
        padded_vocab=core.vocab_size,
        qkv_bias=bool(c.add_qkv_bias),
        qk_norm=bool(c.qk_layernorm),
        tied=bool(getattr(core, "fnppo_config", c).tie_embeddings) if value else bool(core.share_embeddings_and_output_weights),
        value=value,
        family=family,
        moe_layers=moe_layers,
        experts=int(c.num_moe_experts or 0),
        topk=int(c.moe_router_topk) if moe_layers else 0,
        moe_ffn=int(c.moe_ffn_hidden_size or 0) if moe_layers else 0,
        shared=shared,
        pre_softmax=bool(c.moe_router_pre_softmax) if moe_layers else False,
    )


def _expected_hf(a: _Arch, vocab: int, head: str | tuple[str, str | None] | None = None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the HF checkpoint of architecture ``a``.

    ``head``: ``"lm"`` (``lm_head.weight`` unless tied) or a value head's ``(weight name, bias name
    or None)`` (``[1, hidden]`` and ``[1]``; :data:`VALUE_HEAD_LAYOUTS`); default: ``score.weight``
    and ``score.bias`` for a value model, ``"lm"`` otherwise."""
    H, d = a.hidden, a.head_dim
    head = head or (VALUE_HEAD_LAYOUTS["score"] if a.value else "lm")
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, H), "model.norm.weight": (H,)}
    if head == "lm" and not a.tied:
        out["lm_head.weight"] = (vocab, H)
    if head != "lm":
        out[head[0]] = (1, H)
        if head[1] is not None:
            out[head[1]] = (1,)
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        out[p + "self_attn.q_proj.weight"] = (a.heads * d, H)
        out[p + "self_attn.k_proj.weight"] = (a.groups * d, H)
        out[p + "self_attn.v_proj.weight"] = (a.groups * d, H)
        if a.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (a.heads * d,)
            out[p + "self_attn.k_proj.bias"] = (a.groups * d,)
            out[p + "self_attn.v_proj.bias"] = (a.groups * d,)
        out[p + "self_attn.o_proj.weight"] = (H, a.heads * d)
        if a.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        if i in a.moe_layers:
            out.update(_expected_moe(a, p))
            continue
        out[p + "mlp.gate_proj.weight"] = (a.ffn, H)
        out[p + "mlp.up_proj.weight"] = (a.ffn, H)
        out[p + "mlp.down_proj.weight"] = (H, a.ffn)
    return out


def _expert_names(a: _Arch) -> tuple[str, tuple[str, str, str]]:
    """(the MoE block's prefix, the (gate, up, down) projection names of an expert) of the family."""
    if a.family == "mixtral":
        return "block_sparse_moe.", ("w1.weight", "w3.weight", "w2.weight")
    return "mlp.", ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _expected_moe(a: _Arch, p: str) -> dict[str, tuple[int, ...]]:
    """The HF tensors of one MoE layer (prefix ``p``): router, experts, shared expert and its gate."""
    H, I = a.hidden, a.moe_ffn
    block, (gate, up, down) = _expert_names(a)
    out: dict[str, tuple[int, ...]] = {p + block + "gate.weight": (a.experts, H)}
    for j in range(a.experts):
        e = f"{p}{block}experts.{j}."
        out.update({e + gate: (I, H), e + up: (I, H), e + down: (H, I)})
    if a.shared:
        e = p + "mlp.shared_expert."
        out.update({e + "gate_proj.weight": (a.shared, H), e + "up_proj.weight": (a.shared, H), e + "down_proj.weight": (H, a.shared),
                    p + "mlp.shared_expert_gate.weight": (1, H)})
    return out


def hf_tensor_shapes(model_chunks: Sequence[nn.Module], vocab_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the Hugging Face tensors of the whole model (all ranks' shards together),
    as :func:`export_hf_weights` writes them (a value model: the ``*ForTokenClassification`` layout,
    ``score.weight`` and ``score.bias``).

    ``vocab_size``: the checkpoint's vocabulary (defaults to the model's padded vocabulary).
    """
    a = _arch("fnppo.io.hf.hf_tensor_shapes", model_chunks)
    return _expected_hf(a, a.padded_vocab if vocab_size is None else vocab_size)


# Megatron parameter (layer-relative, or top-level) -> (kind, HF names (layer-relative or absolute)).
_LAYER_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("copy", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("copy", ("input_layernorm.weight",)),
    "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("copy", ("post_attention_layernorm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    "self_attention.linear_proj.weight": ("copy", ("self_attn.o_proj.weight",)),
    "self_attention.q_layernorm.weight": ("copy", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("copy", ("self_attn.k_norm.weight",)),
    "mlp.linear_fc1.weight": ("gated", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("copy", ("mlp.down_proj.weight",)),
}
_TOP_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": ("copy", ("model.norm.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
}
_VALUE_HEAD_RULES: dict[str, tuple[str, tuple[str, ...]]] = {  # a value model's last stage (replicated over TP)
    "value_head.weight": ("copy", ("score.weight",)),
    "value_head.bias": ("copy", ("score.bias",)),
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


_EXPERT_RE = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")


def _moe_rule(a: _Arch, prefix: str, rest: str) -> tuple[str, tuple[str, ...]] | None:
    """The rule of an MoE layer's parameter (``rest``: relative to the layer), or None."""
    block, (gate, up, down) = _expert_names(a)
    if rest == "mlp.router.weight":
        return "copy", (prefix + block + "gate.weight",)
    m = _EXPERT_RE.match(rest)
    if m:
        j, fc = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(4), m.group(3))
        e = f"{prefix}{block}experts.{j}."
        return ("gated", (e + gate, e + up)) if fc == "linear_fc1" else ("copy", (e + down,))
    shared = {
        "mlp.shared_experts.linear_fc1.weight": ("gated", ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")),
        "mlp.shared_experts.linear_fc2.weight": ("copy", ("mlp.shared_expert.down_proj.weight",)),
        "mlp.shared_experts.gate_weight": ("copy", ("mlp.shared_expert_gate.weight",)),
    }.get(rest)
    return None if shared is None else (shared[0], tuple(prefix + n for n in shared[1]))


def _rule(fn: str, a: _Arch, gname: str) -> tuple[str, tuple[str, ...]]:
    """How the (global) Megatron parameter ``gname`` is made of HF tensors."""
    m = _LAYER_RE.match(gname)
    if m and int(m.group(1)) in a.moe_layers:
        rule = _moe_rule(a, f"model.layers.{m.group(1)}.", m.group(2))
        if rule is not None:
            return rule
    if m:
        rule = _LAYER_RULES.get(m.group(2))
        if rule is not None:
            prefix = f"model.layers.{m.group(1)}."
            return rule[0], tuple(prefix + s for s in rule[1])
    elif a.value and gname in _VALUE_HEAD_RULES:
        return _VALUE_HEAD_RULES[gname]
    elif gname in _TOP_RULES:
        kind, names = _TOP_RULES[gname]
        if gname == "output_layer.weight" and a.tied:
            names = ("model.embed_tokens.weight",)
        return kind, names
    raise input_error(fn, "model_chunks", f"parameters of a {SUPPORTED_ARCHITECTURES[a.family]} GPTModel", f"a parameter {gname!r} with no Hugging Face counterpart")


# ---------------------------------------------------------------------------------------------
# Reading this rank's shard from HF tensors
# ---------------------------------------------------------------------------------------------
def _split(param: Tensor, tp: int) -> tuple[int | None, int]:
    """(partition dim or None, tp) for a parameter."""
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim), tp
    return None, 1


def _take(read: Any, name: str, dim: int | None, lo: int, hi: int, ndim: int) -> Tensor:
    if dim is None:
        return read(name, None)
    idx = [slice(None)] * ndim
    idx[dim] = slice(lo, hi)
    return read(name, tuple(idx))


def _read_shard(read: Any, a: _Arch, kind: str, names: tuple[str, ...], param: Tensor, tp: int, tp_rank: int, vocab: int) -> Tensor:
    """This rank's shard of one Megatron parameter, reading only the needed HF slices."""
    dim, n = _split(param, tp)
    r = tp_rank if n > 1 else 0
    if kind == "zero":
        return torch.zeros_like(param, device="cpu")
    if kind == "copy":
        if dim is None:
            return read(names[0], None)
        size = param.shape[dim]
        return _take(read, names[0], dim, r * size, (r + 1) * size, param.dim())
    if kind == "vocab":  # rows [r*s, (r+1)*s) of the padded vocabulary; padding rows are zero
        size = param.shape[0]
        lo, hi = r * size, (r + 1) * size
        part = read(names[0], (slice(lo, min(hi, vocab)), slice(None))) if lo < vocab else param.new_zeros(0, a.hidden)
        if part.shape[0] < size:
            part = torch.cat([part, part.new_zeros(size - part.shape[0], a.hidden)], 0)
        return part
    if kind == "gated":
        size = param.shape[0] // 2
        lo, hi = (r * size, (r + 1) * size) if dim is not None else (0, size)
        return torch.cat([_take(read, nm, 0, lo, hi, param.dim()) for nm in names], 0)
    if kind == "qkv":
        d, per = a.head_dim, a.heads // a.groups
        local_groups = a.groups // n
        g0 = r * local_groups
        q = _take(read, names[0], 0, g0 * per * d, (g0 + local_groups) * per * d, param.dim())
        k = _take(read, names[1], 0, g0 * d, (g0 + local_groups) * d, param.dim())
        v = _take(read, names[2], 0, g0 * d, (g0 + local_groups) * d, param.dim())
        rest = tuple(q.shape[1:])
        fused = torch.cat(
            [q.reshape(local_groups, per * d, *rest), k.reshape(local_groups, d, *rest), v.reshape(local_groups, d, *rest)], 1
        )
        return fused.reshape(local_groups * (per + 2) * d, *rest)
    raise AssertionError(kind)


def _shard_files(fn: str, path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise input_error(fn, "path", "a local checkpoint directory or a .safetensors file", repr(str(path)))
    index = path / _INDEX
    if index.is_file():
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (path / f).is_file():
                raise input_error(fn, "path", f"the shard {f!r} listed in {_INDEX}", "no such file")
        return [path / f for f in files]
    if (path / _SINGLE).is_file():
        return [path / _SINGLE]
    raise input_error(fn, "path", f"a directory holding {_SINGLE} or {_INDEX}", f"{str(path)!r} without them")


# ---------------------------------------------------------------------------------------------
# The checkpoint's own config.json against the model it is loaded into
# ---------------------------------------------------------------------------------------------
_FULL_ATTENTION = ("sliding_window", "use_sliding_window", "layer_types")


def _model_fields(core: nn.Module, a: _Arch) -> dict[str, Any]:
    """What the model was built for, in the keys of a Hugging Face ``config.json``.

    Rope and vocabulary come from the :class:`ModelConfig` that :func:`fnppo.megatron.model.build_gpt`
    keeps on the model (``fnppo_config``); a model built otherwise is compared on the rest.
    """
    family = a.family
    c, mc = core.config, getattr(core, "fnppo_config", None)
    out: dict[str, Any] = {
        "model_type": family, "architectures": [SUPPORTED_ARCHITECTURES[family]],
        "num_hidden_layers": a.num_layers, "hidden_size": a.hidden, "intermediate_size": a.ffn,
        "num_attention_heads": a.heads, "num_key_value_heads": a.groups, "head_dim": a.head_dim,
        "hidden_act": "silu", "mlp_bias": False, "rms_norm_eps": float(c.layernorm_epsilon),
        "tie_word_embeddings": a.tied, "sliding_window": getattr(c, "window_size", None), "use_sliding_window": False,
        "layer_types": ["full_attention"] * a.num_layers,
    }
    if family not in ("qwen2", "qwen2_moe"):
        out["attention_bias"] = False  # Qwen2's q/k/v bias is part of its family
    if a.value:  # a policy's trunk or a classifier's trunk and head: _checkpoint_head checks which
        del out["architectures"]
    if family == "mixtral":
        out.update(intermediate_size=a.moe_ffn, num_experts=a.experts, num_experts_per_tok=a.topk, router_jitter_noise=0.0)
    elif family in MOE_FAMILIES:
        out.update(num_experts=a.experts, num_experts_per_tok=a.topk, moe_intermediate_size=a.moe_ffn, norm_topk_prob=not a.pre_softmax,
                   dense_layers=[i for i in range(a.num_layers) if i not in a.moe_layers])
        if family == "qwen2_moe":
            out.update(qkv_bias=a.qkv_bias, shared_expert_intermediate_size=a.shared)
    if mc is not None:
        out.update(vocab_size=mc.vocab_size, rope_theta=float(mc.rotary_base), partial_rotary_factor=float(mc.rotary_percent),
                   rope_type="llama3" if mc.rope_scaling else "default")
        if mc.rope_scaling:
            out.update(factor=float(mc.rope_scaling_factor), **_LLAMA3_FIXED)
    return out


def _file_rope_fields(hf: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], Any]]:
    """Rope entries of a config as ``(field, key path in the file, value)``: transformers 5's
    ``rope_parameters`` or transformers 4's ``rope_theta`` / ``rope_scaling``, named as the file has them."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        where, scaling = "rope_parameters", params
        theta = (("rope_parameters", "rope_theta"), params["rope_theta"]) if "rope_theta" in params else (("rope_theta",), hf.get("rope_theta") or 10000.0)
    else:
        where, scaling = "rope_scaling", hf.get("rope_scaling") or {}
        theta = (("rope_theta",), hf.get("rope_theta") or 10000.0)
    type_key = "type" if "type" in scaling and "rope_type" not in scaling else "rope_type"
    rope_type = scaling.get(type_key) or "default"
    out = [("rope_theta", theta[0], theta[1]), ("rope_type", (where, type_key), rope_type)]
    if rope_type == "llama3":
        out += [(k, (where, k), scaling.get(k, _LLAMA3_FIXED.get(k))) for k in ("factor", *_LLAMA3_FIXED)]
    partial = hf.get("partial_rotary_factor") or scaling.get("partial_rotary_factor")
    out.append(("partial_rotary_factor", ("partial_rotary_factor",), 1.0 if partial is None else partial))
    return out


def _file_fields(hf: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], Any]]:
    """The architecture entries of a ``config.json`` as ``(field, key path in the file, value)``, in
    the order they are reported (family first); absent keys take transformers' defaults."""
    family = hf.get("model_type")
    out: list[tuple[str, tuple[str, ...], Any]] = [("model_type", ("model_type",), family)]
    if hf.get("architectures") is not None:
        out.append(("architectures", ("architectures",), list(hf["architectures"])))
    if family in _QWEN:
        out.append(("use_sliding_window", ("use_sliding_window",), bool(hf.get("use_sliding_window") or False)))
    else:
        out.append(("sliding_window", ("sliding_window",), hf.get("sliding_window")))
    if hf.get("layer_types") is not None:
        out.append(("layer_types", ("layer_types",), list(hf["layer_types"])))
    out += _file_rope_fields(hf)
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        if key in hf:
            out.append((key, (key,), hf[key]))
    if isinstance(hf.get("hidden_size"), int) and isinstance(hf.get("num_attention_heads"), int):
        out.append(("head_dim", ("head_dim",), hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]))
    out += [
        ("rms_norm_eps", ("rms_norm_eps",), hf.get("rms_norm_eps", 1e-6)),
        ("tie_word_embeddings", ("tie_word_embeddings",), bool(hf.get("tie_word_embeddings") or False)),
        ("hidden_act", ("hidden_act",), hf.get("hidden_act", "silu")),
        ("mlp_bias", ("mlp_bias",), bool(hf.get("mlp_bias") or False)),
        ("attention_bias", ("attention_bias",), bool(hf.get("attention_bias") or False)),
    ]
    if family in MOE_FAMILIES:
        out += _file_moe_fields(family, hf)
    return out


def _file_moe_fields(family: str, hf: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], Any]]:
    """The MoE entries of a ``config.json`` (absent keys: transformers' defaults, or left out)."""
    experts = _experts_key(family, hf)
    keys = {"num_experts": experts, "num_experts_per_tok": "num_experts_per_tok"}
    if family != "mixtral":
        keys["moe_intermediate_size"] = "moe_intermediate_size"
    out = [(field, (key,), hf[key]) for field, key in keys.items() if key in hf]
    if family == "mixtral":
        return out + [("router_jitter_noise", ("router_jitter_noise",), float(hf.get("router_jitter_noise") or 0.0))]
    out.append(("norm_topk_prob", ("norm_topk_prob",), bool(hf.get("norm_topk_prob") or False)))
    if isinstance(hf.get("num_hidden_layers"), int):
        moe = _hf_moe_layers(family, hf)
        out.append(("dense_layers", ("mlp_only_layers",), [i for i in range(hf["num_hidden_layers"]) if i not in moe]))
    if family == "qwen2_moe":
        out += [("qkv_bias", ("qkv_bias",), bool(hf.get("qkv_bias", True))),
                ("shared_expert_intermediate_size", ("shared_expert_intermediate_size",), int(hf.get("shared_expert_intermediate_size") or 0))]
    return out


def _same(want: Any, have: Any) -> bool:
    numbers = (int, float)
    if isinstance(want, numbers) and isinstance(have, numbers) and not isinstance(want, bool) and not isinstance(have, bool):
        return float(want) == float(have)
    return want == have


def _check_hf_config(fn: str, core: nn.Module, a: _Arch, hf: Mapping[str, Any], label: str, where: str) -> _Head | None:
    """Refuse a Hugging Face config whose architecture differs from the model's, naming every differing
    key (as the file spells it) with both values. ``label``: how the argument is named. Returns the
    head the config describes (:func:`_checkpoint_head`; a language model's is ``lm``)."""
    model = _model_fields(core, a)
    diffs = [(path, model[field], have, field) for field, path, have in _file_fields(hf)
             if field in model and not _same(model[field], have)]
    if not diffs:
        return _checkpoint_head(fn, a.family, hf, label)
    path, want, have, field = diffs[0]
    why = ": full attention" if field in _FULL_ATTENTION else ""
    others = "".join(
        f"; also differs: {p[0]}{''.join(f'[{k!r}]' for k in p[1:])}: {h!r} (model: {w!r})" for p, w, h, _ in diffs[1:]
    )
    raise input_error(fn, label + "".join(f"[{k!r}]" for k in path), f"{want!r} (what the model was built for{why})",
                      f"{have!r} ({where}{others})")


def _config_path(root: Path) -> Path:
    return root / "config.json" if root.is_dir() else root.parent / "config.json"


def _check_tied_head(fn: str, a: _Arch, read: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """A tied model ignores a stored ``lm_head.weight`` only if it equals the embedding (transformers
    unties the two when they differ: loading such a checkpoint tied would give other logits)."""
    name, emb = "lm_head.weight", "model.embed_tokens.weight"
    if not a.tied or a.value or name not in shapes:  # a value model skips lm_head
        return
    rows, worst = shapes[emb][0], 0.0
    for r0 in range(0, rows, 4096):  # a few thousand rows at a time, on every rank (all agree)
        index = (slice(r0, min(rows, r0 + 4096)), slice(None))
        x, y = read(name, index).double(), read(emb, index).double()
        if not torch.equal(x, y):
            worst = max(worst, float((x - y).abs().nan_to_num(float("inf")).max()))
    if worst > 0:
        raise input_error(
            fn, f"checkpoint[{name!r}]",
            f"absent or equal to {emb!r} (the model ties them; transformers would untie them and use both: to do "
            f"the same, set tie_word_embeddings to false in config.json and rebuild the model; to keep them tied, "
            f"delete {name!r} from the checkpoint)",
            f"a different tensor (max |difference| {worst:.3g})",
        )


def _checkpoint_vocab(path: Path, shapes: Mapping[str, Sequence[int]]) -> int:
    cfg = path / "config.json" if path.is_dir() else path.parent / "config.json"
    if cfg.is_file():
        with open(cfg, encoding="utf-8") as fh:
            v = json.load(fh).get("vocab_size")
        if isinstance(v, int):
            return v
    emb = shapes.get("model.embed_tokens.weight")
    return int(emb[0]) if emb else -1


def load_hf_weights(model_chunks: Sequence[nn.Module], path: str | os.PathLike) -> list[str]:
    """Load a Hugging Face safetensors checkpoint into this rank's TP/PP shard of the model.

    A value model (``build_gpt_from_hf(path, head="value")``) loads a value or reward model whole:
    a checkpoint whose ``config.json`` names ``<Family>ForTokenClassification`` or
    ``<Family>ForSequenceClassification`` with ``num_labels=1`` (or, without a ``config.json``,
    one that holds ``score.weight``) fills the trunk and the value head (``score.weight`` ``[1,
    hidden]`` -> ``value_head.weight``, ``score.bias`` -> ``value_head.bias``, zero where the
    checkpoint has none: sequence classifiers, ``token_classification_bias=false``), on every TP
    rank of the last pipeline stage (the head is replicated there). From a policy checkpoint
    (``*ForCausalLM``) it gets the trunk (embedding, layers, final norm) only: its value head keeps
    its fresh weights and the checkpoint's ``lm_head.weight`` (when stored) is skipped. Critics of
    other RL stacks (:data:`VALUE_HEAD_LAYOUTS`, :func:`_value_head`): TRL's
    ``AutoModelForCausalLMWithValueHead`` (a ``*ForCausalLM`` config with ``v_head.summary.weight``
    / ``.bias``; its ``lm_head.weight`` skipped), OpenRLHF's ``CriticModel`` / ``RewardModel``
    (``<value_head_prefix>.weight``, no bias; ``normalize_reward: true`` folds
    ``(v - mean) / std`` into the head), verl's Megatron critic (a ``*ForCausalLM`` config with a
    one-row ``lm_head.weight``). Returns the
    names of the checkpoint's tensors that were not loaded (sorted): that ``lm_head.weight``, a tied
    model's stored copy of the embedding, ``*.rotary_emb.inv_freq`` buffers.

    ``path``: a local directory with ``model.safetensors`` or ``model.safetensors.index.json`` and
    its shards (or one ``.safetensors`` file). Names and layouts are converted as in the module
    docstring (fused QKV in Megatron's per-group order, fused ``[gate; up]``).

    First the checkpoint's ``config.json`` (beside the shards), when present, must describe the
    architecture the model was built for: family (``model_type``, ``architectures``), sizes,
    ``head_dim``, ``vocab_size`` (the real one), ``rms_norm_eps``, rope (``rope_parameters`` of
    transformers 5 or ``rope_theta`` / ``rope_scaling``: type, theta, llama3 factors),
    ``partial_rotary_factor``, no sliding window (``sliding_window``, ``use_sliding_window``,
    ``layer_types``), ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``, ``hidden_act``,
    and for a value model the head (``architectures``; a classifier's ``id2label`` / ``num_labels``
    must give one label); a difference raises ``InputError`` naming the key as the file spells it,
    the model's value and the file's (and every other differing key). Then every tensor name, shape and dtype of the
    checkpoint is checked against the whole model (all layers, all ranks) from the safetensors
    headers alone: a missing tensor, an unexpected one (``*.rotary_emb.inv_freq`` buffers are
    tolerated and ignored), a wrong shape, a non-floating dtype raise ``InputError`` naming the
    tensor, and nothing is loaded. A tied model refuses a stored ``lm_head.weight`` unless it
    equals ``model.embed_tokens.weight`` (transformers would untie the two; the error names both
    ways out: an untied model, or dropping the tensor). Then each parameter of each chunk is filled from only the rows/columns this
    rank holds (one parameter in host memory at a time), cast to the parameter's dtype. Vocabulary
    rows beyond the checkpoint's ``vocab_size`` (``make_vocab_size_divisible_by`` padding) are zero.
    Not a collective: every rank reads on its own. Build the optimizer after loading (half-precision
    optimizers keep fp32 copies of the parameters).
    """
    from safetensors import safe_open

    fn = "fnppo.io.hf.load_hf_weights"
    a = _arch(fn, model_chunks)
    layout = current_layout()
    root = Path(path)
    files = _shard_files(fn, root)
    cfg_file = _config_path(root)
    described, hf = None, None
    if cfg_file.is_file():
        hf = _read_hf_config(fn, "path", cfg_file)
        described = _check_hf_config(fn, unwrap_model(model_chunks[0]), a, hf, "config.json", f"in {cfg_file}")
    with ExitStack() as stack:
        where: dict[str, Any] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            handle = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for name in handle.keys():
                if name in where:
                    raise input_error(fn, "path", "each tensor stored once", f"{name!r} in two shards")
                sl = handle.get_slice(name)
                dtype = sl.get_dtype()
                if dtype not in _FLOAT_DTYPES:
                    raise input_error(fn, f"checkpoint[{name!r}]", f"a floating dtype ({', '.join(sorted(_FLOAT_DTYPES))})", dtype)
                where[name] = handle
                shapes[name] = tuple(int(s) for s in sl.get_shape())

        vocab = _checkpoint_vocab(root, shapes)
        if vocab > a.padded_vocab or vocab < 1:
            raise input_error(fn, "checkpoint['model.embed_tokens.weight']", f"at most {a.padded_vocab} rows (the model's vocabulary)", f"vocab_size {vocab}")
        built = getattr(unwrap_model(model_chunks[0]), "fnppo_config", None)
        if built is not None and vocab != built.vocab_size:  # rows beyond it would be taken for real tokens
            raise input_error(fn, "checkpoint['model.embed_tokens.weight']", f"{built.vocab_size} rows (the model's vocab_size)", f"{vocab} rows")
        value_head = _value_head(fn, a, described, hf, shapes, vocab)
        expected = _expected_hf(a, vocab, "lm" if value_head is None else value_head.names)
        head_names = () if value_head is None else value_head.names
        for name in sorted(expected, key=lambda n: (n not in head_names[:1], n)):  # the head's weight first (its labels)
            if name not in shapes:
                raise input_error(fn, "path", f"a tensor named {name!r}", f"a checkpoint without it ({len(shapes)} tensors in {str(root)!r})")
            if shapes[name] != expected[name]:
                note = " (num_labels=1: one value per token)" if name in head_names else ""
                raise input_error(fn, f"checkpoint[{name!r}]", f"shape {expected[name]}{note}", f"shape {shapes[name]}")
        # a language model's lm_head where the model ties it (checked below), a value model's skipped
        # lm_head: a policy's or, beside TRL's v_head, its causal LM's
        lm_rows = value_head is None or value_head.layout == "v_head.summary"
        tolerated = {"lm_head.weight": expected.get("lm_head.weight", (vocab, a.hidden))} if lm_rows else {}
        for name in sorted(shapes):
            if name in expected or name.endswith(".rotary_emb.inv_freq"):
                continue
            if name in tolerated and shapes[name] == tolerated[name]:
                continue
            hint = " (a value or reward model's head: load it into build_gpt_from_hf(path, head='value'))" if name.startswith("score.") and not a.value else ""
            raise input_error(fn, "path", "only the tensors of the model's architecture", f"an unexpected tensor {name!r} of shape {shapes[name]}{hint}")

        plan: list[tuple[Tensor, str, tuple[str, ...]]] = []
        for chunk in model_chunks:
            core = unwrap_model(chunk)
            for name, param in core.named_parameters():
                gname = _global_name(core, name)
                kind, names = _rule(fn, a, gname)
                if a.value and gname in _VALUE_HEAD_RULES:
                    if value_head is None:  # a policy's trunk: the value head stays as built
                        continue
                    stored = value_head.names[gname == "value_head.bias"]
                    kind, names = ("head", (stored,)) if stored is not None else ("zero", ())
                plan.append((param, kind, names))

        def read(name: str, index: tuple[slice, ...] | None) -> Tensor:
            sl = where[name].get_slice(name)
            return sl[:] if index is None else sl[index]

        _check_tied_head(fn, a, read, shapes)

        with torch.no_grad():
            for param, kind, names in plan:
                if kind in ("head", "zero") and value_head is not None:  # the value head, with its normalisation
                    shard = torch.zeros(param.shape, dtype=torch.float64) if kind == "zero" else read(names[0], None).double()
                    is_bias = param.dim() == 1
                    shard = shard * value_head.scale + (value_head.shift if is_bias else 0.0)
                else:
                    shard = _read_shard(read, a, kind, names, param, *_tp_of(param, layout), vocab)
                if tuple(shard.shape) != tuple(param.shape):  # cannot happen after the checks above
                    raise AssertionError(f"{fn}: shard of {names} has shape {tuple(shard.shape)}, parameter {tuple(param.shape)}")
                param.copy_(shard.to(dtype=param.dtype, device=param.device))
                del shard
    skipped = {"lm_head.weight"} if a.value and (value_head is None or value_head.layout != "lm_head") else set()
    loaded = set(expected) - skipped  # by the whole model (all ranks)
    return sorted(set(shapes) - loaded)


@dataclasses.dataclass(frozen=True)
class _ValueHead:
    """How a value model's head is read from a checkpoint: ``values = scale * (w . h + b) + shift``
    with ``w``, ``b`` the tensors ``names`` (``b = 0`` where there is none) of layout ``layout``
    (a key of :data:`VALUE_HEAD_LAYOUTS`, or ``"openrlhf"`` for a ``value_head_prefix`` of its own);
    loaded as ``value_head.weight = scale * w``, ``value_head.bias = scale * b + shift``."""

    layout: str
    names: tuple[str, str | None]
    scale: float = 1.0
    shift: float = 0.0


def _value_head(fn: str, a: _Arch, described: _Head | None, hf: Mapping[str, Any] | None,
                shapes: Mapping[str, tuple[int, ...]], vocab: int) -> _ValueHead | None:
    """The value head a checkpoint holds (``None``: a language model, or a policy's trunk only).

    With a ``config.json``: a classifier's ``score`` (with ``score.bias`` as the config says);
    OpenRLHF's ``CriticModel`` / ``RewardModel``: ``<value_head_prefix>.weight`` (the config's
    ``value_head_prefix``, else whichever of ``score.weight`` / ``value_head.weight`` is stored) and
    its reward normalisation (below); a ``*ForCausalLM``: TRL's ``v_head.summary.*`` or verl's
    ``lm_head.weight`` of one row when stored, else the trunk only. Without one: the one of those
    heads the tensors hold. OpenRLHF with ``normalize_reward: true`` computes
    ``(w . h - mean) / std`` (``mean``, ``std`` from ``config.json``, 0 and 1 where absent; its
    ``mean``/``std`` buffers are not saved): folded into the head, ``scale = 1 / std``,
    ``shift = -mean / std``; with ``normalize_reward`` false or absent it computes ``w . h`` and
    so does the value model.

    Raises:
        InputError: two candidate heads (naming them and the way to choose), a ``value_head_prefix``
            that is not a name, a ``mean`` / ``std`` that is not a finite number (``std > 0``).
    """
    if not a.value:
        return None
    layouts = VALUE_HEAD_LAYOUTS
    if described is not None and described.kind in ("token", "sequence"):
        key = "score" if described.bias else "score-no-bias"
        return _ValueHead(key, layouts[key])
    if described is not None and described.kind == "openrlhf":
        assert hf is not None
        prefix = hf.get("value_head_prefix")
        if prefix is None:
            found = [p for p in ("score", "value_head") if f"{p}.weight" in shapes]
            if len(found) != 1:
                raise input_error(fn, "config.json['value_head_prefix']",
                                  "the name of OpenRLHF's value head (its --value_head_prefix: 'score' or 'value_head'), "
                                  "needed when the checkpoint does not hold exactly one of 'score.weight' / 'value_head.weight'",
                                  f"no such key, and {'both' if found else 'neither'} of them stored")
            prefix = found[0]
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", prefix):
            raise input_error(fn, "config.json['value_head_prefix']", "a module name such as 'score' or 'value_head'", repr(prefix))
        head = _ValueHead("openrlhf", (f"{prefix}.weight", None))
        if not hf.get("normalize_reward"):
            return head
        stats = {}
        for key, default in (("mean", 0.0), ("std", 1.0)):
            v = hf.get(key, default)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (key == "mean" or v > 0)
            if not ok:
                raise input_error(fn, f"config.json[{key!r}]",
                                  f"a finite number{' > 0' if key == 'std' else ''} (OpenRLHF's reward {key}: normalize_reward is true)", repr(v))
            stats[key] = float(v)
        return dataclasses.replace(head, scale=1.0 / stats["std"], shift=-stats["mean"] / stats["std"])
    # a *ForCausalLM config, or none: the heads recognised by their tensors
    found = []
    if described is None and "score.weight" in shapes:
        found.append("score" if "score.bias" in shapes else "score-no-bias")
    if described is None and "value_head.weight" in shapes:
        found.append("value_head")
    if "v_head.summary.weight" in shapes:
        found.append("v_head.summary")
    if vocab != 1 and shapes.get("lm_head.weight", (0,))[0] == 1:  # a language model's lm_head has vocab rows
        found.append("lm_head")
    if len(found) > 1:
        raise input_error(fn, "path", "one value head (one of: " + ", ".join(f"{layouts[k][0]!r}" for k in layouts if k != "score-no-bias") + ")",
                          "a checkpoint with " + " and ".join(repr(layouts[k][0]) for k in found))
    return _ValueHead(found[0], layouts[found[0]]) if found else None


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------
def _gather_tp(core: nn.Module, name: str, param: Tensor, layout: ParallelLayout) -> Tensor:
    """The full (1-rank) Megatron tensor of ``param``: all-gathered over its TP group (expert TP for
    experts; collective)."""
    import torch.distributed as dist

    t = param.detach()
    dim, n = _split(param, _tp_of(param, layout)[0])
    if dim is None:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=layout.etp_group if _is_expert(param) else layout.tp_group)
    if _is_gated_fc1(core, name):
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def _to_hf(a: _Arch, kind: str, names: tuple[str, ...], full: Tensor, vocab: int) -> dict[str, Tensor]:
    """HF tensors of one full Megatron tensor (the inverse of :func:`_read_shard` with tp=1)."""
    if kind == "copy":
        return {names[0]: full}
    if kind == "vocab":
        return {names[0]: full[:vocab]}
    if kind == "gated":
        gate, up = full.chunk(2, dim=0)
        return {names[0]: gate, names[1]: up}
    d, per = a.head_dim, a.heads // a.groups
    rest = tuple(full.shape[1:])
    grouped = full.reshape(a.groups, per + 2, d, *rest)
    return {
        names[0]: grouped[:, :per].reshape(a.heads * d, *rest),
        names[1]: grouped[:, per].reshape(a.groups * d, *rest),
        names[2]: grouped[:, per + 1].reshape(a.groups * d, *rest),
    }


def _write_hf_config(path: Path, hf_config: Any) -> None:
    if hasattr(hf_config, "save_pretrained"):
        hf_config.save_pretrained(str(path))
        return
    cfg = _read_hf_config("fnppo.io.hf.export_hf_weights", "hf_config", hf_config)
    with open(path / "config.json", "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
        fh.write("\n")


def _check_config_matches(fn: str, core: nn.Module, a: _Arch, hf_config: Any) -> tuple[int, Any]:
    """Check that ``hf_config`` describes the model; returns its vocabulary size and the config to
    write (for a value model: :func:`_token_classification_config` of it)."""
    hf = _read_hf_config(fn, "hf_config", hf_config)
    described = _check_hf_config(fn, core, a, hf, "hf_config", "in hf_config")
    cfg = model_config_from_hf(hf)
    if cfg.vocab_size > a.padded_vocab:
        raise input_error(fn, "hf_config.vocab_size", f"at most {a.padded_vocab} (the model's)", repr(cfg.vocab_size))
    return cfg.vocab_size, _token_classification_config(a, hf, described) if a.value else hf_config


def _token_classification_config(a: _Arch, hf: Mapping[str, Any], described: _Head | None) -> dict[str, Any]:
    """A value model's ``config.json``: ``hf`` (a policy's, a value or reward model's) as transformers'
    ``<Family>ForTokenClassification`` with one label and a bias, the tensors export writes. The
    label count is stored both ways transformers reads it (``id2label``, ``num_labels``); a
    one-entry ``id2label`` of ``hf`` keeps its name."""
    out = dict(hf)
    out["architectures"] = [TOKEN_CLASSIFICATION_ARCHITECTURES[a.family]]
    labels = hf.get("id2label") if described is not None and described.kind in ("token", "sequence") else None
    name = str(next(iter(labels.values()))) if labels else "LABEL_0"
    out.update(num_labels=1, id2label={"0": name}, label2id={name: 0}, token_classification_bias=True)
    if described is not None and described.kind == "openrlhf":  # its head and normalisation are in the weights now
        for key in ("value_head_prefix", "normalize_reward", "mean", "std"):
            out.pop(key, None)
    return out


def export_hf_weights(
    model_chunks: Sequence[nn.Module],
    path: str | os.PathLike,
    *,
    hf_config: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write the model as a Hugging Face safetensors checkpoint (the inverse of :func:`load_hf_weights`).

    Collective over the whole world (call on every rank). Each tensor is all-gathered over its
    tensor-parallel group and converted to HF names and layouts (QKV split per group, ``[gate; up]``
    split, vocabulary padding dropped); the first data-parallel replica's tensor-parallel rank 0 of
    every pipeline stage writes its stage's tensors, and for MoE experts the first
    expert-data-parallel replica's expert-TP rank 0 of every expert-parallel rank writes its experts
    (at most one shard of ``max_shard_bytes`` in host memory per writing rank). Rank 0 then names the shards ``model.safetensors`` (one file) or
    ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, removes stale shards
    of that naming, and writes ``config.json`` from ``hf_config`` (a dict, a transformers config, or
    a ``config.json`` path / directory; checked against the model) if given. ``path`` must be on a
    file system all writing ranks see. ``dtype``: the stored dtype (default: the parameters').
    Tied embeddings store only ``model.embed_tokens.weight``.

    A value model (``head="value"``) is written as transformers' ``<Family>ForTokenClassification``
    with ``num_labels=1``: the trunk as above, ``score.weight`` ``[1, hidden]`` and ``score.bias``
    ``[1]`` from the value head (written by the last pipeline stage), and, from ``hf_config`` (the
    policy's or a value or reward model's config), a ``config.json`` naming that class with one
    label (``id2label``, ``label2id``, ``num_labels``) and ``token_classification_bias: true``:
    ``AutoModelForTokenClassification.from_pretrained(path)(ids).logits[..., 0]`` are the values.
    """
    import torch.distributed as dist
    from safetensors.torch import save_file

    fn = "fnppo.io.hf.export_hf_weights"
    a = _arch(fn, model_chunks)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise input_error(fn, "max_shard_bytes", "an int >= 1", repr(max_shard_bytes))
    vocab, written_config = (a.padded_vocab, None) if hf_config is None else _check_config_matches(fn, unwrap_model(model_chunks[0]), a, hf_config)
    layout = current_layout()
    out = Path(path)
    # (gathers, writes) for dense tensors and for experts (expert parallelism splits the experts)
    role = {False: (layout.dp_rank == 0, layout.dp_rank == 0 and layout.tp_rank == 0),
            True: (layout.edp_rank == 0, layout.edp_rank == 0 and layout.etp_rank == 0)}
    writer = role[False][1] or (bool(a.moe_layers) and role[True][1])
    if writer:
        out.mkdir(parents=True, exist_ok=True)

    written: list[tuple[str, list[str], int]] = []
    buffer: dict[str, Tensor] = {}
    buffered = 0

    def flush() -> None:
        nonlocal buffer, buffered
        if not buffer:
            return
        name = f".fnppo-export-r{layout.rank:05d}-{len(written):05d}.safetensors"
        save_file(buffer, str(out / name), metadata={"format": "pt"})
        written.append((name, sorted(buffer), buffered))
        buffer, buffered = {}, 0

    if writer or role[False][0] or role[True][0]:
        for chunk in model_chunks:
            core = unwrap_model(chunk)
            for name, param in core.named_parameters():
                gname = _global_name(core, name)
                kind, names = _rule(fn, a, gname)
                gathers, writes = role[_is_expert(param)]
                if (gname == "output_layer.weight" and a.tied) or not gathers:
                    continue
                full = _gather_tp(core, name, param, layout)
                if not writes:
                    continue
                for hf_name, t in _to_hf(a, kind, names, full, vocab).items():
                    t = t.detach().to(device="cpu", dtype=dtype or t.dtype).contiguous().clone()
                    size = t.numel() * t.element_size()
                    if buffer and buffered + size > max_shard_bytes:
                        flush()
                    buffer[hf_name] = t
                    buffered += size
                del full
        if writer:
            flush()

    everyone: list[Any] = [None] * layout.world_size
    dist.all_gather_object(everyone, (layout.pp_rank, layout.rank, written) if writer else None)
    parts = [f for item in sorted((x for x in everyone if x is not None), key=lambda x: x[:2]) for f in item[2]]
    names = [n for _, ns, _ in parts for n in ns]
    expected = _expected_hf(a, vocab)
    if sorted(names) != sorted(expected):  # every tensor exactly once (checked alike on every rank)
        dup = sorted(n for n, c in Counter(names).items() if c > 1)
        raise AssertionError(f"{fn}: exported {len(names)} tensors, expected {len(expected)} (duplicates: {dup[:4]})")
    error: list[str | None] = [None]
    if layout.rank == 0:
        try:
            _finalize_export(out, parts, written_config)
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            error[0] = f"{type(err).__name__}: {err}"
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise RuntimeError(f"{fn}: rank 0 failed to write {str(out)!r}: {error[0]}")


def _finalize_export(out: Path, parts: list[tuple[str, list[str], int]], hf_config: Any) -> None:
    """Rank 0: final shard names, the index, stale shards removed, config.json."""
    final = [_SINGLE] if len(parts) == 1 else [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    stale = [p for p in out.glob("model*.safetensors*") if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", p.name)]
    for p in stale:
        p.unlink()
    weight_map: dict[str, str] = {}
    for (tmp, ns, _), dst in zip(parts, final):
        os.replace(out / tmp, out / dst)
        weight_map.update({n: dst for n in ns})
    if len(parts) > 1:
        index = {"metadata": {"total_size": sum(b for _, _, b in parts)}, "weight_map": dict(sorted(weight_map.items()))}
        with open(out / _INDEX, "w", encoding="utf-8") as fh:
            json.dump(index, fh, indent=2)
            fh.write("\n")
    if hf_config is not None:
        _write_hf_config(out, hf_config)
