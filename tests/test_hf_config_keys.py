"""Tests for fnppo.io.hf.config_keys: every family reads its ``config.json`` through an allow-list.

Against transformers 5 (the reference): every key its config classes write is classified
(understood, irrelevant or refused), the defaults fnppo reads for absent keys are the classes'
defaults, and a config without those keys maps to what transformers fills in. Each refused key or
value is a ``config.json`` written to a temporary directory and loaded, refused naming the key, the
family and the value; no-op values are accepted and change nothing. That accepted configs give
transformers' logits is tests/test_hf.py's round trips (they load transformers-written configs).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from fnppo.core.errors import CheckpointError, InputError
from fnppo.io.hf import model_config_from_hf
from fnppo.io.hf.families import FAMILIES as RECORDS
from tests.messages import check_message, raises_message
from tests.test_hf import FAMILIES, MOE_FAMILIES

transformers = pytest.importorskip("transformers")

ALL = {**FAMILIES, **MOE_FAMILIES}  # model_type -> (transformers config class, a tiny config's kwargs)
_DROP = object()  # a key removed from the config


def _config_class(family: str):
    return getattr(transformers, ALL[family][0])


def _written(family: str, tmp_path: Path, **changes) -> Path:
    """The tiny config of ``family`` as transformers writes it (``to_dict``), changed, saved as
    ``tmp_path / config.json``."""
    d = _config_class(family)(**ALL[family][1]).to_dict()
    for key, value in changes.items():
        if value is _DROP:
            d.pop(key, None)
        else:
            d[key] = value
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path


def _transformers_keys(family: str) -> set[str]:
    """Every key a transformers config class of ``family`` writes or reads: its defaults' ``to_dict``,
    its dataclass fields and the other names of its ``attribute_map``."""
    cls = _config_class(family)
    return set(cls().to_dict()) | {f.name for f in dataclasses.fields(cls)} | set(cls.attribute_map)


@pytest.mark.parametrize("family", sorted(RECORDS))
def test_every_key_of_transformers_config_classes_is_classified(family):
    """A key transformers adds to a family's class fails here until it is classified."""
    keys = RECORDS[family].allow_list
    kinds = {k: keys[k].kind if k in keys else None for k in _transformers_keys(family)}
    assert {k for k, kind in kinds.items() if kind is None} == set(), family
    assert set(kinds.values()) <= {"understood", "irrelevant", "refused"}
    # the architecture is understood, bookkeeping irrelevant
    for key in ("hidden_size", "num_key_value_heads", "rms_norm_eps", "rope_parameters", "tie_word_embeddings"):
        assert kinds[key] == "understood", (family, key)
    for key in ("use_cache", "bos_token_id", "transformers_version", "output_hidden_states", "return_dict"):
        assert kinds[key] == "irrelevant", (family, key)
    assert all(rule.why for rule in keys.values())


@pytest.mark.parametrize("family", sorted(RECORDS))
def test_defaults_of_absent_keys_are_transformers_defaults(family):
    """``Family.defaults`` against the config class's own defaults (its dataclass fields; RoPE theta
    its ``default_theta``; a key it has no field for: transformers' ``getattr`` fallback, None)."""
    cls = _config_class(family)
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    for key, ours in RECORDS[family].defaults.items():
        theirs = cls.default_theta if key == "rope_theta" else fields.get(key)
        assert ours == theirs and type(ours) is type(theirs), (family, key, ours, theirs)


_SIZES = dict(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=32)
_MOE_SIZES = {
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("family", sorted(RECORDS))
def test_absent_keys_read_as_transformers_reads_them(family):
    """A config of sizes only maps to what transformers fills in for the same dict: query groups,
    head dim, RoPE theta, norm epsilon, positions, tied embeddings, the MoE router."""
    minimal = {"model_type": family, **_SIZES, **_MOE_SIZES.get(family, {})}
    if family == "mistral":
        minimal["sliding_window"] = None  # transformers' default is a 4096-token window (refused below)
    ours = model_config_from_hf(minimal)
    tc = _config_class(family)(**minimal)
    assert ours == model_config_from_hf(tc.to_dict())
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads  # transformers' rule
    assert (ours.num_query_groups, ours.kv_channels) == (tc.num_key_value_heads, head_dim)
    assert ours.rotary_base == tc.rope_parameters["rope_theta"] and not ours.rope_scaling
    assert ours.layernorm_epsilon == tc.rms_norm_eps and ours.max_seq_len == tc.max_position_embeddings
    assert ours.tie_embeddings == tc.tie_word_embeddings and ours.init_method_std == tc.initializer_range
    if family == "qwen2_moe":
        assert ours.add_qkv_bias == tc.qkv_bias and ours.moe_shared_expert_size == tc.shared_expert_intermediate_size
    if family in ("qwen2_moe", "qwen3_moe"):
        assert ours.moe_pre_softmax == (not tc.norm_topk_prob)
    if family in _MOE_SIZES:
        assert (ours.num_experts, ours.moe_topk) == (tc.num_experts, tc.num_experts_per_tok)


NOPE = [1, 0]  # SmolLM3: a layer without RoPE
_REFUSED = {  # case -> (family, config.json changes, the key the error names, expected, received)
    # keys that change the model in a way fnppo does not compute
    "smollm3-nope-layers": ("llama", dict(no_rope_layers=NOPE), "no_rope_layers", "None or [1] * 2", "[1, 0]"),
    "smollm3-nope-interval": ("llama", dict(no_rope_layer_interval=4), "no_rope_layer_interval", "no such key", "4"),
    "interleaved-rope": ("llama", dict(rope_interleave=True), "rope_interleave", "False (interleaved RoPE", "True"),
    "partial-rotary": ("qwen2", dict(partial_rotary_factor=0.5), "partial_rotary_factor", "1.0 (RoPE on part", "0.5"),
    "partial-rotary-in-rope-parameters": (
        "qwen3",
        dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
        "rope_parameters['partial_rotary_factor']",
        "1.0 (these families rotate the whole head)",
        "0.5",
    ),
    "rope-entry-unknown": (
        "llama",
        dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 2])),
        "rope_parameters['mrope_section']",
        "no such entry (rope_type 'default' has",
        "[2, 2]",
    ),
    "rope-scaling-beside-rope-parameters": (
        "llama",
        dict(rope_scaling=dict(rope_type="linear", factor=2.0)),
        "rope_scaling",
        "None or rope_parameters' entries (transformers 5 would read rope_scaling",
        "{'rope_type': 'linear', 'factor': 2.0}",
    ),
    "rope-type-and-type-differ": (
        "llama",
        dict(rope_parameters=dict(rope_type="default", type="llama3", rope_theta=1e4)),
        "rope_parameters['type']",
        "absent or 'default', the rope_type",
        "'llama3'",
    ),
    "rope-type-yarn": (
        "mistral",
        dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)),
        "rope_parameters",
        "rope_type 'default' or 'llama3'",
        "'yarn'",
    ),
    "rope-theta-text": (
        "qwen2",
        dict(rope_parameters=dict(rope_type="default", rope_theta="1e6")),
        "rope_parameters['rope_theta']",
        "a finite number > 0",
        "'1e6'",
    ),
    "rope-theta-negative-v4": (
        "llama",
        dict(rope_parameters=_DROP, rope_theta=-1.0),
        "rope_theta",
        "a finite number > 0 (the RoPE base)",
        "-1.0",
    ),
    "llama3-factor-text": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=5e5,
                factor="32",
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            )
        ),
        "rope_parameters['factor']",
        "a finite number > 0",
        "'32'",
    ),
    "quantized": (
        "qwen2",
        dict(quantization_config={"quant_method": "awq"}),
        "quantization_config",
        "no such key (quantized",
        "awq",
    ),
    "custom-code": (
        "llama",
        dict(auto_map={"AutoModelForCausalLM": "m.M"}),
        "auto_map",
        "no such key (custom modeling",
        "m.M",
    ),
    "logit-softcapping": ("llama", dict(final_logit_softcapping=30.0), "final_logit_softcapping", "None (tanh", "30.0"),
    "multimodal-rope": ("qwen2", dict(use_mrope=True), "use_mrope", "False (multimodal RoPE", "True"),
    "encoder-decoder": (
        "llama",
        dict(is_encoder_decoder=True),
        "is_encoder_decoder",
        "False (an encoder-decoder",
        "True",
    ),
    "pruned-heads": (
        "llama",
        dict(pruned_heads={"0": [1]}),
        "pruned_heads",
        "{} (attention heads pruned",
        "{'0': [1]}",
    ),
    "deepseek-router": (
        "qwen3_moe",
        dict(scoring_func="sigmoid"),
        "scoring_func",
        "no such key (a DeepSeek-style",
        "'sigmoid'",
    ),
    "unknown-key": (
        "llama",
        dict(attention_chunk_size=8192),
        "attention_chunk_size",
        "no such key: model_type 'llama' reads its config through an allow-list",
        "8192",
    ),
    "another-familys-key": (
        "qwen2_moe",
        dict(num_local_experts=4),
        "num_local_experts",
        "no such key: model_type 'qwen2_moe'",
        "4",
    ),
    "qkv-bias-key-of-qwen2-moe-in-qwen2": (
        "qwen2",
        dict(qkv_bias=False),
        "qkv_bias",
        "no such key: model_type 'qwen2'",
        "False",
    ),
    # per-layer attention
    "layer-types-sliding": (
        "qwen3",
        dict(layer_types=["full_attention", "sliding_attention"]),
        "layer_types",
        "None or ['full_attention'] * 2 (attention per layer",
        "['full_attention', 'sliding_attention']",
    ),
    "layer-types-one-short": (
        "qwen2",
        dict(layer_types=["full_attention"]),
        "layer_types",
        "None or ['full_attention'] * 2",
        "['full_attention']",
    ),
    "layer-types-a-string": (
        "mistral",
        dict(layer_types="full_attention"),
        "layer_types",
        "None or ['full_attention'] * 2",
        "'full_attention'",
    ),
    "qwen-sliding-window-on": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=4),
        "use_sliding_window",
        "False (sliding-window attention is not supported)",
        "True",
    ),
    "mistral-window-absent": (
        "mistral",
        dict(sliding_window=_DROP),
        "sliding_window",
        "None (sliding-window attention",
        "4096 (absent: transformers' default for model_type 'mistral')",
    ),
    "mixtral-window": (
        "mixtral",
        dict(sliding_window=4096),
        "sliding_window",
        "None (sliding-window attention",
        "4096",
    ),
    "sliding-window-in-llama": (
        "llama",
        dict(sliding_window=4096),
        "sliding_window",
        "None (sliding-window attention",
        "4096",
    ),
    # types and ranges
    "tie-string-false": (
        "llama",
        dict(tie_word_embeddings="false"),
        "tie_word_embeddings",
        "a bool (JSON true or false)",
        "'false'",
    ),
    "tie-int": ("qwen2", dict(tie_word_embeddings=0), "tie_word_embeddings", "a bool (JSON true or false)", "0"),
    "tie-null": ("qwen3", dict(tie_word_embeddings=None), "tie_word_embeddings", "a bool (JSON true or false)", "None"),
    "qkv-bias-string": ("qwen2_moe", dict(qkv_bias="true"), "qkv_bias", "a bool (JSON true or false)", "'true'"),
    "norm-topk-int": ("qwen3_moe", dict(norm_topk_prob=1), "norm_topk_prob", "a bool (JSON true or false)", "1"),
    "use-sliding-window-string": (
        "qwen3",
        dict(use_sliding_window="false"),
        "use_sliding_window",
        "False (sliding-window",
        "'false'",
    ),
    "use-sliding-window-zero": (
        "qwen2",
        dict(use_sliding_window=0),
        "use_sliding_window",
        "False (sliding-window",
        "0",
    ),
    "router-jitter-false": (
        "mixtral",
        dict(router_jitter_noise=False),
        "router_jitter_noise",
        "0 (Megatron's",
        "False",
    ),
    "attention-bias-string": ("llama", dict(attention_bias="false"), "attention_bias", "False (o_proj bias", "'false'"),
    "max-positions-zero": (
        "llama",
        dict(max_position_embeddings=0),
        "max_position_embeddings",
        "an int >= 1 (mapped to max_seq_len) for model_type 'llama'",
        "0",
    ),
    "max-positions-text": (
        "mixtral",
        dict(max_position_embeddings="4096"),
        "max_position_embeddings",
        "an int >= 1",
        "'4096'",
    ),
    "layers-zero": ("qwen2", dict(num_hidden_layers=0), "num_hidden_layers", "an int >= 1 (a size of the model)", "0"),
    "hidden-bool": ("llama", dict(hidden_size=True), "hidden_size", "an int >= 1", "True"),
    "vocab-float": ("mistral", dict(vocab_size=128.0), "vocab_size", "an int >= 1", "128.0"),
    "vocab-absent": (
        "llama",
        dict(vocab_size=_DROP),
        "vocab_size",
        "a value (a size of the model) for model_type 'llama'",
        "no such key",
    ),
    "eps-nan": (
        "llama",
        dict(rms_norm_eps=math.nan),
        "rms_norm_eps",
        "a finite number > 0 (mapped to layernorm_epsilon)",
        "nan",
    ),
    "eps-zero": ("qwen3", dict(rms_norm_eps=0.0), "rms_norm_eps", "a finite number > 0", "0.0"),
    "init-negative": ("llama", dict(initializer_range=-0.02), "initializer_range", "a finite number >= 0", "-0.02"),
    "dropout-one": ("qwen2", dict(attention_dropout=1.0), "attention_dropout", "a finite number >= 0 and < 1", "1.0"),
    "dtype-int8": ("llama", dict(dtype="int8"), "dtype", "None or one of ['bf16', 'bfloat16'", "'int8'"),
    "kv-heads-not-a-divisor": (
        "llama",
        dict(num_key_value_heads=3),
        "num_key_value_heads",
        "a divisor of num_attention_heads 4",
        "3",
    ),
    "kv-heads-absent-mistral": (
        "mistral",
        dict(num_key_value_heads=_DROP),
        "num_key_value_heads",
        "a divisor of num_attention_heads 4",
        "8 (absent: transformers' default)",
    ),
    "head-dim-zero": ("qwen3", dict(head_dim=0), "head_dim", "an int >= 1 or None", "0"),
    "hidden-act": (
        "qwen2",
        dict(hidden_act="gelu_pytorch_tanh"),
        "hidden_act",
        "'silu' (SwiGLU) for model_type 'qwen2'",
        "'gelu_pytorch_tanh'",
    ),
    "mlp-only-layers-out-of-range": (
        "qwen3_moe",
        dict(mlp_only_layers=[5]),
        "mlp_only_layers",
        "None or a list of layer indices in [0, 2)",
        "[5]",
    ),
    "sparse-step-zero": ("qwen2_moe", dict(decoder_sparse_step=0), "decoder_sparse_step", "an int >= 1", "0"),
    "experts-and-alias-differ": (
        "mixtral",
        dict(num_experts=8),
        "num_experts",
        "absent or 4, the num_local_experts (transformers reads the two as one) for model_type 'mixtral'",
        "8",
    ),
    "topk-above-experts": (
        "qwen2_moe",
        dict(num_experts_per_tok=5),
        "num_experts_per_tok",
        "at most num_experts (4) for model_type 'qwen2_moe'",
        "5",
    ),
    "router-jitter": (
        "mixtral",
        dict(router_jitter_noise=0.01),
        "router_jitter_noise",
        "0 (Megatron's input jitter",
        "0.01",
    ),
    "shared-expert-negative": (
        "qwen2_moe",
        dict(shared_expert_intermediate_size=-1),
        "shared_expert_intermediate_size",
        "an int >= 0",
        "-1",
    ),
    "normalize-reward-string": (
        "llama",
        dict(normalize_reward="false"),
        "normalize_reward",
        "a bool (JSON true or false)",
        "'false'",
    ),
    # another family whose keys look like Llama's (its RoPE layout is not the record's)
    "smollm3-model-type": (
        "llama",
        dict(model_type="smollm3", architectures=["SmolLM3ForCausalLM"], no_rope_layers=NOPE),
        "model_type",
        "one of: LlamaForCausalLM (model_type 'llama')",
        "model_type='smollm3'",
    ),
    "glm-model-type": (
        "llama",
        dict(model_type="glm", architectures=["GlmForCausalLM"], partial_rotary_factor=0.5),
        "model_type",
        "one of: LlamaForCausalLM (model_type 'llama')",
        "model_type='glm'",
    ),
}


@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_refused_configs_name_the_key_the_family_and_the_value(case, tmp_path):
    family, changes, key, expected, received = _REFUSED[case]
    with pytest.raises(InputError) as err:
        model_config_from_hf(_written(family, tmp_path, **changes))
    check_message(err.value, InputError, "model_config_from_hf", f"config.{key}", expected, received)
    if key != "model_type":  # the family is named (an unknown model_type is its own name)
        assert f"model_type {family!r}" in str(err.value), str(err.value)


_NO_OPS = {  # family -> keys at values that change nothing (transformers computes the same model)
    "llama": dict(
        no_rope_layers=[1, 1],
        rope_interleave=False,
        partial_rotary_factor=1.0,
        layer_types=["full_attention", "full_attention"],
        sliding_window=None,
        use_sliding_window=False,
        rope_scaling=None,
        pruned_heads={},
        temperature=0.7,
        max_length=20,
        use_cache=False,
        torch_dtype="float32",
        _attn_implementation_autoset=True,
        pretraining_tp=2,
        pad_token_id=0,
        tokenizer_class="LlamaTokenizer",
    ),
    "qwen2": dict(use_sliding_window=False, sliding_window=4096, max_window_layers=1, layer_types=None),
    "mixtral": dict(router_jitter_noise=0, num_experts=4, output_router_logits=True, router_aux_loss_coef=0.5),
    "qwen3_moe": dict(num_experts=4, use_sliding_window=False, sliding_window=None),
}


@pytest.mark.parametrize("family", sorted(_NO_OPS))
def test_no_op_values_are_accepted_and_change_nothing(family, tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "no-ops").mkdir()
    base = model_config_from_hf(_written(family, tmp_path / "base"))
    assert model_config_from_hf(_written(family, tmp_path / "no-ops", **_NO_OPS[family])) == base


@pytest.mark.parametrize(
    "text, cause",
    [
        ('{"model_type": "llama", "hidden_size": 6', "truncated or corrupt"),
        ("", "an empty file"),
        (b"\xff\xfe{", "not UTF-8 text"),
    ],
)
def test_a_corrupt_config_json_is_a_checkpoint_error_naming_the_path_and_the_cause(text, cause, tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with raises_message(
        "model_config_from_hf",
        "config_or_path",
        "a JSON object in config.json",
        f"which is not valid JSON ({cause}",
        CheckpointError,
    ):
        model_config_from_hf(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(repr(str(path)))):
        model_config_from_hf(path)


@pytest.mark.parametrize("text, kind", [("[1, 2]", "array"), ('"llama"', "string"), ("null", "null"), ("7", "number")])
def test_a_config_json_that_is_not_an_object_is_a_checkpoint_error(text, kind, tmp_path):
    (tmp_path / "config.json").write_text(text)
    with raises_message(
        "model_config_from_hf",
        "config_or_path",
        "a JSON object in config.json",
        f"{str(tmp_path / 'config.json')!r}, which holds a JSON {kind}",
        CheckpointError,
    ):
        model_config_from_hf(tmp_path)
