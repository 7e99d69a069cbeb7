"""Token -> sequence grouping for per-sequence sums and broadcasts (pure torch, no Megatron).

Per-token tensors come in two layouts: padded ``[batch, seq]`` (each row is one sequence) and
packed ``[1, total]`` (THD) with per-token sequence ids (``-1``: the token belongs to no
sequence). :class:`Segments` hides the difference: ``sum`` reduces tokens to one value per
sequence, ``gather`` spreads one value per sequence back over its tokens, both without Python
loops over sequences and without a device-to-host sync. The losses (:mod:`fnppo.core.losses`,
:mod:`fnppo.core.losses.rollout_correction`) and the advantage estimators (:mod:`fnppo.core.advantages`) share it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fnppo.core.typing import Tensor

__all__ = ["Segments", "segments"]


class Segments(NamedTuple):
    """Which sequence each token belongs to, for per-sequence sums without Python loops.

    ``ids is None``: each row of ``[batch, seq]`` is one sequence (``num = batch``). Otherwise
    ``ids[b, t]`` is the sequence slot of the token in ``[0, num)``, or ``num`` (a discard slot)
    for tokens that belong to no sequence. In the packed layout ``num`` is the number of token
    positions, an upper bound of the number of sequences that needs no device sync; empty slots
    simply have zero tokens.
    """

    ids: Tensor | None
    num: int

    def sum(self, x: Tensor) -> Tensor:
        """Per-sequence sums ``[num]`` of a per-token tensor (mask it first)."""
        if self.ids is None:
            return x.sum(dim=-1)
        out = torch.zeros(self.num + 1, dtype=x.dtype, device=x.device)
        return out.index_add(0, self.ids.reshape(-1), x.reshape(-1))[: self.num]

    def gather(self, v: Tensor, like: Tensor) -> Tensor:
        """Broadcast per-sequence values ``[num]`` back to tokens (0 for tokens of no sequence)."""
        if self.ids is None:
            return v[:, None].expand_as(like)
        return torch.cat([v, v.new_zeros(1)])[self.ids]


def segments(shape: torch.Size, seq_ids: Tensor | None, num: int | None = None) -> Segments:
    """The :class:`Segments` of per-token tensors of ``shape`` (``[batch, seq]``).

    Args:
        shape: the per-token shape ``[batch, seq]``.
        seq_ids: ``None`` (row ``b`` is sequence ``b``), or integer ``[batch, seq]`` sequence ids,
            ``-1`` for tokens of no sequence. Values are trusted: callers validate them.
        num: the number of sequence slots when ``seq_ids`` is given (default: ``seq_ids.numel()``,
            an upper bound that needs no device sync).

    Returns:
        ``Segments(None, batch)`` or ``Segments(ids, num)`` with ``-1`` mapped to the discard slot
        ``num``.
    """
    if seq_ids is None:
        return Segments(None, shape[0])
    num = seq_ids.numel() if num is None else num
    ids = torch.where(seq_ids >= 0, seq_ids.long(), torch.full_like(seq_ids, num, dtype=torch.long))
    return Segments(ids, num)
