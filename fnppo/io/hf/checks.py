"""A Hugging Face ``config.json`` against the model it is loaded into or exported from
(:func:`check_hf_config`): every architecture entry, named as the file spells it (transformers 4 or
5 keys, absent keys taking transformers' defaults), compared with what the model was built for.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fnppo.core.errors import input_error
from fnppo.io.hf.arch import Arch
from fnppo.io.hf.config import LLAMA3_FIXED, hf_experts_key, hf_moe_layers
from fnppo.io.hf.families import FAMILIES, SUPPORTED_ARCHITECTURES, CheckpointHead, MoELayout, checkpoint_head

_FULL_ATTENTION = ("sliding_window", "use_sliding_window", "layer_types")


def _model_fields(core: nn.Module, a: Arch) -> dict[str, Any]:
    """What the model was built for, in the keys of a Hugging Face ``config.json``.

    Rope and vocabulary come from the :class:`ModelConfig` that :func:`fnppo.megatron.build.build_gpt`
    keeps on the model (``fnppo_config``); a model built otherwise is compared on the rest.
    """
    family, f = a.family, FAMILIES[a.family]
    c, mc = core.config, getattr(core, "fnppo_config", None)
    out: dict[str, Any] = {
        "model_type": family,
        "architectures": [SUPPORTED_ARCHITECTURES[family]],
        "num_hidden_layers": a.num_layers,
        "hidden_size": a.hidden,
        "intermediate_size": a.ffn,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.groups,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "mlp_bias": False,
        "rms_norm_eps": float(c.layernorm_epsilon),
        "tie_word_embeddings": a.tied,
        "sliding_window": getattr(c, "window_size", None),
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * a.num_layers,
    }
    if f.attention_bias_key is not None:  # not read by families whose q/k/v bias is their own (Qwen2)
        out[f.attention_bias_key] = False
    if f.qkv_bias_key is not None:
        out[f.qkv_bias_key] = a.qkv_bias
    if a.value:  # a policy's trunk or a classifier's trunk and head: checkpoint_head checks which
        del out["architectures"]
    moe = f.moe
    if moe is not None:
        out.update({"num_experts": a.experts, "num_experts_per_tok": a.topk, moe.ffn_key: a.moe_ffn})
        if moe.jitter_key is not None:
            out[moe.jitter_key] = 0.0
        if moe.renormalize_key is not None:
            out[moe.renormalize_key] = not a.pre_softmax
        if moe.dense_layers_key is not None:
            out["dense_layers"] = [i for i in range(a.num_layers) if i not in a.moe_layers]
        if moe.shared_expert_key is not None:
            out[moe.shared_expert_key] = a.shared
    if mc is not None:
        out.update(
            vocab_size=mc.vocab_size,
            rope_theta=float(mc.rotary_base),
            partial_rotary_factor=float(mc.rotary_percent),
            rope_type="llama3" if mc.rope_scaling else "default",
        )
        if mc.rope_scaling:
            out.update(factor=float(mc.rope_scaling_factor), **LLAMA3_FIXED)
    return out


def _file_rope_fields(hf: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], Any]]:
    """Rope entries of a config as ``(field, key path in the file, value)``: transformers 5's
    ``rope_parameters`` or transformers 4's ``rope_theta`` / ``rope_scaling``, named as the file has them."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        where, scaling = "rope_parameters", params
        theta = (
            (("rope_parameters", "rope_theta"), params["rope_theta"])
            if "rope_theta" in params
            else (("rope_theta",), hf.get("rope_theta") or 10000.0)
        )
    else:
        where, scaling = "rope_scaling", hf.get("rope_scaling") or {}
        theta = (("rope_theta",), hf.get("rope_theta") or 10000.0)
    type_key = "type" if "type" in scaling and "rope_type" not in scaling else "rope_type"
    rope_type = scaling.get(type_key) or "default"
    out = [("rope_theta", theta[0], theta[1]), ("rope_type", (where, type_key), rope_type)]
    if rope_type == "llama3":
        out += [(k, (where, k), scaling.get(k, LLAMA3_FIXED.get(k))) for k in ("factor", *LLAMA3_FIXED)]
    partial = hf.get("partial_rotary_factor") or scaling.get("partial_rotary_factor")
    out.append(("partial_rotary_factor", ("partial_rotary_factor",), 1.0 if partial is None else partial))
    return out


def _file_fields(hf: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], Any]]:
    """The architecture entries of a ``config.json`` as ``(field, key path in the file, value)``, in
    the order they are reported (family first); absent keys take transformers' defaults."""
    family = hf.get("model_type")
    f = FAMILIES.get(family) if isinstance(family, str) else None
    out: list[tuple[str, tuple[str, ...], Any]] = [("model_type", ("model_type",), family)]
    if hf.get("architectures") is not None:
        out.append(("architectures", ("architectures",), list(hf["architectures"])))
    if f is not None and f.sliding_window_switch is not None:
        key = f.sliding_window_switch
        out.append((key, (key,), bool(hf.get(key) or False)))
    else:
        out.append(("sliding_window", ("sliding_window",), hf.get("sliding_window")))
    if hf.get("layer_types") is not None:
        out.append(("layer_types", ("layer_types",), list(hf["layer_types"])))
    out += _file_rope_fields(hf)
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ):
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
    if f is not None and f.qkv_bias_key is not None:
        out.append((f.qkv_bias_key, (f.qkv_bias_key,), bool(hf.get(f.qkv_bias_key, f.qkv_bias))))
    if f is not None and f.moe is not None:
        out += _file_moe_fields(f.moe, hf)
    return out


def _file_moe_fields(moe: MoELayout, hf: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], Any]]:
    """The MoE entries of a ``config.json`` (absent keys: transformers' defaults, or left out)."""
    keys = {"num_experts": hf_experts_key(moe, hf), "num_experts_per_tok": "num_experts_per_tok"}
    if moe.ffn_key != "intermediate_size":  # else compared with the dense entries
        keys[moe.ffn_key] = moe.ffn_key
    out = [(field, (key,), hf[key]) for field, key in keys.items() if key in hf]
    if moe.jitter_key is not None:
        out.append((moe.jitter_key, (moe.jitter_key,), float(hf.get(moe.jitter_key) or 0.0)))
    if moe.renormalize_key is not None:
        out.append((moe.renormalize_key, (moe.renormalize_key,), bool(hf.get(moe.renormalize_key) or False)))
    if moe.dense_layers_key is not None and isinstance(hf.get("num_hidden_layers"), int):
        layers = hf_moe_layers(moe, hf)
        dense = [i for i in range(hf["num_hidden_layers"]) if i not in layers]
        out.append(("dense_layers", (moe.dense_layers_key,), dense))
    if moe.shared_expert_key is not None:
        key = moe.shared_expert_key
        out.append((key, (key,), int(hf.get(key) or 0)))
    return out


def _same(want: Any, have: Any) -> bool:
    numbers = (int, float)
    if (
        isinstance(want, numbers)
        and isinstance(have, numbers)
        and not isinstance(want, bool)
        and not isinstance(have, bool)
    ):
        return float(want) == float(have)
    return want == have


def check_hf_config(
    fn: str, core: nn.Module, a: Arch, hf: Mapping[str, Any], label: str, where: str
) -> CheckpointHead | None:
    """Refuse a Hugging Face config whose architecture differs from the model's, naming every differing
    key (as the file spells it) with both values. ``label``: how the argument is named. Returns the
    head the config describes (:func:`checkpoint_head`; a language model's is ``lm``)."""
    model = _model_fields(core, a)
    diffs = [
        (path, model[field], have, field)
        for field, path, have in _file_fields(hf)
        if field in model and not _same(model[field], have)
    ]
    if not diffs:
        return checkpoint_head(fn, a.family, hf, label)
    path, want, have, field = diffs[0]
    why = ": full attention" if field in _FULL_ATTENTION else ""
    others = "".join(
        f"; also differs: {p[0]}{''.join(f'[{k!r}]' for k in p[1:])}: {h!r} (model: {w!r})" for p, w, h, _ in diffs[1:]
    )
    raise input_error(
        fn,
        label + "".join(f"[{k!r}]" for k in path),
        f"{want!r} (what the model was built for{why})",
        f"{have!r} ({where}{others})",
    )


def config_path(root: Path) -> Path:
    """The ``config.json`` beside a checkpoint (a directory, or one of its ``.safetensors`` files)."""
    return root / "config.json" if root.is_dir() else root.parent / "config.json"


def check_weight_dtype(fn: str, dtype: Any) -> None:
    """``dtype`` for exported / streamed weights: None (the parameters') or a floating ``torch.dtype``.

    Raises:
        InputError: an integer or bool dtype (weights would be truncated to whole numbers), or
            something that is not a ``torch.dtype`` (``"bf16"``, ``torch.Tensor``).
    """
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return
    raise input_error(fn, "dtype", "None or a floating torch.dtype (torch.bfloat16, torch.float32, ...)", repr(dtype))
