"""The architecture of a built Megatron model (:class:`Arch`: sizes, family, MoE layers, head) as
Hugging Face sees it, and the names and shapes of the Hugging Face tensors it corresponds to
(:func:`expected_hf_shapes`, :func:`hf_tensor_shapes`): what loading checks a checkpoint against and
what export writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import nn

from fnppo.core.errors import input_error
from fnppo.io.hf.families import FAMILIES, VALUE_HEAD_LAYOUTS, Family
from fnppo.megatron.routing import moe_layer_indices
from fnppo.megatron.unwrap import model_head, unwrap_model


@dataclasses.dataclass(frozen=True)
class Arch:
    """A built model's architecture in the terms of a Hugging Face checkpoint (:func:`model_arch`)."""

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


def _holds(f: Family, c: Any, moe_layers: Sequence[int]) -> bool:
    """Whether family ``f`` can describe a model of config ``c`` with MoE layers ``moe_layers``."""
    if (f.moe is not None) != bool(moe_layers) or f.qk_norm != bool(c.qk_layernorm):
        return False
    if f.qkv_bias_key is None and f.qkv_bias != bool(c.add_qkv_bias):
        return False
    if f.moe is None:
        return True
    shared_ok = f.moe.shared_expert_key is not None or not c.moe_shared_expert_intermediate_size
    return shared_ok and (f.moe.dense_layers_key is not None or len(moe_layers) == c.num_layers)


def _family_of(core: nn.Module, c: Any, moe_layers: Sequence[int]) -> str:
    """The Hugging Face family of a built model: the one ``build_gpt_from_hf`` recorded, else the first
    of :data:`FAMILIES` whose layout can hold its architecture (Llama before Mistral, Mixtral before
    Qwen2-MoE: the family with the fewest options)."""
    recorded = getattr(core, "fnppo_hf_family", None)
    if recorded in FAMILIES:
        return recorded
    held = [t for t, f in FAMILIES.items() if _holds(f, c, moe_layers)]
    if not held:
        raise input_error(
            "fnppo.io.hf.model_arch",
            "model_chunks",
            "a layout one of the Hugging Face families has (" + ", ".join(FAMILIES) + ")",
            f"qk_layernorm={bool(c.qk_layernorm)}, add_qkv_bias={bool(c.add_qkv_bias)}, "
            f"MoE layers {list(moe_layers)}, shared expert {c.moe_shared_expert_intermediate_size}",
        )
    return held[0]


def model_arch(fn: str, model_chunks: Sequence[nn.Module]) -> Arch:
    """The :class:`Arch` of a built model's chunks.

    Raises:
        InputError: no chunks, not a ``GPTModel``, or a layout these families do not have (naming the
            config field: gated linear unit, RMSNorm, no linear bias, no MLA, RoPE, the MoE router options).
    """
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
        if FAMILIES[family].moe.renormalize_key is None:  # always renormalized
            checks.append(("config.moe_router_pre_softmax", c.moe_router_pre_softmax, False))
    for name, have, want in checks:
        if have != want:
            raise input_error(fn, f"model_chunks[0].{name}", f"{want!r} (Llama/Qwen/Mixtral layout)", repr(have))
    groups = c.num_query_groups or c.num_attention_heads
    value = model_head(core) == "value"
    return Arch(
        num_layers=c.num_layers,
        hidden=c.hidden_size,
        heads=c.num_attention_heads,
        groups=groups,
        head_dim=c.kv_channels,
        ffn=c.ffn_hidden_size,
        padded_vocab=core.vocab_size,
        qkv_bias=bool(c.add_qkv_bias),
        qk_norm=bool(c.qk_layernorm),
        tied=bool(getattr(core, "fnppo_config", c).tie_embeddings)
        if value
        else bool(core.share_embeddings_and_output_weights),
        value=value,
        family=family,
        moe_layers=moe_layers,
        experts=int(c.num_moe_experts or 0),
        topk=int(c.moe_router_topk) if moe_layers else 0,
        moe_ffn=int(c.moe_ffn_hidden_size or 0) if moe_layers else 0,
        shared=shared,
        pre_softmax=bool(c.moe_router_pre_softmax) if moe_layers else False,
    )


def expected_hf_shapes(
    a: Arch, vocab: int, head: str | tuple[str, str | None] | None = None
) -> dict[str, tuple[int, ...]]:
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


def expert_names(a: Arch) -> tuple[str, tuple[str, str, str]]:
    """(the MoE block's prefix, the (gate, up, down) projection names of an expert) of the family."""
    moe = FAMILIES[a.family].moe
    if moe is None:
        raise input_error("fnppo.io.hf.expert_names", "a.family", "an MoE family", repr(a.family))
    return moe.block, moe.expert_projs


def _expected_moe(a: Arch, p: str) -> dict[str, tuple[int, ...]]:
    """The HF tensors of one MoE layer (prefix ``p``): router, experts, shared expert and its gate."""
    H, I = a.hidden, a.moe_ffn  # noqa: E741 - the paper's names: hidden H, intermediate I
    block, (gate, up, down) = expert_names(a)
    out: dict[str, tuple[int, ...]] = {p + block + "gate.weight": (a.experts, H)}
    for j in range(a.experts):
        e = f"{p}{block}experts.{j}."
        out.update({e + gate: (I, H), e + up: (I, H), e + down: (H, I)})
    if a.shared:
        e = p + "mlp.shared_expert."
        out.update(
            {
                e + "gate_proj.weight": (a.shared, H),
                e + "up_proj.weight": (a.shared, H),
                e + "down_proj.weight": (H, a.shared),
                p + "mlp.shared_expert_gate.weight": (1, H),
            }
        )
    return out


def hf_tensor_shapes(model_chunks: Sequence[nn.Module], vocab_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the Hugging Face tensors of the whole model (all ranks' shards together),
    as :func:`export_hf_weights` writes them (a value model: the ``*ForTokenClassification`` layout,
    ``score.weight`` and ``score.bias``).

    ``vocab_size``: the checkpoint's vocabulary (defaults to the model's padded vocabulary).
    """
    a = model_arch("fnppo.io.hf.hf_tensor_shapes", model_chunks)
    return expected_hf_shapes(a, a.padded_vocab if vocab_size is None else vocab_size)
