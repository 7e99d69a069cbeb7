"""``BySize(n)``: micro-batches of at most ``n`` samples (flat: ``microbatch_size=n``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from fnppo.core.batching.splits.base import Item, contiguous, split_to
from fnppo.core.errors import check_positive_int

__all__ = ["BySize"]


@dataclasses.dataclass(frozen=True)
class BySize:
    """Contiguous micro-batches of at most ``n`` samples each, as few as that allows (flat:
    ``microbatch_size=n``): ``ceil(batch / n)`` of sizes differing by at most one when every item
    is one sample.

    Raises:
        InputError: ``fnppo.BySize: argument 'n' expected an int >= 1``; from the planner
            (:func:`~fnppo.core.batching.split.split_batch`), an item of more than ``n`` samples (a
            prompt group kept whole by :class:`~fnppo.core.batching.prefix.SharedPrefix`).
    """

    n: int
    flat: ClassVar[str] = "microbatch_size"

    def __post_init__(self) -> None:
        check_positive_int("fnppo.BySize", "n", self.n)

    @property
    def fixed_count(self) -> None:
        return None

    def refusal(self, item: Item, layout: str) -> str | None:
        if item.size > self.n:
            return f"at most microbatch_size={self.n} samples in one micro-batch"
        return None

    def _fits(self, items: Sequence[Item], groups: list[list[int]]) -> bool:
        return all(sum(items[i].size for i in g) <= self.n for g in groups)

    def count(self, items: Sequence[Item], layout: str) -> int:
        sizes = [it.size for it in items]
        k = -(-sum(sizes) // self.n)
        while k < len(items) and not self._fits(items, contiguous(sizes, k)):
            k += 1
        return k

    def group(self, items: Sequence[Item], count: int, layout: str) -> list[list[int]]:
        groups = contiguous([it.size for it in items], count)
        if self._fits(items, groups):
            return groups
        return split_to(contiguous([it.size for it in items], self.count(items, layout)), count)
