"""The split protocol: what a rule that cuts a batch into micro-batches implements, and what it sees.

A rule (:class:`Split`) is a small value with three methods and one attribute, in the spirit of
optax's ``GradientTransformation(init, update)``: the planner (:mod:`fnppo.core.batching.split`)
asks it, per (mini-)batch,

* ``refusal(item, layout)``: why one item cannot be a micro-batch on its own (its checks; the
  planner names the sample in the error), or None;
* ``count(items, layout)``: how many micro-batches this rank needs (its grouping, before the count
  is agreed over the data-parallel ranks);
* ``group(items, count, layout)``: exactly ``count`` non-empty groups of item indices (its
  re-balance to the agreed count, which may exceed its own);
* ``fixed_count``: a count the user fixed (never rounded up, checked against the batch size up
  front), or None when the rule decides the count from the data.

The planner knows no rule by name: it calls these and nothing else. The items are what a rule
never cuts: one sample each (or, with shared-prefix packing, a group of samples forwarded with its
prompt once), each with the cost the rule balances (:class:`Item`: tokens as computed, attention
pairs). The helpers below (contiguous groups, growing to an agreed count) are shared by the
built-in rules; the token accounting and its bin packing live with :class:`ByTokens`
(:mod:`fnppo.core.batching.splits.tokens`). A new rule is one class in one file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Item", "Split", "contiguous", "split_to"]


@dataclasses.dataclass(frozen=True)
class Item:
    """One unit of a batch that a split rule places whole: one sample, or a group forwarded together.

    ``samples``: indices into the batch (ascending); ``tokens``: the tokens the item adds to a
    packed micro-batch as computed (collated and padded: ``round_up(len(sample), pad_to_multiple_of)``
    for one sample); ``pairs``: the causal attention (query, key) pairs it computes
    (``tokens * (tokens + 1) / 2`` for one sample); ``what``: how errors describe it
    (``"9 tokens (prompt 1 + response 8)"``).
    """

    samples: tuple[int, ...]
    tokens: int
    pairs: int
    what: str

    @property
    def size(self) -> int:
        """The number of samples."""
        return len(self.samples)


@runtime_checkable
class Split(Protocol):
    """A split rule: how a batch's items become micro-batches (see the module docstring).

    Implementations: every rule of :mod:`fnppo.core.batching.splits` (one module each, all exported
    by ``fnppo.batching``); CONTRIBUTING.md, "Add a split rule".
    """

    @property
    def fixed_count(self) -> int | None:
        """The number of micro-batches the user fixed, or None (the rule decides it from the data)."""
        ...

    def refusal(self, item: Item, layout: str) -> str | None:
        """What one item must be to form a micro-batch alone (the error's "expected"), or None."""
        ...

    def count(self, items: Sequence[Item], layout: str) -> int:
        """How many micro-batches the items need (at least 1, at most ``len(items)``)."""
        ...

    def group(self, items: Sequence[Item], count: int, layout: str) -> list[list[int]]:
        """Exactly ``count`` non-empty groups of item indices, every index once (``count`` is at
        least :meth:`count` and at most ``len(items)``)."""
        ...


def split_to(bins: Sequence[Sequence[int]], k: int) -> list[list[int]]:
    """Grow to ``k`` groups by moving the last item of the fullest group (most items; the first on
    ties) into a new group (groups built longest-first: the last is the shortest)."""
    out = [list(b) for b in bins]
    while len(out) < k:
        b = max(range(len(out)), key=lambda j: (len(out[j]), -j))
        out.append([out[b].pop()])
    return out


def contiguous(sizes: Sequence[int], k: int) -> list[list[int]]:
    """Items in order, in ``k`` contiguous non-empty groups balanced by ``sizes`` (samples per item):
    each group takes items while it stays within ``ceil(remaining / groups left)``, at least one,
    and leaves one for every later group. With one sample per item this is ``n`` items in groups
    whose sizes differ by at most one, the first ones larger."""
    n = len(sizes)
    groups: list[list[int]] = []
    start, remaining = 0, sum(sizes)
    for g in range(k):
        left = k - g
        target = -(-remaining // left)
        end, taken = start + 1, sizes[start]
        while end < n - (left - 1) and taken + sizes[end] <= target:
            taken += sizes[end]
            end += 1
        if left == 1:
            end = n
        groups.append(list(range(start, end)))
        remaining -= sum(sizes[start:end])
        start = end
    return groups
