"""The split of a batch into micro-batches as one value: :data:`Split` (pure Python).

:class:`ByCount` (a fixed number of micro-batches), :class:`BySize` (a fixed number of samples each)
or :class:`ByTokens` (a hard token budget each). Each says how many micro-batches it makes
(``groups``) and what only the data can refuse (``check``), so nothing below dispatches on names.
The flat keywords ``num_microbatches`` / ``microbatch_size`` / ``max_tokens_per_microbatch`` are
sugar that builds one (:func:`split_mode`). The planning that uses them is :mod:`fnppo.core.batching.split`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from fnppo.core.batching.sample import Sample
from fnppo.core.errors import check_positive_int, input_error

__all__ = ["Split", "ByCount", "BySize", "ByTokens", "as_split", "split_mode", "SPLIT_MODES"]

SPLIT_MODES = ("num_microbatches", "microbatch_size", "max_tokens_per_microbatch")
"""The three flat keywords of a split; at most one is used."""


@dataclasses.dataclass(frozen=True)
class ByCount:
    """``n`` contiguous micro-batches whose sizes differ by at most one (flat: ``num_microbatches=n``).

    The count is taken as given: never rounded up (the interleaved schedule refuses one that is not
    a multiple of its group) and refused above the batch size."""

    n: int
    flat: ClassVar[str] = "num_microbatches"
    explicit: ClassVar[bool] = True  # the count is the user's, not the split's

    def __post_init__(self) -> None:
        check_positive_int("fnppo.ByCount", "n", self.n)

    def groups(self, lengths: list[int], layout: str) -> tuple[int, list[list[int]] | None]:
        """``(count, local groups or None)``: ``None`` means contiguous groups of the agreed count."""
        return self.n, None

    def check(
        self, fn: str, samples: Sequence[Sample], lengths: list[int], parts: int, arg: str, count_arg: str, pad: int
    ) -> None:
        n = len(samples) // parts
        if self.n > n:
            where = (
                f"the batch size {n} ("
                if parts == 1
                else f"the mini-batch size {n} ({len(samples)} samples / num_minibatches={parts}; "
            )
            raise input_error(fn, count_arg, f"at most {where}no empty micro-batches)", str(self.n))


@dataclasses.dataclass(frozen=True)
class BySize:
    """``ceil(batch / n)`` contiguous micro-batches of at most ``n`` samples (flat: ``microbatch_size=n``)."""

    n: int
    flat: ClassVar[str] = "microbatch_size"
    explicit: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_positive_int("fnppo.BySize", "n", self.n)

    def groups(self, lengths: list[int], layout: str) -> tuple[int, list[list[int]] | None]:
        return -(-len(lengths) // self.n), None

    def check(
        self, fn: str, samples: Sequence[Sample], lengths: list[int], parts: int, arg: str, count_arg: str, pad: int
    ) -> None:
        """Any batch can be cut in groups of ``n``."""


@dataclasses.dataclass(frozen=True)
class ByTokens:
    """At most ``n`` collated tokens per micro-batch (flat: ``max_tokens_per_microbatch=n``): the
    count of first-fit decreasing, then balanced longest-first (see :func:`split_batch`)."""

    n: int
    flat: ClassVar[str] = "max_tokens_per_microbatch"
    explicit: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_positive_int("fnppo.ByTokens", "n", self.n)

    def groups(self, lengths: list[int], layout: str) -> tuple[int, list[list[int]] | None]:
        local = _first_fit_decreasing(lengths, self.n, layout)
        return len(local), local

    def check(
        self, fn: str, samples: Sequence[Sample], lengths: list[int], parts: int, arg: str, count_arg: str, pad: int
    ) -> None:
        _check_budget(fn, samples, lengths, self.n, arg, pad)


Split = ByCount | BySize | ByTokens
"""The split of a batch into micro-batches, one value (``ByCount(4)``, ``BySize(8)``, ``ByTokens(4096)``)."""


def as_split(split: Split | tuple[str, int]) -> Split:
    """``split`` itself, or the :data:`Split` of a former ``(flat name, size)`` pair."""
    if isinstance(split, (ByCount, BySize, ByTokens)):
        return split
    name, size = split
    return {c.flat: c for c in (ByCount, BySize, ByTokens)}[name](size)


def _cost_fn(layout: str) -> Callable[[int, int, int], int]:
    """Collated token count of a group from (count, sum of lengths, max length)."""
    if layout == "packed":
        return lambda count, total, longest: total
    return lambda count, total, longest: count * longest


def _first_fit_decreasing(lengths: list[int], budget: int, layout: str) -> list[list[int]]:
    """First-fit decreasing bin packing (Johnson 1973; at most 11/9 OPT + 6/9 bins, Dosa 2007)."""
    cost = _cost_fn(layout)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    stats: list[list[int]] = []  # count, total, longest
    for i in order:
        ln = lengths[i]
        for b, (c, t, mx) in enumerate(stats):
            if cost(c + 1, t + ln, max(mx, ln)) <= budget:
                bins[b].append(i)
                stats[b] = [c + 1, t + ln, max(mx, ln)]
                break
        else:
            bins.append([i])
            stats.append([1, ln, ln])
    return bins


def split_mode(
    num_microbatches: Any, microbatch_size: Any, max_tokens_per_microbatch: Any, *, fn: str, required: bool
) -> Split | None:
    """The :data:`Split` the flat keywords build, checked, or None when none is given and not ``required``.

    The one home of the "one split mode" and "positive size" checks, used by :func:`split_batch`
    (exactly one mode) and :class:`fnppo.StepConfig` (at most one; none means one micro-batch).

    Raises:
        InputError: two or more modes (or none when ``required``); a size that is not an int >= 1.
    """
    modes = {
        "num_microbatches": num_microbatches,
        "microbatch_size": microbatch_size,
        "max_tokens_per_microbatch": max_tokens_per_microbatch,
    }
    given = [k for k, v in modes.items() if v is not None]
    if len(given) > 1 or (required and not given):
        raise input_error(
            fn,
            "/".join(SPLIT_MODES),
            "exactly one of them" if required else "at most one of them",
            f"{given or 'none'}",
        )
    if not given:
        return None
    check_positive_int(fn, given[0], modes[given[0]])
    return as_split((given[0], modes[given[0]]))


def _check_budget(fn: str, samples: Sequence[Sample], lengths: list[int], budget: int, arg: str, pad: int) -> None:
    """Every (padded) sample fits the token budget on its own."""
    for i, ln in enumerate(lengths):
        if ln > budget:
            raise input_error(
                fn,
                f"{arg}[{i}]",
                f"at most max_tokens_per_microbatch={budget} tokens (a single sample longer than the token budget "
                "cannot be split)",
                f"{ln} tokens (prompt {samples[i].prompt_len} + response {samples[i].response_len}"
                + (f", padded to a multiple of {pad})" if pad > 1 else ")"),
            )
