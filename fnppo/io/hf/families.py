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


@dataclasses.dataclass(frozen=True)
class MoELayout:
    """How a Mixture-of-Experts family names and configures its experts (top-k softmax routers)."""

    block: str  # the MoE block's prefix inside a layer: "mlp." (Qwen-MoE) or "block_sparse_moe." (Mixtral)
    expert_projs: tuple[str, str, str]  # an expert's (gate, up, down) tensors
    experts_key: str  # the expert count's key (transformers 5 also writes "num_local_experts" for Qwen3-MoE)
    ffn_key: str  # the experts' hidden size: "moe_intermediate_size", or "intermediate_size" (Mixtral)
    dense_layers_key: str | None  # "mlp_only_layers" (with decoder_sparse_step); None: every layer an MoE layer
    renormalize_key: str | None  # "norm_topk_prob"; None: the top-k probabilities are always renormalized
    shared_expert_key: str | None = None  # the shared expert's hidden size (Qwen2-MoE), None: no shared expert
    jitter_key: str | None = None  # the router's jitter noise (must be 0), None: the family has none
    mlp_names_are_experts: bool = False  # PEFT reads gate_proj / up_proj / down_proj as the experts' names


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face family: every fact that loading, export and the config checks read about it.

    Adding a family is one record in :data:`FAMILIES` plus a round-trip test (tests/test_hf.py's
    ``FAMILIES`` / ``MOE_FAMILIES``). All families use RMSNorm, SwiGLU, RoPE and the Llama tensor names
    (``model.layers.i.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ...).
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

    @property
    def causal_lm(self) -> str:
        return self.classes + "ForCausalLM"


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
            Family("llama", "Llama"),  # arXiv:2302.13971
            Family(
                "qwen2", "Qwen2", qkv_bias=True, attention_bias_key=None, sliding_window_switch="use_sliding_window"
            ),
            Family("qwen3", "Qwen3", qk_norm=True, sliding_window_switch="use_sliding_window"),
            Family(
                "mixtral",
                "Mixtral",
                moe=MoELayout(
                    block="block_sparse_moe.",
                    expert_projs=("w1.weight", "w3.weight", "w2.weight"),
                    experts_key="num_local_experts",
                    ffn_key="intermediate_size",
                    dense_layers_key=None,
                    renormalize_key=None,
                    jitter_key="router_jitter_noise",
                    mlp_names_are_experts=True,
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
            ),
            Family(
                "qwen3_moe",
                "Qwen3Moe",
                qk_norm=True,
                sliding_window_switch="use_sliding_window",
                moe=dataclasses.replace(_QWEN_MOE, mlp_names_are_experts=True),
            ),
            Family("mistral", "Mistral"),  # arXiv:2310.06825: Llama's layout; sliding_window must be null
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


def _key(label: str, name: str) -> str:
    """How an entry of a config is named in errors: ``config.num_labels`` or ``config.json['num_labels']``."""
    return f"{label}.{name}" if label == "config" else f"{label}[{name!r}]"


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
            _key(label, "architectures"),
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
            fn, _key(label, key), f"{want} (num_labels=1: one value per token, the value head; {archs[0]})", have
        )
    return CheckpointHead(kind, kind == "token" and bool(hf.get("token_classification_bias", True)))
