"""Megatron parameter names <-> Hugging Face tensor names: :func:`param_rule` gives, for each
(global) Megatron parameter, the kind of layout conversion and the Hugging Face tensors it is made of
(kinds ``copy``, ``vocab``, ``gated``, ``qkv``: :mod:`fnppo.io.hf.layouts` converts the tensors).

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
tensor parallelism like the dense MLP over TP).
"""

from __future__ import annotations

import re

from fnppo.core.errors import input_error
from fnppo.io.hf.arch import Arch, expert_names
from fnppo.io.hf.families import SUPPORTED_ARCHITECTURES

# Megatron parameter (layer-relative, or top-level) -> (kind, HF names (layer-relative or absolute)).
_LAYER_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("copy", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("copy", ("input_layernorm.weight",)),
    "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("copy", ("post_attention_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
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
VALUE_HEAD_RULES: dict[str, tuple[str, tuple[str, ...]]] = {  # a value model's last stage (replicated over TP)
    "value_head.weight": ("copy", ("score.weight",)),
    "value_head.bias": ("copy", ("score.bias",)),
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$"
)


def _moe_rule(a: Arch, prefix: str, rest: str) -> tuple[str, tuple[str, ...]] | None:
    """The rule of an MoE layer's parameter (``rest``: relative to the layer), or None."""
    block, (gate, up, down) = expert_names(a)
    if rest == "mlp.router.weight":
        return "copy", (prefix + block + "gate.weight",)
    m = _EXPERT_RE.match(rest)
    if m:
        j, fc = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(4), m.group(3))
        e = f"{prefix}{block}experts.{j}."
        return ("gated", (e + gate, e + up)) if fc == "linear_fc1" else ("copy", (e + down,))
    shared = {
        "mlp.shared_experts.linear_fc1.weight": (
            "gated",
            ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        ),
        "mlp.shared_experts.linear_fc2.weight": ("copy", ("mlp.shared_expert.down_proj.weight",)),
        "mlp.shared_experts.gate_weight": ("copy", ("mlp.shared_expert_gate.weight",)),
    }.get(rest)
    return None if shared is None else (shared[0], tuple(prefix + n for n in shared[1]))


def param_rule(fn: str, a: Arch, gname: str) -> tuple[str, tuple[str, ...]]:
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
    elif a.value and gname in VALUE_HEAD_RULES:
        return VALUE_HEAD_RULES[gname]
    elif gname in _TOP_RULES:
        kind, names = _TOP_RULES[gname]
        if gname == "output_layer.weight" and a.tied:
            names = ("model.embed_tokens.weight",)
        return kind, names
    raise input_error(
        fn,
        "model_chunks",
        f"parameters of a {SUPPORTED_ARCHITECTURES[a.family]} GPTModel",
        f"a parameter {gname!r} with no Hugging Face counterpart",
    )
