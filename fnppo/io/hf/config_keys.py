"""The allow-list through which a Hugging Face family reads its ``config.json`` (:func:`read_keys`).

Every key of a config is one of three kinds (:class:`Key`), listed once here for every family
(:data:`COMMON_KEYS`) and in the family's record for its own keys
(:attr:`fnppo.io.hf.families.Family.keys`):

* ``understood``: mapped into :class:`fnppo.megatron.config.ModelConfig` or read by the loader
  (sizes, RoPE, norm epsilon, biases, the MoE router, a classifier's labels). Its value is checked:
  a bool must be a JSON bool (``"false"`` is refused), a count an int >= 1 (``0`` is refused, not
  defaulted), a float finite; some accept only the value fnppo computes (``hidden_act: "silu"``,
  ``attention_bias: false``, ``layer_types`` all ``"full_attention"``).
* ``irrelevant``: no effect on the numbers fnppo computes, each with the reason (tokenizer ids,
  ``use_cache``, generation settings, which attention kernel transformers runs, ...).
* ``refused``: changes the model in a way fnppo does not compute (layers without RoPE, interleaved
  or partial RoPE, quantized weights, custom code, logit soft-capping, ...); accepted only at its
  no-op value where it has one (``no_rope_layers`` all 1, ``rope_interleave: false``).

A key listed nowhere is refused too: a key fnppo does not know may change the model. An absent key
takes the family's transformers default (:attr:`Key.default`: Mixtral's ``rms_norm_eps`` is 1e-5 and
its ``rope_theta`` 1e6, Mistral's ``sliding_window`` 4096, ...), checked like a written one.

Adding a key: a :class:`Key` in :data:`COMMON_KEYS` (every family) or in the family's ``keys``,
with its kind, what it means to fnppo, its check and (understood keys) transformers' default; then
the code that reads it (``fnppo/io/hf/config.py``) and a test in ``tests/test_hf_config_keys.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from fnppo.core.errors import input_error

Check = Callable[[Any, Mapping[str, Any]], "str | None"]
"""A value check: ``check(value, config)`` is ``None`` when the value is accepted, else what is expected."""

DTYPES: Mapping[str, str] = MappingProxyType(
    {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
)
"""``dtype`` / ``torch_dtype`` of a config -> :attr:`ModelConfig.dtype`."""


class Default(enum.Enum):
    """How an absent key is read."""

    ABSENT = "absent"  # stays absent (the code that reads it says what absence means)
    REQUIRED = "required"  # must be written


@dataclasses.dataclass(frozen=True)
class Key:
    """How a family reads one key of ``config.json``."""

    kind: str  # "understood", "irrelevant" or "refused" (module docstring)
    why: str  # understood: what fnppo maps it to; irrelevant: why it has no effect; refused: what it would change
    check: Check | None = None  # None: any value (irrelevant keys; keys checked where they are read)
    default: Any = Default.ABSENT  # transformers' default for the family, read when the key is absent


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values: numbers compare as numbers (``0 == 0.0``), anything else only to its own
    type (``0`` is not ``False``, ``"false"`` is not ``False``)."""
    if _finite(a) and _finite(b):
        return float(a) == float(b)
    return type(a) is type(b) and a == b


def int_at_least(low: int, none: bool = False) -> Check:
    """An int (not a bool, not a float) >= ``low`` (or None when ``none``)."""
    text = f"an int >= {low}" + (" or None" if none else "")
    return lambda v, hf: None if (none and v is None) or (_int(v) and v >= low) else text


def number(low: float, *, low_open: bool = False, high: float | None = None, high_open: bool = False) -> Check:
    """A finite real number (an int is fine, a bool or a string is not) in the given range."""
    text = f"a finite number {'>' if low_open else '>='} {low:g}"
    if high is not None:
        text += f" and {'<' if high_open else '<='} {high:g}"

    def check(v: Any, hf: Mapping[str, Any]) -> str | None:
        if not _finite(v) or v < low or (low_open and v == low):
            return text
        if high is not None and (v > high or (high_open and v == high)):
            return text
        return None

    return check


def boolean(v: Any, hf: Mapping[str, Any]) -> str | None:
    """A JSON bool (``"false"``, ``0``, ``1`` and ``None`` refused)."""
    return None if isinstance(v, bool) else "a bool (JSON true or false)"


def only(*values: Any) -> Check:
    """One of ``values`` (the value fnppo computes, or the key's no-op), compared as JSON values."""
    text = " or ".join(repr(x) for x in values)
    return lambda v, hf: None if any(_same(v, x) for x in values) else text


def never(v: Any, hf: Mapping[str, Any]) -> str | None:
    """No value accepted: the key must be absent."""
    return "no such key"


def _layers(hf: Mapping[str, Any]) -> int | None:
    n = hf.get("num_hidden_layers")
    return n if _int(n) else None


def full_attention_layers(v: Any, hf: Mapping[str, Any]) -> str | None:
    """``None`` or one ``"full_attention"`` per layer (what fnppo computes in every layer)."""
    n = _layers(hf)
    ok = v is None or (isinstance(v, list) and all(t == "full_attention" for t in v) and len(v) == n)
    return None if ok else f"None or ['full_attention'] * {n}"


def all_ones(v: Any, hf: Mapping[str, Any]) -> str | None:
    """``None`` or a 1 per layer (every layer with RoPE: SmolLM3's no-op ``no_rope_layers``)."""
    n = _layers(hf)
    ok = v is None or (isinstance(v, list) and len(v) == n and all(_int(x) and x == 1 for x in v))
    return None if ok else f"None or [1] * {n}"


def layer_indices(v: Any, hf: Mapping[str, Any]) -> str | None:
    """``None`` or a list of layer indices in ``[0, num_hidden_layers)``."""
    n = _layers(hf)
    ok = v is None or (isinstance(v, list) and all(_int(i) and 0 <= i < (n or 0) for i in v))
    return None if ok else f"None or a list of layer indices in [0, {n})"


def dtype_name(v: Any, hf: Mapping[str, Any]) -> str | None:
    """``None``, a torch dtype or its name (``"bfloat16"``, ``"torch.float32"``, ``"bf16"``)."""
    name = str(v).replace("torch.", "") if isinstance(v, (str, torch.dtype)) else None
    return None if v is None or name in DTYPES else f"None or one of {sorted(DTYPES)}"


def mapping_or_none(v: Any, hf: Mapping[str, Any]) -> str | None:
    return None if v is None or isinstance(v, Mapping) else "None or a JSON object"


def names_or_none(v: Any, hf: Mapping[str, Any]) -> str | None:
    return (
        None if v is None or (isinstance(v, list) and all(isinstance(a, str) for a in v)) else "None or a list of names"
    )


def understood(why: str, check: Check | None = None, default: Any = Default.ABSENT) -> Key:
    return Key("understood", why, check, default)


def irrelevant(why: str) -> Key:
    return Key("irrelevant", why)


def refused(why: str, check: Check = never) -> Key:
    return Key("refused", why, check)


_SIZE = "a size of the model"
_TOKEN_ID = "a tokenizer's special token id: fnppo takes token ids, and transformers' forward does not read it"
_OUTPUTS = "what transformers' forward returns, not what it computes"
_KERNEL = "which kernel transformers computes with: the same values"
_GENERATION = "a generation setting (transformers 4 kept them in config.json; transformers 5 drops them on load)"
_TASK = "a classifier's fine-tuning bookkeeping (its loss, not its outputs)"
_ENC_DEC = "an encoder-decoder or cross-attention model: these families are decoders"

COMMON_KEYS: Mapping[str, Key] = MappingProxyType(
    {
        # understood: mapped into ModelConfig or read by the loader
        "model_type": understood("the family (fnppo.io.hf.families.FAMILIES)", default=Default.REQUIRED),
        "architectures": understood("the head: *ForCausalLM or a classifier (checkpoint_head)", names_or_none),
        "vocab_size": understood(_SIZE, int_at_least(1), Default.REQUIRED),
        "hidden_size": understood(_SIZE, int_at_least(1), Default.REQUIRED),
        "intermediate_size": understood(_SIZE, int_at_least(1), Default.REQUIRED),
        "num_hidden_layers": understood(_SIZE, int_at_least(1), Default.REQUIRED),
        "num_attention_heads": understood(_SIZE, int_at_least(1), Default.REQUIRED),
        "num_key_value_heads": understood("mapped to num_query_groups; None: one per head", int_at_least(1, none=True)),
        "head_dim": understood(
            "mapped to kv_channels; None: hidden_size // num_attention_heads", int_at_least(1, none=True)
        ),
        "hidden_act": understood("SwiGLU", only("silu"), "silu"),
        "max_position_embeddings": understood("mapped to max_seq_len", int_at_least(1)),
        "initializer_range": understood("mapped to init_method_std", number(0.0), 0.02),
        "rms_norm_eps": understood("mapped to layernorm_epsilon", number(0.0, low_open=True)),
        "tie_word_embeddings": understood("mapped to tie_embeddings", boolean, False),
        "rope_parameters": understood("RoPE theta and scaling (transformers 5)", mapping_or_none),
        "rope_scaling": understood("RoPE scaling (transformers 4)", mapping_or_none),
        "rope_theta": understood("the RoPE base", number(0.0, low_open=True)),
        "attention_dropout": understood("mapped to attention_dropout", number(0.0, high=1.0, high_open=True), 0.0),
        "dtype": understood("the weights' dtype", dtype_name),
        "torch_dtype": understood("the weights' dtype (transformers 4's name)", dtype_name),
        "layer_types": understood(
            "attention per layer: fnppo computes full causal attention in every layer", full_attention_layers
        ),
        "id2label": understood("a classifier's labels (one for a value model)", mapping_or_none),
        "label2id": understood("a classifier's labels (one for a value model)", mapping_or_none),
        "num_labels": understood("a classifier's labels (one for a value model)", int_at_least(1, none=True)),
        "token_classification_bias": understood("score.bias of a token classifier", boolean),
        "value_head_prefix": understood("OpenRLHF's value head name (checked by value_head_of)"),
        "normalize_reward": understood("OpenRLHF's reward normalisation switch", boolean),
        "mean": understood("OpenRLHF's reward mean (checked by value_head_of when normalize_reward)"),
        "std": understood("OpenRLHF's reward std (checked by value_head_of when normalize_reward)"),
        # irrelevant: no effect on what fnppo computes
        "transformers_version": irrelevant("the transformers version that wrote the file"),
        "_name_or_path": irrelevant("where transformers loaded the config from"),
        "_commit_hash": irrelevant("the hub revision the file was downloaded at"),
        "use_cache": irrelevant("the key/value cache of generation: fnppo runs whole sequences"),
        "bos_token_id": irrelevant(_TOKEN_ID),
        "eos_token_id": irrelevant(_TOKEN_ID),
        "sep_token_id": irrelevant(_TOKEN_ID),
        "decoder_start_token_id": irrelevant(_TOKEN_ID),
        "pad_token_id": irrelevant(
            "a tokenizer's padding id (transformers' embedding padding_idx: it only zeroes that row's gradient "
            "in transformers' own training, not a logit)"
        ),
        "tokenizer_class": irrelevant("the tokenizer's class: fnppo takes token ids"),
        "prefix": irrelevant("a text prefix for generation"),
        "output_hidden_states": irrelevant(_OUTPUTS),
        "output_attentions": irrelevant(_OUTPUTS),
        "return_dict": irrelevant(_OUTPUTS),
        "use_return_dict": irrelevant(_OUTPUTS),
        "torchscript": irrelevant(_OUTPUTS),
        "output_router_logits": irrelevant(_OUTPUTS),
        "chunk_size_feed_forward": irrelevant("the MLP computed in chunks of positions: the same values"),
        "pretraining_tp": irrelevant("the pretraining tensor-parallel degree (transformers 4 sliced matmuls by it)"),
        "attn_implementation": irrelevant(_KERNEL),
        "_attn_implementation": irrelevant(_KERNEL),
        "_attn_implementation_autoset": irrelevant(_KERNEL),
        "experts_implementation": irrelevant(_KERNEL),
        "_experts_implementation": irrelevant(_KERNEL),
        "problem_type": irrelevant(_TASK),
        "finetuning_task": irrelevant(_TASK),
        "task_specific_params": irrelevant(_TASK),
        "is_decoder": irrelevant("transformers 4's decoder flag: these families are causal whatever it says"),
        "use_bfloat16": irrelevant("a TensorFlow-era flag transformers no longer reads"),
        "tf_legacy_loss": irrelevant("a TensorFlow-era flag transformers no longer reads"),
        "classifier_dropout": irrelevant("dropout before a classifier's score in transformers' training"),
        "hidden_dropout": irrelevant("these families read it only as a classifier's dropout in training"),
        **{
            k: irrelevant(_GENERATION)
            for k in (
                "assistant_confidence_threshold assistant_lookbehind bad_words_ids begin_suppress_tokens "
                "diversity_penalty do_sample early_stopping encoder_no_repeat_ngram_size encoder_repetition_penalty "
                "epsilon_cutoff eta_cutoff exponential_decay_length_penalty forced_bos_token_id forced_eos_token_id "
                "length_penalty max_length min_length no_repeat_ngram_size num_assistant_tokens "
                "num_assistant_tokens_schedule num_beam_groups num_beams num_return_sequences output_scores "
                "remove_invalid_values repetition_penalty return_dict_in_generate suppress_tokens "
                "target_lookbehind temperature top_k top_p typical_p"
            ).split()
        },
        # refused: a model fnppo does not compute (accepted at the no-op value where there is one)
        "quantization_config": refused("quantized weights (GPTQ, AWQ, bitsandbytes, fp8): fnppo loads float weights"),
        "auto_map": refused("custom modeling code (trust_remote_code): not transformers' class of the family"),
        "no_rope_layers": refused(
            "layers without positional encoding (SmolLM3's NoPE): fnppo applies RoPE in every layer", all_ones
        ),
        "no_rope_layer_interval": refused("layers without positional encoding (SmolLM3's NoPE layers)"),
        "rope_interleave": refused(
            "interleaved RoPE (adjacent channel pairs): these families rotate halves", only(False)
        ),
        "partial_rotary_factor": refused("RoPE on part of each head: these families rotate the whole head", only(1.0)),
        "rotary_pct": refused("RoPE on part of each head (GPT-NeoX's key)"),
        "rotary_dim": refused("RoPE on part of each head (GPT-J's key)"),
        "use_mrope": refused("multimodal RoPE sections (Qwen2-VL)", only(False)),
        "mrope_section": refused("multimodal RoPE sections (Qwen2-VL)", only(None)),
        "attention_bias": refused("a bias on q/k/v/o: this family has none", only(False)),
        "mlp_bias": refused("a bias on the MLP: these families have none", only(False)),
        "use_sliding_window": refused("sliding-window attention is not supported", only(False)),
        "sliding_window": refused("sliding-window attention is not supported", only(None)),
        "sliding_window_pattern": refused("alternating sliding-window layers (Gemma 2/3)"),
        "attn_logit_softcapping": refused("tanh soft-capping of attention scores (Gemma 2)", only(None)),
        "final_logit_softcapping": refused("tanh soft-capping of the logits (Gemma 2)", only(None)),
        "query_pre_attn_scalar": refused("another attention scale (Gemma 2)"),
        "embedding_multiplier": refused("scaled embeddings (Granite)"),
        "residual_multiplier": refused("scaled residuals (Granite)"),
        "attention_multiplier": refused("another attention scale (Granite)"),
        "logits_scaling": refused("scaled logits (Granite)"),
        "use_qk_norm": refused("q/k norm switched by a key (Cohere, Llama 4): the family fixes it", only(False)),
        "num_nextn_predict_layers": refused("multi-token prediction layers (DeepSeek-V3)", only(0)),
        "per_layer_config": refused("per-layer sizes (a heterogeneous model)", only(None)),
        "pruned_heads": refused("attention heads pruned after training", only({})),
        "is_encoder_decoder": refused(_ENC_DEC, only(False)),
        "add_cross_attention": refused(_ENC_DEC, only(False)),
        "tie_encoder_decoder": refused(_ENC_DEC, only(False)),
        "cross_attention_hidden_size": refused(_ENC_DEC, only(None)),
        **{
            k: refused("a DeepSeek-style router (sigmoid scores, group-limited top-k, scaled top-k, dense prefix)")
            for k in "scoring_func topk_method n_group topk_group routed_scaling_factor first_k_dense_replace".split()
        },
    }
)
"""The keys every family reads alike (a family's own :attr:`Family.keys` take precedence)."""


def allow_list(own: Mapping[str, Key], defaults: Mapping[str, Any]) -> Mapping[str, Key]:
    """A family's allow-list: :data:`COMMON_KEYS` under the family's ``own`` keys, with its
    transformers ``defaults`` (key -> value read when the key is absent)."""
    keys = {**COMMON_KEYS, **own}
    for key, value in defaults.items():
        keys[key] = dataclasses.replace(keys[key], default=value)
    return MappingProxyType(keys)


def key_name(label: str, name: str) -> str:
    """How an entry of a config is named in errors: ``config.num_labels`` or ``config.json['num_labels']``."""
    return f"{label}.{name}" if label == "config" else f"{label}[{name!r}]"


def shown(v: Any, limit: int = 200) -> str:
    """``repr(v)``, cut to ``limit`` characters (a list per layer can be long)."""
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 5] + " ...]"


def read_keys(fn: str, model_type: str, keys: Mapping[str, Key], hf: Mapping[str, Any], label: str) -> dict[str, Any]:
    """The config ``hf`` of family ``model_type`` read through its allow-list ``keys``: every key
    checked (:class:`Key`), absent keys given their default. Returns a new dict; ``hf`` is unchanged.

    Raises:
        InputError: a key not in ``keys``, a value its check refuses, an absent required key; naming
            the key (``label`` as in :func:`key_name`), the family, what is accepted and the value.
    """
    full = dict(hf)
    absent = {k for k, rule in keys.items() if k not in full and rule.default is not Default.ABSENT}
    for key in sorted(absent):
        if keys[key].default is Default.REQUIRED:
            raise input_error(
                fn, key_name(label, key), f"a value ({keys[key].why}) for model_type {model_type!r}", "no such key"
            )
        full[key] = keys[key].default
    required = [k for k, rule in keys.items() if rule.default is Default.REQUIRED]  # the sizes first: others read them
    for key in [*required, *(k for k in full if k not in required)]:
        value, rule = full[key], keys.get(key)
        if rule is None:
            raise input_error(
                fn,
                key_name(label, key),
                f"no such key: model_type {model_type!r} reads its config through an allow-list, and a key it "
                "does not know may change the model (docs/huggingface.md says how to add one)",
                shown(value),
            )
        expected = None if rule.check is None else rule.check(value, full)
        if expected is not None:
            note = f" (absent: transformers' default for model_type {model_type!r})" if key in absent else ""
            raise input_error(
                fn, key_name(label, key), f"{expected} ({rule.why}) for model_type {model_type!r}", shown(value) + note
            )
    return full
