"""``ByTokens(n)``: a hard budget of collated tokens per micro-batch (flat: ``max_tokens_per_microbatch=n``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar

from fnppo.core.batching.splits.base import Item, split_to
from fnppo.core.errors import check_positive_int

__all__ = ["ByTokens"]  # the rule; its token accounting and bin packing are imported by name (flops.py)


def collated_tokens(layout: str) -> Callable[[int, int, int], int]:
    """The collated token count of a group from ``(count, sum of tokens, largest tokens)``: the sum
    (``"packed"``), or one row of the largest per item (``"padded"``): ``mb.input_ids.numel()``."""
    if layout == "packed":
        return lambda count, total, longest: total
    return lambda count, total, longest: count * longest


def first_fit_decreasing(tokens: Sequence[int], budget: int, layout: str) -> list[list[int]]:
    """First-fit decreasing bin packing of items of ``tokens`` under a collated ``budget`` per bin
    (Johnson 1973; at most 11/9 OPT + 6/9 bins, Dosa 2007). Ties are broken by index."""
    cost = collated_tokens(layout)
    order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))
    bins: list[list[int]] = []
    stats: list[tuple[int, int, int]] = []  # count, total, longest
    for i in order:
        n = tokens[i]
        for b, (c, t, mx) in enumerate(stats):
            if cost(c + 1, t + n, max(mx, n)) <= budget:
                bins[b].append(i)
                stats[b] = (c + 1, t + n, max(mx, n))
                break
        else:
            bins.append([i])
            stats.append((1, n, n))
    return bins


def longest_first(
    tokens: Sequence[int], k: int, budget: int, layout: str, weights: Sequence[float] | None = None
) -> list[list[int]] | None:
    """Longest-processing-time-first onto exactly ``k`` groups under a collated token ``budget``
    (Graham 1969): items by decreasing weight (ties by index), each onto the group whose load after
    adding it is smallest among those that stay within ``budget``. The weights and the load: the
    tokens and the collated token count (``weights`` None), else ``weights`` and their sum. Returns
    None if some item fits nowhere."""
    cost = collated_tokens(layout)
    by_tokens = weights is None
    weights = tokens if weights is None else weights
    order = sorted(range(len(tokens)), key=lambda i: (-weights[i], i))
    bins: list[list[int]] = [[] for _ in range(k)]
    stats = [(0, 0, 0, 0.0) for _ in range(k)]  # count, total tokens, longest, weight
    for i in order:
        n, w = tokens[i], weights[i]
        best, best_load = -1, 0.0
        for b, (c, t, mx, wt) in enumerate(stats):
            collated = cost(c + 1, t + n, max(mx, n))
            load = collated if by_tokens else wt + w
            if collated <= budget and (best < 0 or load < best_load):
                best, best_load = b, load
        if best < 0:
            return None
        bins[best].append(i)
        c, t, mx, wt = stats[best]
        stats[best] = (c + 1, t + n, max(mx, n), wt + w)
    return bins


@dataclasses.dataclass(frozen=True)
class ByTokens:
    """At most ``n`` collated tokens per micro-batch (flat: ``max_tokens_per_microbatch=n``).

    Token accounting: an item counts its tokens as computed (one sample: ``round_up(len, pad)``); a
    micro-batch counts their sum (packed layout) or ``count * largest`` (padded), i.e. exactly
    ``mb.input_ids.numel()`` of the collated micro-batch. The count is the one of first-fit
    decreasing (Johnson 1973, at most ``11/9 OPT + 6/9``); the items are then spread over the
    agreed count longest-first, each onto the micro-batch with the smallest collated token count
    after adding it (Graham's LPT, 1969), which balances the token count (linear cost: MLP, logits
    and loss dominate at RL lengths) under the cap. Where LPT cannot respect the cap, the
    first-fit-decreasing groups are split further (:func:`~fnppo.core.batching.splits.base.split_to`).

    Raises:
        InputError: ``fnppo.ByTokens: argument 'n' expected an int >= 1``; from the planner
            (:func:`~fnppo.core.batching.split.split_batch`), an item (a sample, or a prompt group
            packed together) of more than ``n`` collated tokens.
    """

    n: int
    flat: ClassVar[str] = "max_tokens_per_microbatch"

    def __post_init__(self) -> None:
        check_positive_int("fnppo.ByTokens", "n", self.n)

    @property
    def fixed_count(self) -> None:
        return None

    def refusal(self, item: Item, layout: str) -> str | None:
        if item.tokens > self.n:
            return (
                f"at most max_tokens_per_microbatch={self.n} tokens (a single sample longer than the token "
                "budget cannot be split)"
            )
        return None

    def count(self, items: Sequence[Item], layout: str) -> int:
        return len(first_fit_decreasing([it.tokens for it in items], self.n, layout))

    def group(self, items: Sequence[Item], count: int, layout: str) -> list[list[int]]:
        tokens = [it.tokens for it in items]
        return longest_first(tokens, count, self.n, layout) or split_to(
            first_fit_decreasing(tokens, self.n, layout), count
        )
