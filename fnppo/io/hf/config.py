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

Every key of a config is read through the family's allow-list (:mod:`fnppo.io.hf.config_keys`,
:attr:`fnppo.io.hf.families.Family.allow_list`): understood (mapped here, type- and
range-checked), irrelevant (tokenizer ids, ``use_cache``, ...) or refused by name (layers without
RoPE, interleaved or partial RoPE, quantized weights, any key fnppo does not know); an absent key
takes transformers' default for the family.

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

from fnppo.core.errors import InputError, input_error
from fnppo.io.files import read_json_object
from fnppo.io.hf.config_keys import DTYPES, key_name, read_keys, shown
from fnppo.io.hf.families import FAMILIES, SUPPORTED_ARCHITECTURES, Family, MoELayout, checkpoint_head
from fnppo.megatron.build import build_gpt
from fnppo.megatron.config import ModelConfig
from fnppo.megatron.parallel import current_layout
from fnppo.megatron.unwrap import unwrap_model

# Megatron 0.16's llama3 rope scaling hard-codes these (RotaryEmbedding._apply_scaling).
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}
_ROPE_KEYS = {"default": ("rope_type", "type", "rope_theta", "partial_rotary_factor")}
_ROPE_KEYS["llama3"] = (*_ROPE_KEYS["default"], "factor", *LLAMA3_FIXED)


def read_hf_config(fn: str, arg: str, config_or_path: Any) -> dict[str, Any]:
    """A Hugging Face config as a plain dict: a mapping, a ``PretrainedConfig``, or a local path.

    Raises:
        InputError: no such file, or another type.
        CheckpointError: a ``config.json`` that cannot be read or is not a JSON object (truncated,
            corrupt, a list), naming the path and the cause.
    """
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


def _family(fn: str, hf: Mapping[str, Any], label: str) -> Family:
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    supported = ", ".join(f"{a} (model_type {t!r})" for t, a in SUPPORTED_ARCHITECTURES.items())
    if not isinstance(model_type, str) or model_type not in SUPPORTED_ARCHITECTURES:
        raise input_error(
            fn,
            key_name(label, "model_type"),
            f"one of: {supported}",
            f"model_type={model_type!r}, architectures={shown(archs)}",
        )
    return FAMILIES[model_type]


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0.0 < float(value) < float("inf")


def _same_number(a: Any, b: float) -> bool:
    return not isinstance(a, bool) and isinstance(a, (int, float)) and float(a) == b


def _rope(fn: str, hf: Mapping[str, Any], label: str, family: str) -> tuple[float, bool, float]:
    """``(theta, llama3_scaling, factor)`` from ``rope_parameters`` (transformers 5) or
    ``rope_theta``/``rope_scaling`` (``hf`` read through the allow-list: ``rope_theta`` is there).

    Raises:
        InputError: a rope type other than ``"default"``/``"llama3"``, an entry the type does not
            have, llama3 parameters other than Megatron's, theta or factor not a finite number > 0,
            both ``rope_parameters`` and a different ``rope_scaling`` (transformers 5 would read
            ``rope_scaling``).
    """

    def refuse(arg: str, expected: str, received: Any) -> InputError:
        return input_error(fn, arg, f"{expected} for model_type {family!r}", shown(received))

    params, legacy = hf.get("rope_parameters"), hf.get("rope_scaling")
    if params and legacy and dict(params) != dict(legacy):
        why = "transformers 5 would read rope_scaling over rope_parameters"
        raise refuse(key_name(label, "rope_scaling"), f"None or rope_parameters' entries ({why})", legacy)
    scaling: Mapping[str, Any] = params or legacy or {}
    key = key_name(label, "rope_parameters" if params else "rope_scaling")
    given = [scaling[k] for k in ("rope_type", "type") if k in scaling]
    if len(given) == 2 and given[0] != given[1]:
        raise refuse(f"{key}['type']", f"absent or {given[0]!r}, the rope_type", given[1])
    rope_type = given[0] if given and given[0] is not None else "default"
    if not isinstance(rope_type, str) or rope_type not in _ROPE_KEYS:
        raise refuse(key, "rope_type 'default' or 'llama3' (the RoPE variants Megatron implements)", rope_type)
    for name in scaling:
        if name not in _ROPE_KEYS[rope_type]:
            raise refuse(
                f"{key}[{name!r}]",
                f"no such entry (rope_type {rope_type!r} has {_ROPE_KEYS[rope_type]})",
                scaling[name],
            )
    if "partial_rotary_factor" in scaling and not _same_number(scaling["partial_rotary_factor"], 1.0):
        got = scaling["partial_rotary_factor"]
        raise refuse(f"{key}['partial_rotary_factor']", "1.0 (these families rotate the whole head)", got)
    theta_key = f"{key}['rope_theta']" if "rope_theta" in scaling else key_name(label, "rope_theta")
    theta = scaling.get("rope_theta", hf.get("rope_theta"))
    if not _positive(theta):
        raise refuse(theta_key, "a finite number > 0", theta)
    if rope_type == "default":
        return float(theta), False, 8.0
    for name, value in LLAMA3_FIXED.items():
        if not _same_number(scaling.get(name, value), value):
            raise refuse(f"{key}[{name!r}]", f"{value:g} (the llama3 scaling Megatron implements)", scaling[name])
    if not _positive(scaling.get("factor")):
        raise refuse(f"{key}['factor']", "a finite number > 0", scaling.get("factor", "no such key"))
    return float(theta), True, float(scaling["factor"])


def _attention(
    fn: str, family: str, c: Mapping[str, Any], written: Mapping[str, Any], label: str
) -> tuple[int, int, int]:
    """``(heads, query groups, head dim)`` of ``c`` (read through the allow-list; ``written``: the
    keys as given): ``num_key_value_heads`` None is one group per head, ``head_dim`` None is
    ``hidden_size // num_attention_heads`` (transformers' rule)."""
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    groups = c.get("num_key_value_heads") or heads
    if heads % groups:
        raise input_error(
            fn,
            key_name(label, "num_key_value_heads"),
            f"a divisor of num_attention_heads {heads} (grouped-query attention) for model_type {family!r}",
            repr(groups) + ("" if "num_key_value_heads" in written else " (absent: transformers' default)"),
        )
    head_dim = c.get("head_dim") or hidden // heads
    if head_dim < 1:
        raise input_error(
            fn,
            key_name(label, "head_dim"),
            f"an int >= 1 (hidden_size {hidden} // num_attention_heads {heads}) for model_type {family!r}",
            repr(head_dim),
        )
    return heads, groups, head_dim


def checked_hf_config(
    fn: str, hf: Mapping[str, Any], label: str = "config", head: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, fields)``: a Hugging Face config read through its family's allow-list
    (:func:`fnppo.io.hf.config_keys.read_keys`: every key understood, irrelevant or refused; absent
    keys given transformers' defaults) and the :class:`ModelConfig` fields it maps to.
    ``label``: how errors name the config (``"config"``, ``"config.json"``, ``"hf_config"``);
    ``head``: check the head it describes (:func:`checkpoint_head`; the loader compares it with the
    model's first).

    Raises:
        InputError: an unknown family, a key refused or not known, a value of the wrong type or
            range, anything Megatron would compute differently (module docstring); naming the key.
    """
    f = _family(fn, hf, label)
    if head:
        checkpoint_head(fn, f.model_type, hf, label)
    c = read_keys(fn, f.model_type, f.allow_list, hf, label)
    heads, groups, head_dim = _attention(fn, f.model_type, c, hf, label)
    theta, scaling, factor = _rope(fn, c, label, f.model_type)
    raw_dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32").replace("torch.", "")
    fields: dict[str, Any] = dict(
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        ffn_hidden_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        max_seq_len=c["max_position_embeddings"],
        normalization="RMSNorm",
        layernorm_epsilon=float(c["rms_norm_eps"]),
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=c[f.qkv_bias_key] if f.qkv_bias_key else f.qkv_bias,
        qk_layernorm=f.qk_norm,
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=1.0,
        rope_scaling=scaling,
        rope_scaling_factor=factor,
        tie_embeddings=c["tie_word_embeddings"],
        init_method_std=float(c["initializer_range"]),
        dtype=DTYPES[raw_dtype],
        attention_dropout=float(c["attention_dropout"]),
        hidden_dropout=0.0,
    )
    if f.moe is not None:
        fields.update(_moe_config(fn, f.model_type, f.moe, c, label))
    return c, fields


def model_config_from_hf(config_or_path: Any, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` equivalent to a Hugging Face Llama / Mistral / Qwen2 / Qwen3 ``config.json``.

    ``config_or_path``: a dict, a ``transformers`` config object, a ``config.json`` path or a local
    checkpoint directory. Maps ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``,
    ``num_attention_heads``, ``num_key_value_heads`` (grouped-query attention, arXiv:2305.13245),
    ``head_dim`` (``kv_channels``), ``vocab_size``, ``max_position_embeddings``, ``rms_norm_eps``,
    RoPE theta and Llama 3 scaling (arXiv:2104.09864), ``tie_word_embeddings``, Qwen2's q/k/v bias
    and Qwen3's q/k RMSNorm; RMSNorm + SwiGLU always. ``dtype`` is the checkpoint's ``dtype`` /
    ``torch_dtype`` (fp32 if absent). ``overrides`` replace any :class:`ModelConfig` field.

    Every key is read through the family's allow-list (:mod:`fnppo.io.hf.config_keys`): understood
    (and type- and range-checked), irrelevant (tokenizer ids, ``use_cache``, ...) or refused; an
    absent key takes transformers' default for the family.

    Raises ``InputError`` naming the offending key for anything Megatron would compute differently
    (see the module docstring); ``CheckpointError`` for a ``config.json`` path that cannot be read or
    holds no JSON object (truncated, corrupt), naming the file and the cause.
    """
    fn = "fnppo.io.hf.model_config_from_hf"
    hf = read_hf_config(fn, "config_or_path", config_or_path)
    _, kwargs = checked_hf_config(fn, hf)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise input_error(fn, "overrides", f"ModelConfig fields ({', '.join(sorted(fields))})", repr(unknown))
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def hf_experts_key(moe: MoELayout, hf: Mapping[str, Any]) -> str:
    """The key of the expert count as the config spells it: the family's (``num_experts``: Qwen2-MoE,
    Qwen3-MoE; ``num_local_experts``: Mixtral), or its other spelling where only that is written
    (transformers 5 writes ``num_local_experts`` for Qwen3-MoE)."""
    alias = moe.experts_alias
    return alias if alias is not None and alias in hf and moe.experts_key not in hf else moe.experts_key


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


def _moe_config(fn: str, family: str, moe: MoELayout, hf: Mapping[str, Any], label: str) -> dict[str, Any]:
    """:class:`ModelConfig` MoE fields of a Qwen2-MoE / Qwen3-MoE / Mixtral config (module docstring),
    ``hf`` read through the allow-list (types and ranges checked there)."""
    fam = f" for model_type {family!r}"
    experts_key = hf_experts_key(moe, hf)
    alias = moe.experts_alias
    if alias is not None and alias in hf and experts_key != alias and hf[alias] != hf[experts_key]:
        raise input_error(
            fn,
            key_name(label, alias),
            f"absent or {hf[experts_key]!r}, the {experts_key} (transformers reads the two as one){fam}",
            shown(hf[alias]),
        )
    for key in (experts_key, "num_experts_per_tok", moe.ffn_key):
        if hf.get(key) is None:
            raise input_error(fn, key_name(label, key), "an int >= 1" + fam, repr(hf.get(key)))
    if hf["num_experts_per_tok"] > hf[experts_key]:
        raise input_error(
            fn,
            key_name(label, "num_experts_per_tok"),
            f"at most {experts_key} ({hf[experts_key]}){fam}",
            repr(hf["num_experts_per_tok"]),
        )
    layers = hf_moe_layers(moe, hf)
    if not layers:
        raise input_error(
            fn,
            key_name(label, "mlp_only_layers"),
            "at least one MoE layer (mlp_only_layers / decoder_sparse_step)" + fam,
            shown(hf.get("mlp_only_layers")),
        )
    n = hf["num_hidden_layers"]
    shared = hf[moe.shared_expert_key] if moe.shared_expert_key else 0
    return dict(
        num_experts=hf[experts_key],
        moe_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf[moe.ffn_key],
        moe_layer_freq=1 if len(layers) == n else tuple(int(i in layers) for i in range(n)),
        moe_pre_softmax=moe.renormalize_key is not None and not hf[moe.renormalize_key],
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
