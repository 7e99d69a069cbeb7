"""A Hugging Face ``config.json`` as a Megatron model: :func:`model_config_from_hf` reads it into a
:class:`fnppo.megatron.config.ModelConfig` (family, sizes, rope, MoE router), :func:`build_gpt_from_hf`
builds this rank's model chunks from it.

Families (one record each: :data:`fnppo.io.hf.families.FAMILIES`): Llama (arXiv:2302.13971; RoPE
theta and Llama 3 ``"llama3"`` rope scaling), Mistral (arXiv:2310.06825; Llama's layout, without
sliding window), Qwen2
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

``config_or_path`` is a local file or directory: nothing here touches the network.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from fnppo.core.errors import input_error
from fnppo.io.files import read_json_object
from fnppo.io.hf.families import FAMILIES, SUPPORTED_ARCHITECTURES, MoELayout, checkpoint_head
from fnppo.megatron.build import build_gpt
from fnppo.megatron.config import ModelConfig
from fnppo.megatron.parallel import current_layout
from fnppo.megatron.unwrap import unwrap_model

# Megatron 0.16's llama3 rope scaling hard-codes these (RotaryEmbedding._apply_scaling).
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


def read_hf_config(fn: str, arg: str, config_or_path: Any) -> dict[str, Any]:
    """A Hugging Face config as a plain dict: a mapping, a ``PretrainedConfig``, or a local path."""
    if isinstance(config_or_path, Mapping):
        return dict(config_or_path)
    if isinstance(config_or_path, (str, os.PathLike)):
        p = Path(config_or_path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise input_error(fn, arg, "a config.json file or a local directory holding one", repr(str(p)))
        return read_json_object(fn, arg, p)  # CheckpointError: a damaged file (truncated, corrupt, not an object)
    if hasattr(config_or_path, "to_dict"):
        return dict(config_or_path.to_dict())
    raise input_error(fn, arg, "a dict, a transformers PretrainedConfig or a path", type(config_or_path).__name__)


def _family(fn: str, hf: Mapping[str, Any]) -> str:
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    supported = ", ".join(f"{a} (model_type {t!r})" for t, a in SUPPORTED_ARCHITECTURES.items())
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise input_error(
            fn, "config.model_type", f"one of: {supported}", f"model_type={model_type!r}, architectures={list(archs)!r}"
        )
    checkpoint_head(fn, model_type, hf, "config")
    return model_type


def _rope(fn: str, hf: Mapping[str, Any]) -> tuple[float, bool, float]:
    """``(theta, llama3_scaling, factor)`` from ``rope_parameters`` (transformers 5) or
    ``rope_theta``/``rope_scaling``."""
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
        for name, value in LLAMA3_FIXED.items():
            got = scaling.get(name, value)
            if float(got) != value:
                raise input_error(
                    fn, f"{key}[{name!r}]", f"{value:g} (the llama3 scaling Megatron implements)", repr(got)
                )
        if "factor" not in scaling:
            raise input_error(fn, f"{key}['factor']", "a number", "no such key")
        return float(theta), True, float(scaling["factor"])
    raise input_error(
        fn, key, "rope_type 'default' or 'llama3' (the RoPE variants Megatron implements)", repr(rope_type)
    )


def model_config_from_hf(config_or_path: Any, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` equivalent to a Hugging Face Llama / Mistral / Qwen2 / Qwen3 ``config.json``.

    ``config_or_path``: a dict, a ``transformers`` config object, a ``config.json`` path or a local
    checkpoint directory. Maps ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``,
    ``num_attention_heads``, ``num_key_value_heads`` (grouped-query attention, arXiv:2305.13245),
    ``head_dim`` (``kv_channels``), ``vocab_size``, ``max_position_embeddings``, ``rms_norm_eps``,
    RoPE theta and Llama 3 scaling (arXiv:2104.09864), ``tie_word_embeddings``, Qwen2's q/k/v bias
    and Qwen3's q/k RMSNorm; RMSNorm + SwiGLU always. ``dtype`` is the checkpoint's ``dtype`` /
    ``torch_dtype`` (fp32 if absent). ``overrides`` replace any :class:`ModelConfig` field.

    Raises ``InputError`` naming the offending key for anything Megatron would compute differently
    (see the module docstring); ``CheckpointError`` for a ``config.json`` path that cannot be read or
    holds no JSON object (truncated, corrupt), naming the file and the cause.
    """
    fn = "fnppo.io.hf.model_config_from_hf"
    hf = read_hf_config(fn, "config_or_path", config_or_path)
    family = _family(fn, hf)
    f = FAMILIES[family]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(hf.get(key), int):
            raise input_error(fn, f"config.{key}", "an int", repr(hf.get(key)))
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise input_error(fn, "config.hidden_act", "'silu' (SwiGLU)", repr(act))
    if hf.get("mlp_bias", False):
        raise input_error(fn, "config.mlp_bias", "False", repr(hf.get("mlp_bias")))
    if f.attention_bias_key is not None and hf.get(f.attention_bias_key, False):
        raise input_error(
            fn,
            f"config.{f.attention_bias_key}",
            f"False (o_proj bias without MLP bias has no Megatron equivalent) for {family}",
            repr(hf.get(f.attention_bias_key)),
        )
    if hf.get("use_sliding_window", False):
        raise input_error(
            fn,
            "config.use_sliding_window",
            "False (sliding-window attention is not supported)",
            repr(hf.get("use_sliding_window")),
        )
    if f.sliding_window_switch is None and hf.get("sliding_window") is not None:
        raise input_error(
            fn,
            "config.sliding_window",
            "None (sliding-window attention is not supported)",
            repr(hf.get("sliding_window")),
        )
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
        add_qkv_bias=bool(hf.get(f.qkv_bias_key, f.qkv_bias)) if f.qkv_bias_key else f.qkv_bias,
        qk_layernorm=f.qk_norm,
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
    if f.moe is not None:
        kwargs.update(_moe_config(fn, f.moe, hf))
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise input_error(fn, "overrides", f"ModelConfig fields ({', '.join(sorted(fields))})", repr(unknown))
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def hf_experts_key(moe: MoELayout, hf: Mapping[str, Any]) -> str:
    """The key of the expert count: the family's (``num_local_experts``: Mixtral; ``num_experts``:
    Qwen2-MoE, Qwen3-MoE from transformers 4), or ``num_local_experts`` where the config has it
    (Qwen3-MoE from transformers 5)."""
    return "num_local_experts" if "num_local_experts" in hf else moe.experts_key


def hf_moe_layers(moe: MoELayout, hf: Mapping[str, Any]) -> list[int]:
    """Global indices of a Hugging Face MoE config's MoE layers (Qwen-MoE: not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; Mixtral: every layer)."""
    n = hf["num_hidden_layers"]
    if moe.dense_layers_key is None:
        return list(range(n))
    if not hf.get(hf_experts_key(moe, hf)):
        return []
    dense = set(hf.get(moe.dense_layers_key) or [])
    step = hf.get("decoder_sparse_step") or 1
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def _moe_config(fn: str, moe: MoELayout, hf: Mapping[str, Any]) -> dict[str, Any]:
    """:class:`ModelConfig` MoE fields of a Qwen2-MoE / Qwen3-MoE / Mixtral config (module docstring)."""
    experts_key = hf_experts_key(moe, hf)
    ffn_key = moe.ffn_key
    for key in (experts_key, "num_experts_per_tok", ffn_key):
        if not isinstance(hf.get(key), int) or hf[key] < 1:
            raise input_error(fn, f"config.{key}", "an int >= 1", repr(hf.get(key)))
    layers = hf_moe_layers(moe, hf)
    if not layers:
        raise input_error(
            fn,
            "config.mlp_only_layers",
            "at least one MoE layer (mlp_only_layers / decoder_sparse_step)",
            repr(hf.get("mlp_only_layers")),
        )
    if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        raise input_error(
            fn,
            "config.router_jitter_noise",
            "0 (Megatron's input jitter scales the router's input only)",
            repr(hf.get("router_jitter_noise")),
        )
    n = hf["num_hidden_layers"]
    shared = int(hf.get(moe.shared_expert_key) or 0) if moe.shared_expert_key else 0
    return dict(
        num_experts=hf[experts_key],
        moe_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf[ffn_key],
        moe_layer_freq=1 if len(layers) == n else tuple(int(i in layers) for i in range(n)),
        moe_pre_softmax=moe.renormalize_key is not None and not hf.get(moe.renormalize_key, False),
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
    default the checkpoint's) built with :func:`fnppo.megatron.build.build_gpt` for the current Megatron
    layout (call inside :func:`fnppo.init_parallel`). ``tp``/``pp``, if given, must equal the
    current layout's sizes. ``layer_spec`` defaults to
    ``fnppo.megatron.layer_specs.default_layer_spec(cfg)`` (Transformer Engine's spec when installed, else the
    local spec; RMSNorm, and q/k norms for Qwen3, from the config). Weights are random: load them
    with :func:`load_hf_weights`.
    """
    fn = "fnppo.io.hf.build_gpt_from_hf"
    layout = current_layout()
    for name, want, have in (("tp", tp, layout.tp), ("pp", pp, layout.pp)):
        if want is not None and want != have:
            raise input_error(
                fn, name, f"{have} (the current Megatron layout; set it with fnppo.init_parallel)", repr(want)
            )
    if dtype is not None:
        overrides["dtype"] = dtype
    hf = read_hf_config(fn, "config_or_path", config_or_path)
    cfg = model_config_from_hf(hf, **overrides)
    described = checkpoint_head(fn, hf["model_type"], hf, "config")
    if described is not None and described.kind != "lm" and head != "value":
        raise input_error(
            fn,
            "head",
            f"'value' for a {hf['architectures'][0]} checkpoint (its score head is a value head; it has no lm_head)",
            repr(head),
        )
    chunks = build_gpt(cfg, head=head, layer_spec=layer_spec, layout=layout)
    for chunk in chunks:  # which family's tensor names the model has (Qwen2-MoE and Mixtral can look alike)
        unwrap_model(chunk).fnppo_hf_family = hf["model_type"]
    return chunks
