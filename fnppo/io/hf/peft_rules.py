"""PEFT's rules for which module or parameter an ``adapter_config.json`` names, and with what rank and alpha.

``peft`` (0.21) resolves, for every adapted module (``model.layers.0.self_attn.q_proj``) and every
adapted parameter (``model.layers.1.mlp.experts.gate_up_proj``, its ``target_parameters``), its
rank and alpha from ``r`` / ``lora_alpha`` unless a key of ``rank_pattern`` / ``alpha_pattern``
matches it. A key ``k`` matches the name ``n`` when the regular expression ``(.*\\.)?(k)$`` matches
``n`` from its start: ``k`` is a regular expression for the whole name or for a dot-separated tail
of it (``down_proj``, ``mlp.experts.down_proj`` and ``model.layers.0.mlp.experts.down_proj`` all
match the last name; only the last matches nothing of layer 1). The first matching key, in the
dict's order, wins (:func:`pattern_key`). A ``target_parameters`` entry ``t`` names the parameter
``n`` when ``n == t`` or ``n`` ends with ``"." + t`` (:func:`names_parameter`): ``gate_up_proj``,
``mlp.experts.gate_up_proj`` and the full name are all accepted, the full name for that layer only.

``peft`` warns (``"... keys did not match any targeted module and were ignored"``) for a pattern
key that matches no adapted *module*, even when it did set a parameter's rank; :func:`write_patterns`
chooses the defaults and keys so that every key it writes matches an adapted module, where one
exists.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from fnppo.core.errors import input_error

__all__ = ["pattern_key", "names_parameter", "check_patterns", "resolve", "write_patterns", "PATTERNS"]

#: the ``adapter_config.json`` keys of per-module ranks and alphas
PATTERNS = ("rank_pattern", "alpha_pattern")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def pattern_key(patterns: Mapping[str, Any], name: str) -> str | None:
    """The first key of ``patterns`` that matches ``name`` by PEFT's rule (``(.*\\.)?(key)$`` from
    the start of ``name``), or None."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


def names_parameter(targets: Sequence[str], name: str) -> bool:
    """Whether ``target_parameters`` ``targets`` name the parameter ``name`` (equal, or a dot-separated tail)."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_patterns(fn: str, cfg: Mapping[str, Any], file: str) -> None:
    """Refuse ``rank_pattern`` / ``alpha_pattern`` that are not a dict of regular expressions to a
    positive int rank / a finite alpha > 0, and ``r`` / ``lora_alpha`` of the same kinds."""
    for key, integer in (("r", True), ("lora_alpha", False)):
        v = cfg.get(key)
        if not _is_number(v) or v <= 0 or (integer and isinstance(v, float) and not v.is_integer()):
            raise input_error(fn, f"{file}[{key!r}]", "a positive int" if integer else "a finite number > 0", repr(v))
    for key in PATTERNS:
        patterns = cfg.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise input_error(fn, f"{file}[{key!r}]", "a dict of regular expressions to numbers", repr(patterns))
        for pat, v in patterns.items():
            try:
                re.compile(pat)
            except re.error as err:
                raise input_error(
                    fn, f"{file}[{key!r}]", "keys that are regular expressions", f"{pat!r} ({err})"
                ) from None
            rank = key == "rank_pattern"
            if not _is_number(v) or v <= 0 or (rank and isinstance(v, float) and not v.is_integer()):
                what = "a positive int rank" if rank else "a finite alpha > 0"
                raise input_error(fn, f"{file}[{key!r}][{pat!r}]", what, repr(v))


def resolve(fn: str, cfg: Mapping[str, Any], names: Sequence[str], file: str) -> dict[str, tuple[int, float]]:
    """``(rank, alpha)`` of each adapted module or parameter ``names`` by PEFT's rules.

    Raises:
        InputError: a ``rank_pattern`` / ``alpha_pattern`` key that matches none of ``names``
            (``peft`` ignores it with a warning; here it is a mistake named before anything is built).
    """
    out = {}
    used: dict[str, set[str]] = {k: set() for k in PATTERNS}
    for name in names:
        values = []
        for key, default in (("rank_pattern", cfg["r"]), ("alpha_pattern", cfg["lora_alpha"])):
            patterns = cfg.get(key) or {}
            hit = pattern_key(patterns, name)
            if hit is not None:
                used[key].add(hit)
            values.append(default if hit is None else patterns[hit])
        out[name] = (int(values[0]), float(values[1]))
    for key in PATTERNS:
        unused = [p for p in (cfg.get(key) or {}) if p not in used[key]]
        if unused:
            raise input_error(
                fn,
                f"{file}[{key!r}]",
                "keys that each match an adapted module or parameter (PEFT's rule: the whole name or a "
                f"dot-separated tail of it, e.g. of {sorted(names)[:2]})",
                f"{unused} matching none",
            )
    return out


def _alternatives(names: Sequence[str], everything: Mapping[str, Any], value: Any) -> str:
    """One regular expression matching exactly ``names`` among the keys of ``everything`` (each
    ``model.layers.<i>.<rest>`` group written once: ``\\d+`` when every layer of that ``<rest>``
    has ``value``, else the layers listed)."""
    groups: dict[str, list[str]] = {}
    for n in names:
        m = _LAYER.match(n)
        groups.setdefault(m.group(2) if m else n, []).append(m.group(1) if m else "")
    parts = []
    for rest, layers in sorted(groups.items()):
        if layers == [""]:
            parts.append(re.escape(rest))
            continue
        same = [_LAYER.match(n) for n in everything if _LAYER.match(n) and _LAYER.match(n).group(2) == rest]
        if all(everything[m.group(0)] == value for m in same):
            parts.append(rf"model\.layers\.\d+\.{re.escape(rest)}")
        else:
            parts.append(rf"model\.layers\.(?:{'|'.join(sorted(set(layers), key=int))})\.{re.escape(rest)}")
    return "|".join(parts)


def _one(values: Mapping[str, Any], modules: set[str]) -> tuple[Any, dict[str, Any]]:
    """Default and pattern dict for one quantity (rank or alpha) of every name in ``values``."""
    counts = Counter(values.values())
    params_only = [v for v in counts if not any(values[m] == v for m in modules if m in values)]
    if params_only:  # a value no adapted module has: the default, so that no key matches parameters only
        default = max(params_only, key=lambda v: (counts[v], v))
    else:
        default = max(counts, key=lambda v: (counts[v], v))
    patterns = {}
    for v in sorted((v for v in counts if v != default), key=lambda v: (-counts[v], v)):
        patterns[_alternatives(sorted(n for n in values if values[n] == v), values, v)] = v
    return default, patterns


def write_patterns(
    values: Mapping[str, tuple[int, float]], modules: set[str]
) -> tuple[int, float, dict[str, int], dict[str, float]]:
    """``r``, ``lora_alpha``, ``rank_pattern``, ``alpha_pattern`` that give every adapted name in
    ``values`` its ``(rank, alpha)`` by PEFT's rules (``modules``: the names that are modules, the
    rest parameters). Each written key matches the names of one value only, so the order does not
    matter; a value held by parameters only is the default where there is one such value, so that
    every key also matches a module (``peft`` warns about keys that match parameters only)."""
    r, rank_pattern = _one({n: v[0] for n, v in values.items()}, modules)
    alpha, alpha_pattern = _one({n: v[1] for n, v in values.items()}, modules)
    return r, alpha, rank_pattern, alpha_pattern
