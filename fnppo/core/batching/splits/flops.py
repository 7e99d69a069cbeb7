"""``ByFlops(n, c)``: the token budget of ``ByTokens(n)``, the micro-batches balanced by estimated FLOPs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fnppo.core.batching.splits.base import Item, split_to
from fnppo.core.batching.splits.tokens import first_fit_decreasing, longest_first
from fnppo.core.errors import check_float, check_positive_int

__all__ = ["ByFlops"]


@dataclasses.dataclass(frozen=True)
class ByFlops:
    """At most ``n`` collated tokens per micro-batch, the items balanced by their estimated FLOPs.

    A sample of ``L`` tokens costs ``L + L (L + 1) / c``, about ``L + L^2 / c`` (as slime and
    prime-rl balance): the linear part is the work per token (projections, MLP, logits), the
    quadratic one causal attention's ``L (L + 1) / 2`` query-key pairs (an item's ``pairs``; a
    group packed with its prompt once counts the pairs it computes), weighed by ``2 / c``. With
    ``P`` dense parameters per layer and hidden size ``h``, a layer does ``2 P`` FLOPs a token and
    ``4 h`` a query-key pair (``q . k`` and the weighted sum of ``v``), so the cost is
    proportional to ``L + L^2 h / P``: ``c = P / h``, ``12 h`` for a standard block (4h MLP, full
    attention), about 30,500 for Qwen2.5-1.5B (``P`` = 46.8M with its 2 KV groups and gated MLP of
    8,960, ``h`` = 1,536).

    The count is the one of :class:`~fnppo.core.batching.splits.tokens.ByTokens` (first-fit
    decreasing under the cap: memory bounds it); the items are then spread over the agreed count
    longest-first by cost onto the micro-batch with the least cost after adding it, among those
    that stay within ``n`` collated tokens (Graham's LPT, 1969); where that cannot respect the cap,
    the first-fit-decreasing groups are split further.

    Raises:
        InputError: ``fnppo.ByFlops: argument 'n' expected an int >= 1``; ``c`` not a finite number
            > 0; from the planner (:func:`~fnppo.core.batching.split.split_batch`), an item (a sample,
            or a prompt group packed together) of more than ``n`` collated tokens.
    """

    n: int
    c: float

    def __post_init__(self) -> None:
        check_positive_int("fnppo.ByFlops", "n", self.n)
        check_float("fnppo.ByFlops", "c", self.c, low=0, low_open=True)

    @property
    def fixed_count(self) -> None:
        return None

    def cost(self, item: Item) -> float:
        """``tokens + 2 pairs / c`` (``L + L (L + 1) / c`` for one sample of ``L`` tokens)."""
        return item.tokens + 2 * item.pairs / self.c

    def refusal(self, item: Item, layout: str) -> str | None:
        if item.tokens > self.n:
            return (
                f"at most n={self.n} tokens of ByFlops (a single sample longer than the token budget cannot be split)"
            )
        return None

    def count(self, items: Sequence[Item], layout: str) -> int:
        return len(first_fit_decreasing([it.tokens for it in items], self.n, layout))

    def group(self, items: Sequence[Item], count: int, layout: str) -> list[list[int]]:
        tokens = [it.tokens for it in items]
        costs = [self.cost(it) for it in items]
        return longest_first(tokens, count, self.n, layout, weights=costs) or split_to(
            first_fit_decreasing(tokens, self.n, layout), count
        )
