"""``ByCount(n)``: a fixed number of micro-batches (flat: ``num_microbatches=n``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from fnppo.core.batching.splits.base import Item, contiguous
from fnppo.core.errors import check_positive_int

__all__ = ["ByCount"]


@dataclasses.dataclass(frozen=True)
class ByCount:
    """``n`` contiguous micro-batches whose sizes differ by at most one sample (flat: ``num_microbatches=n``).

    The count is the user's: never rounded up (the interleaved schedule refuses one that is not a
    multiple of its group) and refused above the (mini-)batch size before anything runs.

    Raises:
        InputError: ``fnppo.ByCount: argument 'n' expected an int >= 1``; from the planner
            (:func:`~fnppo.core.batching.split.split_batch`), ``n`` above the (mini-)batch size.
    """

    n: int
    flat: ClassVar[str] = "num_microbatches"

    def __post_init__(self) -> None:
        check_positive_int("fnppo.ByCount", "n", self.n)

    @property
    def fixed_count(self) -> int:
        return self.n

    def refusal(self, item: Item, layout: str) -> str | None:
        """Any item can be a micro-batch of its own."""
        return None

    def count(self, items: Sequence[Item], layout: str) -> int:
        return self.n

    def group(self, items: Sequence[Item], count: int, layout: str) -> list[list[int]]:
        return contiguous([it.size for it in items], count)
