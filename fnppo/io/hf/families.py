"""The Hugging Face families fnppo reads and writes, and the heads their checkpoints end in.

Policies are ``<Family>ForCausalLM`` (:data:`SUPPORTED_ARCHITECTURES`); value and reward models are
transformers' ``<Family>ForTokenClassification`` / ``<Family>ForSequenceClassification`` with one
label, OpenRLHF's ``CriticModel`` / ``RewardModel`` (:data:`OPENRLHF_ARCHITECTURES`), or a critic
saved by TRL or verl in a ``*ForCausalLM`` config. :data:`VALUE_HEAD_LAYOUTS` is the one table of
the value-head tensors they store; :func:`checkpoint_head` reads which head a ``config.json``
describes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from fnppo.core.errors import input_error
from fnppo.io.hf.config_keys import (
    Key,
    allow_list,
    boolean,
    int_at_least,
    irrelevant,
    key_name,
    layer_indices,
    only,
    understood,
)


@dataclasses.dataclass(frozen=True)
class MoELayout:
    """How a Mixture-of-Experts family names and configures its experts (top-k softmax routers)."""

    block: str  # the MoE block's prefix inside a layer: "mlp." (Qwen-MoE) or "block_sparse_moe." (Mixtral)
    expert_projs: tuple[str, str, str]  # an expert's (gate, up, down) tensors
    experts_key: str  # the expert count's key
    ffn_key: str  # the experts' hidden size: "moe_intermediate_size", or "intermediate_size" (Mixtral)
    dense_layers_key: str | None  # "mlp_only_layers" (with decoder_sparse_step); None: every layer an MoE layer
    renormalize_key: str | None  # "norm_topk_prob"; None: the top-k probabilities are always renormalized
    experts_alias: str | None = None  # the expert count's other spelling (transformers' attribute_map)
    shared_expert_key: str | None = None  # the shared expert's hidden size (Qwen2-MoE), None: no shared expert
    jitter_key: str | None = None  # the router's jitter noise (must be 0), None: the family has none
    mlp_names_are_experts: bool = False  # PEFT reads gate_proj / up_proj / down_proj as the experts' names


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face family: every fact that loading, export and the config checks read about it.

    Adding a family is one record in :data:`FAMILIES` plus a row of tests/test_hf.py's ``FAMILIES`` /
    ``MOE_FAMILIES`` (its round trips; tests/test_hf_config_keys.py checks its allow-list against the
    transformers config class named there). All families use RMSNorm, SwiGLU, RoPE rotating halves
    of the whole head (not interleaved, not partial) and the Llama tensor names
    (``model.layers.i.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ...). A family reads
    its ``config.json`` through :attr:`allow_list` (``keys`` over the keys of every family,
    ``defaults`` for absent keys).
    """

    model_type: str
    classes: str  # transformers' class prefix: <classes>ForCausalLM, ...ForTokenClassification, ...
    qkv_bias: bool = False  # bias on q/k/v (Qwen2)
    qkv_bias_key: str | None = None  # the config key that switches it (default: qkv_bias), None: fixed
    attention_bias_key: str | None = "attention_bias"  # a config key that must be false (None: not read)
    qk_norm: bool = False  # RMSNorm on queries and keys per head (Qwen3)
    sliding_window_switch: str | None = None  # "use_sliding_window": sliding_window is only used when it is
    # true (Qwen); None: a set sliding_window means sliding-window attention
    moe: MoELayout | None = None
    keys: Mapping[str, Key] = dataclasses.field(default_factory=lambda: MappingProxyType({}))  # the family's
    # own config.json keys, over fnppo.io.hf.config_keys.COMMON_KEYS
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))  # transformers'
    # defaults of the family's config class, read where a key is absent (tests compare them with transformers)

    @property
    def causal_lm(self) -> str:
        return self.classes + "ForCausalLM"

    @property
    def allow_list(self) -> Mapping[str, Key]:
        """Every config key the family reads, each understood, irrelevant or refused
        (:mod:`fnppo.io.hf.config_keys`); a key not in it is refused."""
        return allow_list(self.keys, self.defaults)


def _keys(**keys: Key) -> Mapping[str, Key]:
    return MappingProxyType(keys)


def _defaults(kv_heads: int | None, max_positions: int, **more: Any) -> Mapping[str, Any]:
    """transformers' defaults of a family's config class (its dataclass fields; Mixtral's theta is its
    ``default_theta``); ``head_dim`` None: ``hidden_size // num_attention_heads``."""
    base = dict(num_key_value_heads=kv_heads, head_dim=None, max_position_embeddings=max_positions)
    return MappingProxyType({**base, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, **more})


_O_BIAS_OFF = understood("o_proj bias without MLP bias has no Megatron equivalent", only(False), False)
_MLP_BIAS_OFF = understood("a bias on the MLP has no Megatron equivalent here", only(False), False)
_WINDOW_OFF = understood("sliding-window attention is not supported", only(None))
_QWEN_WINDOW = dict(  # Qwen's sliding window applies only where use_sliding_window is true
    use_sliding_window=understood("sliding-window attention is not supported", only(False), False),
    sliding_window=understood("the window, read only when use_sliding_window is true", int_at_least(0, none=True)),
    max_window_layers=understood(
        "layers before the window, read only when use_sliding_window is true", int_at_least(0)
    ),
)
_ROUTER_LOSS = irrelevant(
    "transformers' load-balancing loss coefficient: fnppo's router losses are ModelConfig overrides"
)
_MOE_KEYS = dict(
    num_experts_per_tok=understood("mapped to moe_topk", int_at_least(1)),
    router_aux_loss_coef=_ROUTER_LOSS,
)
_QWEN_MOE_KEYS = dict(
    _QWEN_WINDOW,
    **_MOE_KEYS,
    num_experts=understood("mapped to num_experts", int_at_least(1)),
    moe_intermediate_size=understood("mapped to moe_ffn_hidden_size", int_at_least(1)),
    norm_topk_prob=understood("the top-k probabilities renormalized (moe_pre_softmax=False)", boolean),
    decoder_sparse_step=understood("moe_layer_freq: every decoder_sparse_step-th layer an MoE layer", int_at_least(1)),
    mlp_only_layers=understood("moe_layer_freq: dense layers", layer_indices),
)
_QWEN_MOE_DEFAULTS = dict(norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=None)


_QWEN_MOE = MoELayout(
    block="mlp.",
    expert_projs=("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
    experts_key="num_experts",
    ffn_key="moe_intermediate_size",
    dense_layers_key="mlp_only_layers",
    renormalize_key="norm_topk_prob",
)
FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        f.model_type: f
        for f in (
            Family(  # arXiv:2302.13971
                "llama",
                "Llama",
                keys=_keys(attention_bias=_O_BIAS_OFF, mlp_bias=_MLP_BIAS_OFF),
                defaults=_defaults(None, 2048),
            ),
            Family(
                "qwen2",
                "Qwen2",
                qkv_bias=True,
                attention_bias_key=None,
                sliding_window_switch="use_sliding_window",
                keys=_keys(**_QWEN_WINDOW),
                defaults=_defaults(32, 32768),
            ),
            Family(
                "qwen3",
                "Qwen3",
                qk_norm=True,
                sliding_window_switch="use_sliding_window",
                keys=_keys(attention_bias=_O_BIAS_OFF, **_QWEN_WINDOW),
                defaults=_defaults(32, 32768, head_dim=128),
            ),
            Family(
                "mixtral",
                "Mixtral",
                moe=MoELayout(
                    block="block_sparse_moe.",
                    expert_projs=("w1.weight", "w3.weight", "w2.weight"),
                    experts_key="num_local_experts",
                    experts_alias="num_experts",
                    ffn_key="intermediate_size",
                    dense_layers_key=None,
                    renormalize_key=None,
                    jitter_key="router_jitter_noise",
                    mlp_names_are_experts=True,
                ),
                keys=_keys(
                    sliding_window=_WINDOW_OFF,
                    num_local_experts=understood("mapped to num_experts", int_at_least(1)),
                    num_experts=understood("mapped to num_experts; another name of num_local_experts", int_at_least(1)),
                    router_jitter_noise=understood("Megatron's input jitter scales the router's input only", only(0)),
                    **_MOE_KEYS,
                ),
                defaults=_defaults(
                    8, 131072, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None, router_jitter_noise=0.0
                ),
            ),
            Family(
                "qwen2_moe",
                "Qwen2Moe",
                qkv_bias=True,
                qkv_bias_key="qkv_bias",
                attention_bias_key=None,
                sliding_window_switch="use_sliding_window",
                moe=dataclasses.replace(_QWEN_MOE, shared_expert_key="shared_expert_intermediate_size"),
                keys=_keys(
                    qkv_bias=understood("mapped to add_qkv_bias", boolean),
                    shared_expert_intermediate_size=understood(
                        "mapped to moe_shared_expert_size; 0: none", int_at_least(0)
                    ),
                    **_QWEN_MOE_KEYS,
                ),
                defaults=_defaults(
                    16, 32768, qkv_bias=True, shared_expert_intermediate_size=5632, **_QWEN_MOE_DEFAULTS
                ),
            ),
            Family(
                "qwen3_moe",
                "Qwen3Moe",
                qk_norm=True,
                sliding_window_switch="use_sliding_window",
                moe=dataclasses.replace(_QWEN_MOE, experts_alias="num_local_experts", mlp_names_are_experts=True),
                keys=_keys(
                    attention_bias=_O_BIAS_OFF,
                    num_local_experts=understood("mapped to num_experts; another name of num_experts", int_at_least(1)),
                    **_QWEN_MOE_KEYS,
                ),
                defaults=_defaults(4, 32768, **_QWEN_MOE_DEFAULTS),
            ),
            Family(  # arXiv:2310.06825: Llama's layout; sliding_window must be null (transformers' default: 4096)
                "mistral",
                "Mistral",
                keys=_keys(sliding_window=_WINDOW_OFF),
                defaults=_defaults(8, 131072, sliding_window=4096),
            ),
        )
    }
)
"""``model_type`` -> the :class:`Family` record (immutable)."""

SUPPORTED_ARCHITECTURES: Mapping[str, str] = MappingProxyType({t: f.causal_lm for t, f in FAMILIES.items()})
"""``model_type`` -> ``architectures`` entry of the supported Hugging Face families (policies)."""
TOKEN_CLASSIFICATION_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {t: f.classes + "ForTokenClassification" for t, f in FAMILIES.items()}
)
"""``model_type`` -> transformers' per-token classifier of the family (``score.weight`` ``[num_labels,
hidden]`` and, unless ``token_classification_bias`` is false, ``score.bias``): with ``num_labels=1``
a value model, what :func:`export_hf_weights` writes for one."""
SEQUENCE_CLASSIFICATION_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {t: f.classes + "ForSequenceClassification" for t, f in FAMILIES.items()}
)
"""``model_type`` -> transformers' sequence classifier of the family (``score.weight`` ``[num_labels,
hidden]``, no bias, applied per token and read at the last one): with ``num_labels=1`` a reward or
value model, loadable into a value model."""
MOE_FAMILIES = tuple(t for t, f in FAMILIES.items() if f.moe is not None)


@dataclasses.dataclass(frozen=True)
class CheckpointHead:
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
names) in every one of them; :func:`value_head_of` picks the layout of a checkpoint."""


def checkpoint_head(fn: str, family: str, hf: Mapping[str, Any], label: str) -> CheckpointHead | None:
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
    kinds = {
        SUPPORTED_ARCHITECTURES[family]: "lm",
        TOKEN_CLASSIFICATION_ARCHITECTURES[family]: "token",
        SEQUENCE_CLASSIFICATION_ARCHITECTURES[family]: "sequence",
        **dict.fromkeys(OPENRLHF_ARCHITECTURES, "openrlhf"),
    }
    if len(archs) != 1 or archs[0] not in kinds:
        names = [repr([a]) for a in kinds]
        raise input_error(
            fn,
            key_name(label, "architectures"),
            f"{names[0]} (a policy) or {names[1]} / {names[2]} (a value or reward model, num_labels=1)"
            f" for model_type {family!r}"
            f" or {names[3]} / {names[4]} (OpenRLHF's critic / reward model)",
            repr(archs),
        )
    kind = kinds[archs[0]]
    if kind in ("lm", "openrlhf"):  # OpenRLHF's head has one output whatever the config's labels say
        return CheckpointHead(kind, False)
    if hf.get("id2label") is not None:
        key, n, have = "id2label", len(hf["id2label"]), repr(hf["id2label"])
    elif hf.get("num_labels") is not None:
        key, n, have = "num_labels", hf["num_labels"], repr(hf["num_labels"])
    else:
        key, n, have = "num_labels", 2, "neither id2label nor num_labels (transformers' default: 2 labels)"
    if n != 1:
        want = "one entry" if key == "id2label" else "1"
        raise input_error(
            fn, key_name(label, key), f"{want} (num_labels=1: one value per token, the value head; {archs[0]})", have
        )
    return CheckpointHead(kind, kind == "token" and bool(hf.get("token_classification_bias", True)))
