"""A fused RoPE for Megatron where Transformer Engine provides none: adapters of :func:`fnppo.core.ops.rope.apply_rotary`.

Megatron's ``apply_rope_fusion`` (on where models are built for CUDA,
:func:`fnppo.megatron.megatron_config.fusion_fields`) calls two functions of ``rope_utils`` that only
Transformer Engine defines; :func:`fnppo.megatron.patches.patch_fused_rope` sets the missing ones
to the adapters here (:func:`fused_rope_bshd`, :func:`fused_rope_thd`). Cases outside
:func:`fnppo.core.ops.rope.apply_rotary` (interleaved RoPE, per-sample angle tables, context parallelism
in THD) use Megatron's unfused functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings import rope_utils
from torch.utils.weak import WeakIdKeyDictionary

from fnppo.core.ops.rope import apply_rotary, thd_positions
from fnppo.core.typing import Tensor

__all__ = ["fused_rope_bshd", "fused_rope_thd"]


def fused_rope_bshd(
    t: Tensor, freqs: Tensor, transpose_output_memory: bool = False, interleaved: bool = False
) -> Tensor:
    """Megatron's fused-RoPE signature for ``t`` ``[s, b, h, d]``, ``freqs`` ``[s, 1, 1, rot]``."""
    s, b, h, d = t.shape
    if interleaved or freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[0] < s:
        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    pos = torch.arange(s, device=t.device).repeat_interleave(b)
    return apply_rotary(t.reshape(s * b, h, d), freqs[:, 0, 0, :], pos).view(s, b, h, d)


@dataclass(frozen=True)
class _GroupCoords:
    """A process group's size and this rank's place in it, as ``ProcessGroup.size()`` / ``.rank()`` report them."""

    n: int
    r: int

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


# positions per cu_seqlens tensor, dropped with it: cu_seqlens -> {(total, absolute, version): positions}
_THD_POSITIONS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def fused_rope_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, cp_size: int = 1, cp_rank: int = 0) -> Tensor:
    """Megatron's fused-RoPE signature for packed ``t`` ``[t, h, d]``, ``freqs`` ``[max_s, 1, 1, rot]``.

    Positions restart in every sequence, except when the table has exactly one row per packed token
    (Megatron's absolute-offset mode, which then uses token ``i``'s own row). They are computed once
    per ``cu_seqlens`` tensor (all layers of a micro-batch share it).
    """
    total = t.shape[0]
    if cp_size > 1 or freqs.dim() != 4 or freqs.shape[1] != 1:
        # Megatron's unfused THD RoPE reads only the group's size and rank (passed in here), never the group itself
        return rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=_GroupCoords(cp_size, cp_rank))
    absolute = freqs.shape[0] == total
    key = (total, absolute, cu_seqlens._version)
    cached = _THD_POSITIONS.get(cu_seqlens)
    if cached is None or key not in cached:
        pos = torch.arange(total, device=t.device) if absolute else thd_positions(cu_seqlens, total)
        cached = {key: pos}
        _THD_POSITIONS[cu_seqlens] = cached
    return apply_rotary(t, freqs[:, 0, 0, :], cached[key])
