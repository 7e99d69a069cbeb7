"""MoE expert adapters in PEFT's ``target_parameters`` form (``transformers`` 5's fused experts).

``transformers`` 5 keeps an MoE layer's experts as two 3-D parameters, ``mlp.experts.gate_up_proj``
``[E, 2 * ffn, hidden]`` (gate rows, then up rows) and ``mlp.experts.down_proj`` ``[E, hidden, ffn]``,
for Qwen2-MoE, Qwen3-MoE and Mixtral alike. PEFT (``LoraConfig(target_parameters=[...])``, its
``lora.ParamWrapper``) adapts such a parameter with one rank-``R`` adapter per expert stored as

* ``lora_A.weight`` ``[E * R, in]``: expert ``e``'s ``A`` is rows ``e * R .. (e + 1) * R - 1``;
* ``lora_B.weight`` ``[out, R * E]``: expert ``e``'s ``B`` is columns ``e, e + E, e + 2E, ...``
  (``view(out, R, E)[:, :, e]``),

with scaling ``alpha / R`` (``alpha / sqrt(R)`` with ``use_rslora``). Both parameters of one
layer's experts are adapted by nested wrappers: with both targeted in that layer, ``gate_up_proj``'s
tensors are ``mlp.experts.base_layer.lora_*`` and ``down_proj``'s ``mlp.experts.lora_*``; with one
targeted, it is ``mlp.experts.lora_*`` (:func:`tensor_key`).

Two forms of the ``gate_up_proj`` adapter (``LoRAConfig.expert_gate_up``):

* ``"fused"``: what PEFT trains, one rank-``R`` adapter over the fused rows (one ``A`` shared by gate
  and up, one ``B`` over both); fnppo's expert fc1 adapter of rank ``R``, the same tensors per expert;
* ``"split"``: fnppo's gate and up adapters of rank ``r`` each (as for separate ``gate_proj`` /
  ``up_proj`` modules) are PEFT's rank-``2r`` adapter ``A = [A_gate; A_up]``,
  ``B = diag(B_gate, B_up)``, the same scaling (``alpha`` doubled; ``sqrt(2)`` times with
  rsLoRA); an adapter whose ``B`` mixes gate and up is refused for this form, by name.

An adapter may be written zero-padded to a larger rank (extra ``A`` rows and ``B`` columns zero,
the same scaling) so that PEFT needs no ``rank_pattern`` key that matches parameters only
(:func:`fnppo.io.hf.peft_rules.write_patterns`); fnppo's file records the true rank.
"""

from __future__ import annotations

import re

import torch

from fnppo.core.errors import input_error
from fnppo.core.typing import Tensor

__all__ = ["PARAMS", "param_key", "tensor_key", "to_peft_expert", "from_peft_expert", "EXPERT_NAME"]

PREFIX = "base_model.model."
#: fnppo's expert projection -> PEFT's fused parameter
PARAMS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
#: a full (1-rank) expert adapter name: layer, expert (None: shared), projection, A or B
EXPERT_NAME = re.compile(
    r"^decoder\.layers\.(\d+)\.mlp\.experts\.(?:local_experts\.(\d+)\.)?(linear_fc[12])\.lora_([AB])$"
)


def param_key(layer: int, param: str) -> str:
    """PEFT's name of a layer's fused expert parameter (``model.layers.1.mlp.experts.gate_up_proj``)."""
    return f"model.layers.{layer}.mlp.experts.{param}"


def tensor_key(layer: int, param: str, both: bool, ab: str) -> str:
    """PEFT's tensor of the ``A`` or ``B`` of ``param``'s adapter in ``layer`` (``both``: both of the
    layer's fused parameters adapted: ``gate_up_proj``'s wrapper is the inner one, ``base_layer``)."""
    inner = ".base_layer" if param == "gate_up_proj" and both else ""
    return f"{PREFIX}model.layers.{layer}.mlp.experts{inner}.lora_{ab}.weight"


def to_peft_expert(a_s: list[Tensor], b_s: list[Tensor], rank: int, padded: int) -> tuple[Tensor, Tensor]:
    """PEFT's ``(lora_A, lora_B)`` of one layer's projection from fnppo's per-expert ``A`` ``[parts *
    rank, in]`` and ``B`` ``[out, rank]`` (``parts`` 2: a split gated fc1, written block-diagonally),
    zero-padded to rank ``padded`` (``>= parts * rank``)."""
    experts, parts = len(a_s), a_s[0].shape[0] // rank
    out_rows, rows = b_s[0].shape[0], b_s[0].shape[0] // parts
    a = torch.zeros(experts, padded, a_s[0].shape[1], dtype=a_s[0].dtype)
    b = torch.zeros(out_rows, padded, experts, dtype=b_s[0].dtype)
    for e in range(experts):
        a[e, : parts * rank] = a_s[e]
        for p in range(parts):
            b[p * rows : (p + 1) * rows, p * rank : (p + 1) * rank, e] = b_s[e][p * rows : (p + 1) * rows]
    return a.reshape(experts * padded, -1).contiguous(), b.reshape(out_rows, padded * experts).contiguous()


def from_peft_expert(
    fn: str,
    keys: tuple[str, str],
    tensors: tuple[Tensor, Tensor],
    experts: int,
    shapes: tuple[tuple[int, int], tuple[int, int]],
    parts: int,
    stored: int,
) -> tuple[list[Tensor], list[Tensor]]:
    """fnppo's per-expert ``A`` ``[parts * r, in]`` and ``B`` ``[out, r]`` (``shapes``: their shapes)
    of PEFT's rank-``stored`` ``lora_A`` / ``lora_B`` (``keys``: their names).

    Raises:
        InputError: tensors of other shapes; components beyond ``parts * r`` that are not zero (a
            file written zero-padded); a ``B`` that mixes the parts (``parts`` 2: gate and up).
    """
    (ka, kb), (a, b) = keys, tensors
    (a_rows, inputs), (outputs, rank) = shapes
    for key, got, want in ((ka, a, (experts * stored, inputs)), (kb, b, (outputs, stored * experts))):
        if tuple(got.shape) != want:
            raise input_error(
                fn,
                f"PEFT tensor {key}",
                f"shape {want} (the model's: {experts} experts x rank {stored}, as the config's rank_pattern gives it)",
                str(tuple(got.shape)),
            )
    true = parts * rank
    av, bv = a.float().view(experts, stored, inputs), b.float().view(outputs, stored, experts)
    if bool(av[:, true:].ne(0).any()) or bool(bv[:, true:].ne(0).any()):
        raise input_error(
            fn,
            f"PEFT tensors {ka} / {kb}",
            f"zeros beyond rank {true} (the file's record of the true rank)",
            "non-zeros",
        )
    rows = outputs // parts
    mask = torch.zeros(outputs, true, dtype=torch.bool)
    for p in range(parts):
        mask[p * rows : (p + 1) * rows, p * rank : (p + 1) * rank] = True
    a_out, b_out = [], []
    for e in range(experts):
        be = bv[:, :true, e]
        if bool(be.masked_select(~mask).ne(0).any()):
            raise input_error(
                fn,
                f"PEFT tensor {kb}",
                f"a block-diagonal B over the {parts} fused projections (LoRAConfig(expert_gate_up='split'): one "
                f"rank-{rank} adapter each; an adapter trained on the fused parameter loads with expert_gate_up='fused')",
                f"non-zero gate/up cross terms in expert {e}",
            )
        b_out.append(torch.cat([be[p * rows : (p + 1) * rows, p * rank : (p + 1) * rank] for p in range(parts)]))
        a_out.append(av[e, :true].clone())
    return a_out, b_out
