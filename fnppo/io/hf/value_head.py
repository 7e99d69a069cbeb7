"""A value model's head in Hugging Face checkpoints: which stored head a checkpoint holds and how it is
read (:func:`value_head_of`: transformers' classifiers, TRL's, OpenRLHF's and verl's critics, with
OpenRLHF's reward normalisation folded in), and the ``config.json`` a value model is exported with
(:func:`token_classification_config`: ``<Family>ForTokenClassification``, ``num_labels=1``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from fnppo.core.errors import input_error
from fnppo.io.hf.arch import Arch
from fnppo.io.hf.families import TOKEN_CLASSIFICATION_ARCHITECTURES, VALUE_HEAD_LAYOUTS, CheckpointHead


@dataclasses.dataclass(frozen=True)
class ValueHead:
    """How a value model's head is read from a checkpoint: ``values = scale * (w . h + b) + shift``
    with ``w``, ``b`` the tensors ``names`` (``b = 0`` where there is none) of layout ``layout``
    (a key of :data:`VALUE_HEAD_LAYOUTS`, or ``"openrlhf"`` for a ``value_head_prefix`` of its own);
    loaded as ``value_head.weight = scale * w``, ``value_head.bias = scale * b + shift``."""

    layout: str
    names: tuple[str, str | None]
    scale: float = 1.0
    shift: float = 0.0


def value_head_of(
    fn: str,
    a: Arch,
    described: CheckpointHead | None,
    hf: Mapping[str, Any] | None,
    shapes: Mapping[str, tuple[int, ...]],
    vocab: int,
) -> ValueHead | None:
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
        return ValueHead(key, layouts[key])
    if described is not None and described.kind == "openrlhf":
        assert hf is not None
        prefix = hf.get("value_head_prefix")
        if prefix is None:
            found = [p for p in ("score", "value_head") if f"{p}.weight" in shapes]
            if len(found) != 1:
                raise input_error(
                    fn,
                    "config.json['value_head_prefix']",
                    "the name of OpenRLHF's value head (its --value_head_prefix: 'score' or 'value_head'), "
                    "needed when the checkpoint does not hold exactly one of 'score.weight' / 'value_head.weight'",
                    f"no such key, and {'both' if found else 'neither'} of them stored",
                )
            prefix = found[0]
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", prefix):
            raise input_error(
                fn, "config.json['value_head_prefix']", "a module name such as 'score' or 'value_head'", repr(prefix)
            )
        head = ValueHead("openrlhf", (f"{prefix}.weight", None))
        if not hf.get("normalize_reward"):
            return head
        stats = {}
        for key, default in (("mean", 0.0), ("std", 1.0)):
            v = hf.get(key, default)
            ok = (
                isinstance(v, (int, float))
                and not isinstance(v, bool)
                and math.isfinite(v)
                and (key == "mean" or v > 0)
            )
            if not ok:
                raise input_error(
                    fn,
                    f"config.json[{key!r}]",
                    f"a finite number{' > 0' if key == 'std' else ''}"
                    f" (OpenRLHF's reward {key}: normalize_reward is true)",
                    repr(v),
                )
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
        raise input_error(
            fn,
            "path",
            "one value head (one of: " + ", ".join(f"{layouts[k][0]!r}" for k in layouts if k != "score-no-bias") + ")",
            "a checkpoint with " + " and ".join(repr(layouts[k][0]) for k in found),
        )
    return ValueHead(found[0], layouts[found[0]]) if found else None


def token_classification_config(a: Arch, hf: Mapping[str, Any], described: CheckpointHead | None) -> dict[str, Any]:
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
