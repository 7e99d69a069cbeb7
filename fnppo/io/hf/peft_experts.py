"""MoE expert adapters in PEFT's ``target_parameters`` form (``transformers`` 5's fused experts).

``transformers`` 5 keeps an MoE layer's experts as two 3-D parameters, ``mlp.experts.gate_up_proj``
``[E, 2 * ffn, hidden]`` (gate rows, then up rows) and ``mlp.experts.down_proj`` ``[E, hidden, ffn]``,
for Qwen2-MoE, Qwen3-MoE and Mixtral alike. PEFT (``LoraConfig(target_parameters=[...])``, its
``lora.ParamWrapper``) adapts such a parameter with one rank-``R`` adapter per expert stored as

* ``lora_A.weight`` ``[E * R, in]``: expert ``e``'s ``A`` is rows ``e * R .. (e + 1) * R - 1``;
* ``lora_B.weight`` ``[out, R * E]``: expert ``e``'s ``B`` is columns ``e, e + E, e + 2E, ...``
  (``view(out, R, E)[:, :, e]``),

with scaling ``alpha / R`` (``rank_pattern`` / ``alpha_pattern`` override ``r`` / ``lora_alpha`` for
one parameter). Both parameters of one module are adapted by nested wrappers: with both targeted,
``gate_up_proj``'s tensors are ``mlp.experts.base_layer.lora_*`` and ``down_proj``'s
``mlp.experts.lora_*``; with one targeted, it is ``mlp.experts.lora_*``.

fnppo's expert fc1 adapter gives the gate and the up projection a rank-``r`` adapter each (as PEFT
does for separate ``gate_proj`` / ``up_proj`` modules, :mod:`fnppo.megatron.lora_linear`); on the
fused parameter that is the rank-``2r`` adapter ``A = [A_gate; A_up]``, ``B = diag(B_gate, B_up)``
with ``alpha`` doubled, which is what PEFT's own conversion of per-projection expert adapters writes
(``rank_pattern`` and ``alpha_pattern`` ``{".*\\.gate_up_proj": 2r / 2 alpha}``). An adapter of the
fused parameter whose ``B`` mixes gate and up (non-zero off-diagonal blocks) is refused by name.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from fnppo.core.errors import input_error
from fnppo.core.typing import Tensor

__all__ = ["PARAMS", "expert_targets", "to_peft_experts", "from_peft_experts", "pattern_of"]

PREFIX = "base_model.model.model.layers."
#: fnppo's expert projection -> PEFT's fused parameter
PARAMS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
_NAME = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.(?:local_experts\.(\d+)\.)?(linear_fc[12])\.lora_([AB])$")


def expert_targets(names: Any) -> list[str]:
    """The PEFT ``target_parameters`` of full adapter names (sorted, as PEFT writes them)."""
    found = {PARAMS[m.group(3)] for n in names if (m := _NAME.match(n))}
    return sorted(found)


def _key(layer: int, param: str, targeted: list[str], ab: str) -> str:
    inner = ".base_layer" if param == "gate_up_proj" and len(targeted) == 2 else ""
    return f"{PREFIX}{layer}.mlp.experts{inner}.lora_{ab}.weight"


def pattern_of(cfg: dict[str, Any], key: str, param: str, default: float) -> float:
    """The ``rank_pattern`` / ``alpha_pattern`` value (``key``) for ``param``, else ``default``."""
    for pat, value in (cfg.get(key) or {}).items():
        if pat.endswith(param) or pat.endswith(re.escape(param)):
            return value
    return default


def _per_expert(full: dict[str, Tensor], experts: int) -> dict[tuple[int, str, str], list[Tensor]]:
    """``(layer, projection, A/B)`` -> the ``experts`` per-expert tensors (a shared adapter repeated)."""
    out: dict[tuple[int, str, str], list[Tensor | None]] = {}
    for name, t in full.items():
        m = _NAME.match(name)
        if not m:
            continue
        layer, e, proj, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        slots = out.setdefault((layer, proj, ab), [None] * experts)
        for j in range(experts) if e is None else (int(e),):
            slots[j] = t
    return out  # type: ignore[return-value]


def to_peft_experts(full: dict[str, Tensor], experts: int, rank: int) -> dict[str, Tensor]:
    """PEFT's ``target_parameters`` tensors of fnppo's full expert adapters (``full``: full names of
    :func:`fnppo.megatron.weights.gather_full_weights` with ``adapters=True``)."""
    targeted = expert_targets(full)
    stacks = _per_expert(full, experts)
    out: dict[str, Tensor] = {}
    for (layer, proj, ab), ts in sorted(stacks.items()):
        if ab == "B":
            continue
        a_s, b_s = ts, stacks[(layer, proj, "B")]
        parts = a_s[0].shape[0] // rank
        big = parts * rank
        rows = b_s[0].shape[0] // parts
        b = torch.zeros(b_s[0].shape[0], big, experts)
        for e in range(experts):
            for p in range(parts):
                b[p * rows : (p + 1) * rows, p * rank : (p + 1) * rank, e] = b_s[e][p * rows : (p + 1) * rows]
        param = PARAMS[proj]
        out[_key(layer, param, targeted, "A")] = torch.cat(a_s, dim=0).contiguous()
        out[_key(layer, param, targeted, "B")] = b.reshape(b.shape[0], big * experts).contiguous()
    return out


def from_peft_experts(
    fn: str,
    cfg: dict[str, Any],
    peft: dict[str, Tensor],
    wanted: dict[str, tuple[int, ...]],
    experts: int,
    rank: int,
    scaling: float,
    *,
    strict: bool = True,
) -> tuple[dict[str, Tensor], set[str]]:
    """fnppo's full expert adapters (the names and full shapes in ``wanted``) from PEFT's tensors, and
    the PEFT keys used. A shared adapter (no expert index) takes PEFT's only if all experts' are equal.

    ``strict``: a fused parameter named in ``target_parameters`` must have its tensors in every MoE
    layer of the model.

    Raises:
        InputError: a targeted parameter's tensors missing from a layer (``strict``), a ``rank_pattern`` other than ``parts * r`` for a fused parameter, a ``gate_up_proj``
            ``B`` that mixes gate and up, a shared adapter from differing per-expert adapters, tensors
            of other shapes.
    """
    targeted = sorted(cfg.get("target_parameters") or [])
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    cache: dict[tuple[int, str], tuple[list[Tensor], list[Tensor]] | None] = {}
    for name, shape in wanted.items():
        m = _NAME.match(name)
        if not m:
            continue
        layer, e, proj, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        key = (layer, proj)
        if key not in cache:
            cache[key] = _read(fn, cfg, peft, targeted, layer, proj, experts, rank, scaling, wanted, used)
            if cache[key] is None and strict and PARAMS[proj] in targeted:
                missing = _key(layer, PARAMS[proj], targeted, ab)
                raise input_error(
                    fn, "path", f"the tensor {missing} (target_parameters names {PARAMS[proj]!r})", "none"
                )
        pair = cache[key]
        if pair is None:
            continue
        ts = pair[0] if ab == "A" else pair[1]
        if e is None:
            if any(not torch.equal(t, ts[0]) for t in ts[1:]):
                raise input_error(
                    fn,
                    "path",
                    "per-expert adapters that are all equal for LoRAConfig(expert_layout='shared')",
                    f"different adapters of the experts of layer {layer} ({PARAMS[proj]})",
                )
            out[name] = ts[0]
        else:
            out[name] = ts[int(e)]
        if tuple(out[name].shape) != tuple(shape):
            raise input_error(fn, "path", f"{name} of shape {tuple(shape)}", f"shape {tuple(out[name].shape)}")
    return out, used


def _read(
    fn: str,
    cfg: dict[str, Any],
    peft: dict[str, Tensor],
    targeted: list[str],
    layer: int,
    proj: str,
    experts: int,
    rank: int,
    scaling: float,
    wanted: dict[str, tuple[int, ...]],
    used: set[str],
) -> tuple[list[Tensor], list[Tensor]] | None:
    """Per-expert fnppo ``A`` and ``B`` of one layer's projection, or None where PEFT has none."""
    param = PARAMS[proj]
    if param not in targeted:
        return None
    ka, kb = _key(layer, param, targeted, "A"), _key(layer, param, targeted, "B")
    if (ka in peft) != (kb in peft):
        raise input_error(fn, "path", f"both {ka} and {kb}", f"only {ka if ka in peft else kb}")
    if ka not in peft:
        return None
    probe = next(s for n, s in wanted.items() if re.search(rf"\.{layer}\.mlp\.experts\..*{proj}\.lora_A$", n))
    parts = probe[0] // rank
    big = int(pattern_of(cfg, "rank_pattern", param, cfg["r"]))
    alpha = float(pattern_of(cfg, "alpha_pattern", param, cfg["lora_alpha"]))
    if big != parts * rank:
        raise input_error(
            fn,
            f"adapter_config.json['rank_pattern'] for {param}",
            f"{parts * rank} ({parts} x the model's rank {rank}: one rank-{rank} adapter per fused projection)",
            repr(big),
        )
    a, b = peft[ka].float(), peft[kb].float()
    if a.shape[0] != experts * big or b.shape[1] != experts * big:
        raise input_error(
            fn, f"PEFT tensor {ka}", f"{experts * big} rows ({experts} experts x rank {big})", str(tuple(a.shape))
        )
    inputs, outputs = (
        probe[1],
        next(s for n, s in wanted.items() if re.search(rf"\.{layer}\.mlp\.experts\..*{proj}\.lora_B$", n))[0],
    )
    for key, got, shape in ((ka, a, (experts * big, inputs)), (kb, b, (outputs, experts * big))):
        if tuple(got.shape) != shape:
            raise input_error(fn, f"PEFT tensor {key}", f"shape {shape} (the model's)", str(tuple(got.shape)))
    used.update((ka, kb))
    rows = b.shape[0] // parts
    bs = b.view(b.shape[0], big, experts)
    factor = (alpha / big) / scaling
    a_out, b_out = [], []
    for e in range(experts):
        be = bs[:, :, e]
        mask = torch.zeros_like(be, dtype=torch.bool)
        for p in range(parts):
            mask[p * rows : (p + 1) * rows, p * rank : (p + 1) * rank] = True
        if bool(be.masked_select(~mask).ne(0).any()):
            raise input_error(
                fn,
                f"PEFT tensor {kb}",
                f"a block-diagonal B over the {parts} fused projections (one rank-{rank} adapter each, "
                "as PEFT converts per-projection expert adapters)",
                f"non-zero gate/up cross terms in expert {e}",
            )
        b_out.append(
            torch.cat([be[p * rows : (p + 1) * rows, p * rank : (p + 1) * rank] for p in range(parts)]) * factor
        )
        a_out.append(a[e * big : (e + 1) * big])
    return a_out, b_out
