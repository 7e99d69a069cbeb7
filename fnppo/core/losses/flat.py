"""Flat (verl-style) loss settings as sugar over the parts: :func:`from_flat` (pure Python).

``from_flat(policy_loss="cispo", cispo_clip_high=0.3, kl_coef=0.05)`` builds the
:class:`~fnppo.core.losses.config.LossConfig` of parts that behaves exactly as the flat settings
always did. The names and defaults are the former ``PolicyLossConfig`` fields (:data:`DEFAULTS`);
:data:`POLICY_LOSSES` is a read-only table from ``policy_loss`` names to the built-in losses that
have one (:data:`~fnppo.core.losses.builtins.BUILTIN_LOSSES`; not a registry: a policy loss of your own is passed to
``LossConfig(policy=...)`` directly), and :data:`LOSS_FIELDS` says which flat fields each of them reads.

Every value is checked by the rule of the part it goes to, named by its flat name (one rule, two
namings). Beyond that, a field the chosen policy loss does not read must keep its default (e.g.
``cispo_clip_high`` with ``policy_loss="ppo"``): a setting that would silently do nothing is refused.

The mapping: ``policy_loss`` and its fields -> ``policy``; ``loss_agg_mode``, ``loss_scale_factor``
-> ``agg``; ``entropy_coeff`` -> ``entropy_coef``; ``kl_coef``, ``kl_estimator`` -> ``kl``
(``kl=None`` for ``kl_coef == 0`` with the default estimator ``"k3"``, which reports the same
``kl_loss`` metric); the ``tis_*`` and ``reject_seq_*`` fields -> ``correction`` (``None`` unless
``tis_cap``, a ``tis_reject_*`` bound or a ``reject_seq_*`` criterion is set; ``tis_level`` and
``tis_reject_level`` alone correct nothing, as before); ``bypass_old_logprobs`` and
``log_ratio_clamp`` as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from fnppo.core.errors import input_error
from fnppo.core.losses.aggregate import Aggregation, check_agg
from fnppo.core.losses.builtins import BUILTIN_LOSSES
from fnppo.core.losses.checks import Checker
from fnppo.core.losses.config import LossConfig, check_cross
from fnppo.core.losses.kl import KLPenalty, check_kl
from fnppo.core.losses.policy import PolicyLoss, ppo_clip
from fnppo.core.losses.rollout_correction import (
    SEQ_REJECTION_CRITERIA,
    RolloutCorrection,
    check_clamp,
    check_correction,
)

__all__ = ["POLICY_LOSSES", "LOSS_FIELDS", "DEFAULTS", "from_flat"]

_FN = "fnppo.losses.from_flat"


def _default(cls: type, attr: str) -> Any:
    """The default of a dataclass field (each default is written once, in its part)."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == attr)


_FLAT = tuple(cls for cls in BUILTIN_LOSSES if cls.flat_name is not None)

POLICY_LOSSES: Mapping[str, Callable[..., PolicyLoss]] = MappingProxyType({cls.flat_name: cls for cls in _FLAT})
"""``policy_loss`` name -> the built-in loss (read-only), derived from the classes' ``flat_name``."""

LOSS_FIELDS: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {cls.flat_name: MappingProxyType(dict(cls.flat_fields)) for cls in _FLAT}
)
"""``policy_loss`` name -> ``{flat field: argument of its factory}``: the fields each loss reads."""


def _policy_defaults() -> dict[str, Any]:
    """Each flat policy field's default: its class's field default (one value where classes share a field)."""
    out: dict[str, Any] = {}
    for cls in _FLAT:
        for field, attr in cls.flat_fields.items():
            value = _default(cls, attr)
            if out.setdefault(field, value) != value:  # a programming error in a class, caught at import
                raise TypeError(f"flat field {field!r}: default {value!r} of {cls.__name__} != {out[field]!r}")
    return out


_CORRECTION = MappingProxyType(
    {
        "cap": "tis_cap",
        "level": "tis_level",
        "reject_low": "tis_reject_low",
        "reject_high": "tis_reject_high",
        "reject_level": "tis_reject_level",
        "batch_normalize": "tis_batch_normalize",
    }
)
"""Rule name of the rollout correction -> flat field (the ``reject_seq_*`` names are the same)."""

_CORRECTION_ATTR = MappingProxyType({"cap": "tis_cap"})  # rule name -> RolloutCorrection attribute where they differ

DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "policy_loss": ppo_clip.flat_name,
        **{f: v for f, v in _policy_defaults().items() if f.startswith("clip_ratio")},
        "loss_agg_mode": _default(Aggregation, "mode"),
        "loss_scale_factor": _default(Aggregation, "scale"),
        "entropy_coeff": _default(LossConfig, "entropy_coef"),
        "kl_coef": 0.0,  # KLPenalty has no default coef; 0 means "no penalty" (kl=None)
        "kl_estimator": _default(KLPenalty, "estimator"),
        **{flat: _default(RolloutCorrection, _CORRECTION_ATTR.get(rule, rule)) for rule, flat in _CORRECTION.items()},
        "log_ratio_clamp": _default(LossConfig, "log_ratio_clamp"),
        **{f: v for f, v in _policy_defaults().items() if not f.startswith("clip_ratio")},
        "bypass_old_logprobs": _default(LossConfig, "bypass_old_logprobs"),
        **{name: _default(RolloutCorrection, name) for name in (*SEQ_REJECTION_CRITERIA, "m2_threshold")},
    }
)
"""Every flat field and its default (the former ``PolicyLossConfig``'s), derived from the parts' field defaults."""

_CROSS = MappingProxyType(
    {
        "correction.tis_cap": "tis_cap",
        "correction.batch_normalize": "tis_batch_normalize",
        "correction.m2_threshold": "m2_threshold",
    }
)
"""Path of a setting read by the rules across parts -> flat field."""


def _checker(v: Mapping[str, Any], flat_of: Mapping[str, str]) -> Checker:
    """A checker reading rule names through ``flat_of`` (rule name -> flat field), naming the flat field."""
    return Checker(_FN, lambda arg: v[flat_of.get(arg, arg)], lambda arg: flat_of.get(arg, arg))


def _merge(flat: Mapping[str, Any] | None, fields: dict[str, Any]) -> dict[str, Any]:
    """The given fields over the defaults; refuses a field given twice, a non-string or an unknown key."""
    given = dict(fields)
    if flat is not None:
        if not isinstance(flat, Mapping):
            raise input_error(_FN, "flat", "a mapping of flat field names to values, or None", repr(flat))
        for key, value in flat.items():
            if key in given:
                raise input_error(
                    _FN,
                    str(key),
                    "a field given once (in the mapping or as a keyword)",
                    f"{value!r} and {given[key]!r}",
                )
            given[key] = value
    for key in given:
        if not isinstance(key, str) or key not in DEFAULTS:
            raise input_error(_FN, str(key), f"a flat loss field, one of {sorted(DEFAULTS)}", repr(given[key]))
    return {**DEFAULTS, **given}


def _check(v: Mapping[str, Any]) -> tuple[float, float] | None:
    """Every field by the rule of its part, then the rules across parts; returns the mean bounds."""
    for arg in ("bypass_old_logprobs", "tis_batch_normalize"):
        if not isinstance(v[arg], bool):
            raise input_error(_FN, arg, "a bool", f"{v[arg]!r} ({type(v[arg]).__name__})")
    name = v["policy_loss"]
    if not isinstance(name, str) or name not in POLICY_LOSSES:
        raise input_error(
            _FN,
            "policy_loss",
            f"one of {sorted(POLICY_LOSSES)} (a loss of your own: LossConfig(policy=my_loss))",
            repr(name),
        )
    ppo_clip.rule(_checker(v, {b: a for a, b in ppo_clip.flat_fields.items()}))
    check_agg(_checker(v, {"mode": "loss_agg_mode", "scale": "loss_scale_factor"}))
    _checker(v, {}).number("entropy_coeff", 0)
    check_kl(_checker(v, {"coef": "kl_coef", "estimator": "kl_estimator"}))
    c = _checker(v, _CORRECTION)
    bounds = check_correction(c)
    check_clamp(c)
    for cls in _FLAT:
        if cls is not ppo_clip:
            cls.rule(_checker(v, {b: a for a, b in cls.flat_fields.items()}))
    policy_fields = {f for fields in LOSS_FIELDS.values() for f in fields}
    for field in sorted(policy_fields - set(LOSS_FIELDS[name])):
        if v[field] != DEFAULTS[field]:
            raise input_error(
                _FN, field, f"its default {DEFAULTS[field]!r} (policy_loss={name!r} does not read it)", repr(v[field])
            )
    return bounds


def _correction(v: Mapping[str, Any], bounds: tuple[float, float] | None) -> RolloutCorrection | None:
    """The rollout correction of the flat fields, None when none of them corrects anything."""
    active = [
        v["tis_cap"],
        v["tis_reject_low"],
        v["tis_reject_high"],
        v["m2_threshold"],
        *(v[n] for n in SEQ_REJECTION_CRITERIA),
    ]
    if all(x is None for x in active):
        return None
    return RolloutCorrection(
        v["tis_cap"],
        v["tis_level"],
        v["tis_reject_low"],
        v["tis_reject_high"],
        v["tis_reject_level"],
        v["tis_batch_normalize"],
        v["reject_seq_k2"],
        v["reject_seq_k3"],
        bounds,
        v["reject_seq_max_abs_log_ratio"],
        v["m2_threshold"],
    )


def from_flat(flat: Mapping[str, Any] | None = None, /, **fields: Any) -> LossConfig:
    """The :class:`~fnppo.core.losses.config.LossConfig` of flat (verl-style) settings.

    ``from_flat({"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"})`` and
    ``from_flat(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean")`` are the same. The fields,
    their defaults (:data:`DEFAULTS`) and their rules are those of the former ``PolicyLossConfig``;
    ``ppo_loss`` with ``from_flat(**flat)`` computes exactly what the flat config computed (the
    mapping to parts is in the module docstring).

    Args:
        flat: a mapping of flat field names to values (e.g. a section of a YAML file), or None.
        fields: the same as keywords.

    Returns:
        The validated :class:`LossConfig`.

    Raises:
        InputError: ``fnppo.losses.from_flat: argument '<field>' ...``: an unknown field, a field
            given twice, an unknown ``policy_loss``, a value its part refuses (named by its flat
            name), parts that do not combine (bypass mode with ``tis_cap`` and a ratio-based loss,
            ``tis_batch_normalize`` without ``tis_cap`` or in bypass mode), a field the chosen
            policy loss does not read set to a value other than its default.
    """
    v = _merge(flat, fields)
    bounds = _check(v)
    name = v["policy_loss"]
    policy = POLICY_LOSSES[name](**{arg: v[field] for field, arg in LOSS_FIELDS[name].items()})
    correction = _correction(v, bounds)
    check_cross(_checker(v, _CROSS), policy)
    kl = None if v["kl_coef"] == 0 and v["kl_estimator"] == "k3" else KLPenalty(v["kl_coef"], v["kl_estimator"])
    return LossConfig(
        policy,
        Aggregation(v["loss_agg_mode"], v["loss_scale_factor"]),
        v["entropy_coeff"],
        kl,
        correction,
        v["bypass_old_logprobs"],
        v["log_ratio_clamp"],
    )
