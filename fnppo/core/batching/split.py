"""Splitting a batch into micro-batches: the plan, its agreement over data parallelism, collation.

Plain torch (``torch.distributed`` for the agreement); nothing here imports Megatron.

* :func:`split_batch` decides which samples go into which micro-batch (a fixed number, a fixed size,
  or a hard token budget), agrees on the number of micro-batches over the data-parallel group and
  returns a :class:`SplitPlan`;
* :class:`SplitPlan` groups samples by micro-batch (:meth:`SplitPlan.apply`) and puts per-sample
  results back in the original order (:meth:`SplitPlan.restore`, the one way fnppo restores sample
  order);
* :func:`build_microbatches` is the one call the training step makes: plan, collate
  (:func:`fnppo.core.batching.collate.collate_microbatch` or a user stage), move to the device, and optionally pad
  every micro-batch to one length.
* :data:`Split` is the split as one value, passed down as it is: :class:`ByCount` (a fixed number
  of micro-batches), :class:`BySize` (a fixed number of samples each) or :class:`ByTokens` (a hard
  token budget each). Each says how many micro-batches it makes and what only the data can refuse
  (no dispatch on names anywhere below). The flat keywords ``num_microbatches`` /
  ``microbatch_size`` / ``max_tokens_per_microbatch`` are sugar that builds one (:func:`split_mode`,
  the one check of them, shared with :class:`fnppo.StepConfig`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fnppo.core.batching.checks import check_lengths
from fnppo.core.batching.collate import pad_microbatch, to_device
from fnppo.core.batching.context_parallel import shard_microbatch
from fnppo.core.batching.sample import LAYOUTS, Microbatch, Sample, round_up
from fnppo.core.batching.splits import (
    SPLIT_MODES,
    ByCount,
    BySize,
    ByTokens,
    Split,
    _cost_fn,
    as_split,
    split_mode,
)
from fnppo.core.errors import check_positive_int, input_error
from fnppo.core.typing import typechecked

__all__ = [
    "Split",
    "ByCount",
    "BySize",
    "ByTokens",
    "as_split",
    "SplitPlan",
    "split_batch",
    "split_mode",
    "check_split",
    "plan_microbatches",
    "build_microbatches",
    "SPLIT_MODES",
]


_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """Which samples go into which micro-batch.

    ``microbatches[k]`` are the indices (into the original batch, ascending) of micro-batch ``k``;
    every index appears exactly once and no micro-batch is empty. ``inverse[i]`` is the position of
    sample ``i`` in the concatenation ``order = microbatches[0] + microbatches[1] + ...``, so results
    concatenated in micro-batch order are put back in the original order with ``flat[inverse]``.
    :meth:`restore` does it, and is the one way fnppo restores sample order (``Microbatch.sample_index``
    only records where a micro-batch's samples came from).
    """

    microbatches: tuple[tuple[int, ...], ...]
    inverse: tuple[int, ...]

    def __post_init__(self) -> None:
        order = list(self.order)
        n = len(order)
        if sorted(order) != list(range(n)) or any(len(mb) == 0 for mb in self.microbatches):
            raise input_error(
                "SplitPlan", "microbatches", f"non-empty groups partitioning range({n})", repr(self.microbatches)[:200]
            )
        expected = [0] * n
        for pos, i in enumerate(order):
            expected[i] = pos
        if list(self.inverse) != expected:
            raise input_error(
                "SplitPlan",
                "inverse",
                f"the inverse of the concatenated order {expected}"[:200],
                repr(self.inverse)[:200],
            )

    @classmethod
    def from_groups(cls, groups: Sequence[Sequence[int]]) -> SplitPlan:
        """A plan from index groups; the inverse permutation is computed."""
        mbs = tuple(tuple(int(i) for i in g) for g in groups)
        order = [i for g in mbs for i in g]
        inverse = [0] * len(order)
        for pos, i in enumerate(order):
            if 0 <= i < len(order):
                inverse[i] = pos
        return cls(microbatches=mbs, inverse=tuple(inverse))

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def order(self) -> tuple[int, ...]:
        """Original indices in micro-batch (concatenation) order."""
        return tuple(i for mb in self.microbatches for i in mb)

    def apply(self, samples: Sequence[_T]) -> list[list[_T]]:
        """The samples grouped by micro-batch."""
        if len(samples) != len(self.inverse):
            raise input_error(
                "SplitPlan.apply", "samples", f"{len(self.inverse)} samples (the planned batch)", f"{len(samples)}"
            )
        return [[samples[i] for i in mb] for mb in self.microbatches]

    def restore(self, per_microbatch: Sequence[Sequence[_T]]) -> list[_T]:
        """Per-micro-batch results (one entry per sample, in micro-batch order) back in original order."""
        flat = [x for group in per_microbatch for x in group]
        if [len(g) for g in per_microbatch] != [len(mb) for mb in self.microbatches]:
            raise input_error(
                "SplitPlan.restore",
                "per_microbatch",
                f"group sizes {[len(mb) for mb in self.microbatches]}",
                f"{[len(g) for g in per_microbatch]}",
            )
        return [flat[j] for j in self.inverse]


def _balanced(lengths: list[int], k: int, budget: int, layout: str) -> list[list[int]] | None:
    """Longest-processing-time-first onto exactly ``k`` groups under the cap (Graham 1969).

    Each sample (longest first) goes to the group whose collated token count after adding it is
    smallest among those that stay within ``budget``. Returns None if some sample fits nowhere.
    """
    cost = _cost_fn(layout)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = [[] for _ in range(k)]
    stats = [[0, 0, 0] for _ in range(k)]
    for i in order:
        ln = lengths[i]
        best, best_cost = -1, None
        for b, (c, t, mx) in enumerate(stats):
            new = cost(c + 1, t + ln, max(mx, ln))
            if new <= budget and (best_cost is None or new < best_cost):
                best, best_cost = b, new
        if best < 0:
            return None
        bins[best].append(i)
        c, t, mx = stats[best]
        stats[best] = [c + 1, t + ln, max(mx, ln)]
    return bins


def _split_to(bins: list[list[int]], k: int) -> list[list[int]]:
    """Grow to ``k`` groups by moving the shortest sample of the fullest group into a new group."""
    bins = [list(b) for b in bins]
    while len(bins) < k:
        b = max(range(len(bins)), key=lambda j: (len(bins[j]), -j))
        bins.append([bins[b].pop()])  # groups are longest-first: pop() is the shortest sample
    return bins


def _contiguous(n: int, k: int) -> list[list[int]]:
    """``range(n)`` in ``k`` contiguous groups whose sizes differ by at most one (the first are larger)."""
    q, rem = divmod(n, k)
    groups, start = [], 0
    for j in range(k):
        size = q + (1 if j < rem else 0)
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def _agree(k: int, n: int, dp_group: Any) -> tuple[int, int]:
    """All-reduce ``(k, -n)`` with MAX over ``dp_group``: the group's largest count, smallest batch."""
    if dp_group is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(dp_group) == 1:
        return k, n
    backend = dist.get_backend(dp_group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor([k, -n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
    return int(t[0].item()), -int(t[1].item())


@typechecked
def split_batch(
    samples: Sequence[Sample],
    split: Split | None = None,
    *,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    max_tokens_per_microbatch: int | None = None,
    dp_group: Any = None,
    max_seq_len: int | None = None,
    pad_to_multiple_of: int = 1,
    layout: str = "packed",
) -> SplitPlan:
    """Split a batch into micro-batches; returns a :class:`SplitPlan` (groups + inverse permutation).

    Exactly one mode: ``split`` (a :data:`Split`), or one of the flat keywords that build it:

    * ``num_microbatches=k``: ``k`` contiguous groups, sizes differing by at most one;
    * ``microbatch_size=b``: ``ceil(n / b)`` contiguous groups of at most ``b`` samples (sizes
      differing by at most one);
    * ``max_tokens_per_microbatch=B``: a hard cap on the collated token count of every micro-batch.
      A sample counts ``round_up(len(prompt) + len(response), pad_to_multiple_of)`` tokens; a
      micro-batch counts the sum of those (``layout="packed"``) or ``count * max`` of them
      (``layout="padded"``), i.e. exactly ``mb.input_ids.numel()`` of :func:`collate_microbatch` with
      the same ``layout`` and ``pad_to_multiple_of``. The number of micro-batches is the one of
      first-fit decreasing (Johnson 1973, at most ``11/9 OPT + 6/9``); the samples are then spread
      over that many micro-batches longest-first, each onto the micro-batch with the smallest
      collated token count after adding it (Graham's LPT, 1969), which balances the token count
      (linear cost: MLP, logits and loss dominate at RL lengths) under the cap. Where LPT cannot
      respect the cap, the first-fit-decreasing groups are used as they are.

    With ``dp_group`` (a ``torch.distributed`` group, e.g. Megatron's data-parallel group) the
    number of micro-batches is all-reduced with MAX, so every rank runs the same count; ranks that
    needed fewer split further (still under the cap). A rank with fewer samples than the agreed
    count cannot do that: then *every* rank raises (the group's smallest batch size is reduced
    along), so no rank is left waiting in a collective. Empty micro-batches are not produced.

    Within a micro-batch indices are ascending; micro-batches are ordered by their first index. The
    plan is deterministic (ties are broken by index).

    Args:
        samples: the batch.
        split: the :data:`Split` (``ByCount(k)``, ``BySize(b)``, ``ByTokens(B)``).
        num_microbatches, microbatch_size, max_tokens_per_microbatch: sugar for ``split`` (exactly one
            of the four).
        dp_group: the data-parallel group to agree with, or None.
        max_seq_len: refuse samples longer than this (None: no limit).
        pad_to_multiple_of, layout: as in :func:`fnppo.core.batching.collate.collate_microbatch` (token counts).

    Returns:
        The :class:`SplitPlan`.

    Raises:
        InputError: empty ``samples``, not exactly one mode, non-positive sizes, an unknown
            ``layout``, ``num_microbatches`` above the batch size, a sample longer than
            ``max_seq_len`` or longer than the token budget, too few samples for the count agreed
            over ``dp_group``.
    """
    fn = "split_batch"
    samples = list(samples)
    if not samples:
        raise input_error(fn, "samples", "a non-empty sequence of Sample", "an empty sequence")
    mode = split_mode(num_microbatches, microbatch_size, max_tokens_per_microbatch, fn=fn, required=split is None)
    if split is not None and mode is not None:
        raise input_error(fn, mode.flat, "None when split is given (one way in)", repr(mode.n))
    mode = split if split is not None else mode
    check_positive_int(fn, "max_seq_len", max_seq_len, allow_none=True)
    check_positive_int(fn, "pad_to_multiple_of", pad_to_multiple_of)
    if layout not in LAYOUTS:
        raise input_error(fn, "layout", f"one of {LAYOUTS}", repr(layout))
    if max_seq_len is not None:
        check_lengths(fn, samples, max_seq_len, f"at most max_seq_len={max_seq_len} tokens")
    assert mode is not None
    return _plan(samples, mode, dp_group=dp_group, pad_to_multiple_of=pad_to_multiple_of, layout=layout)


def _plan(
    samples: Sequence[Sample],
    mode: Split,
    *,
    dp_group: Any,
    pad_to_multiple_of: int,
    layout: str,
    length: Callable[[Sample], int] = len,
    count_multiple: int = 1,
) -> SplitPlan:
    """:func:`split_batch` on checked arguments (the step's path): count, agree over DP, group.

    ``length`` is a sample's collated token count (default ``len``: prompt + response; a collate
    stage that expands a sample, e.g. :class:`fnppo.megatron.vlm_collate.VLMCollate`, says how much). A count the
    split decides (``microbatch_size``, ``max_tokens_per_microbatch``) is rounded up to a multiple
    of ``count_multiple`` after the agreement; an explicit ``num_microbatches`` is taken as given.

    Raises:
        InputError: the checks only the data can answer: ``num_microbatches`` above the batch
            size, a sample longer than the token budget, too few samples for the agreed count.
    """
    fn = "split_batch"
    n = len(samples)
    check_split(fn, samples, mode, pad_to_multiple_of=pad_to_multiple_of, length=length)
    lengths = [round_up(length(s), pad_to_multiple_of) for s in samples]
    k, local = mode.groups(lengths, layout)
    agreed, smallest = _agree(k, n, dp_group)
    rounded = ""
    if not mode.explicit and agreed % count_multiple != 0:
        rounded = f", {agreed} rounded up to a multiple of {count_multiple}"
    if rounded:
        agreed = -(-agreed // count_multiple) * count_multiple
    if agreed > smallest:
        raise input_error(
            fn,
            "samples",
            f"at least {agreed} samples on every data-parallel rank (the group's agreed number of "
            f"micro-batches{rounded}; empty micro-batches are not supported)",
            f"{smallest} samples on some rank ({n} here)",
        )
    if local is None:
        groups = _contiguous(n, agreed)
    else:
        assert isinstance(mode, ByTokens)
        groups = _balanced(lengths, agreed, mode.n, layout) or _split_to(local, agreed)
    groups = sorted((sorted(g) for g in groups), key=lambda g: g[0])
    return SplitPlan.from_groups(groups)


def check_split(
    fn: str,
    samples: Sequence[Sample],
    mode: Split,
    *,
    pad_to_multiple_of: int,
    length: Callable[[Sample], int] = len,
    parts: int = 1,
    arg: str = "samples",
    count_arg: str = "num_microbatches",
) -> None:
    """The checks of a split that only the data can answer, before any agreement over ranks: an
    explicit micro-batch count of at most the (mini-)batch size, and every (padded) sample within
    the token budget on its own.

    The one home of both checks: :func:`split_batch` runs it on its samples; the training step runs
    it on the caller's whole batch, cut into ``parts`` equal mini-batches (``num_minibatches``), before
    anything runs, with ``arg="batch"`` and ``count_arg="config.num_microbatches"``.

    Args:
        fn, arg, count_arg: the function, the samples' argument and the count's argument named in errors.
        samples: the samples (``len(samples)`` divisible by ``parts``).
        mode: the :data:`Split`.
        pad_to_multiple_of, length: a sample counts ``round_up(length(sample), pad_to_multiple_of)`` tokens.
        parts: the number of equal mini-batches the samples are split into.

    Raises:
        InputError: naming ``count_arg`` (more micro-batches than samples per mini-batch) or
            ``<arg>[i]`` (a sample longer than ``max_tokens_per_microbatch``).
    """
    lengths = [round_up(length(s), pad_to_multiple_of) for s in samples]
    mode.check(fn, samples, lengths, parts, arg, count_arg, pad_to_multiple_of)


def plan_microbatches(
    samples: Sequence[Sample],
    mode: Split | tuple[str, int],
    *,
    layout: str,
    pad_to_multiple_of: int,
    collate: Callable[..., Microbatch],
    dp_group: Any = None,
    count_multiple: int = 1,
) -> SplitPlan:
    """The plan of :func:`build_microbatches` (the same arguments), without collating: the training
    step plans every mini-batch before its first update, so that a refusal of the plan (too few
    samples for the count agreed over ``dp_group``, raised on every rank) comes before anything changed."""
    length = getattr(collate, "collated_length", len)  # a collate stage that expands samples counts them expanded
    return _plan(
        samples,
        as_split(mode),
        dp_group=dp_group,
        pad_to_multiple_of=pad_to_multiple_of,
        layout=layout,
        length=length,
        count_multiple=count_multiple,
    )


def build_microbatches(
    samples: Sequence[Sample],
    mode: Split | tuple[str, int],
    *,
    layout: str,
    pad_to_multiple_of: int,
    collate: Callable[..., Microbatch],
    device: torch.device,
    dp_group: Any = None,
    same_length: bool = False,
    context_parallel: tuple[int, int] = (1, 0),
    count_multiple: int = 1,
    plan: SplitPlan | None = None,
) -> tuple[SplitPlan, list[Microbatch]]:
    """Plan, collate and move to ``device``: the one call the training step makes into batching.

    The arguments are trusted (the step checked them where they entered: :class:`fnppo.StepConfig`
    and the batch check of :func:`fnppo.train_step`, which runs :func:`check_split` and the value
    checks on the whole batch before anything runs). The plan's own checks (:func:`_plan`) and
    those of ``collate`` still run for other callers; the step does not rely on them to refuse.

    Args:
        samples: the (mini-)batch.
        mode: the :data:`Split` (a former ``(flat name, size)`` pair is accepted).
        layout, pad_to_multiple_of: as in :func:`split_batch` / :func:`collate_microbatch`.
        collate: the collate stage, called as ``collate(group, layout=, pad_to_multiple_of=,
            sample_index=)``; its ``collated_length(sample)``, when it has one, is the token count
            the split uses (default ``len(sample)``).
        device: where the micro-batches go.
        dp_group: the data-parallel group the micro-batch count is agreed over (None: no agreement).
        same_length: pad every micro-batch to the longest one (:func:`fnppo.core.batching.collate.pad_microbatch`;
            the interleaved pipeline schedule needs one shape for all micro-batches of a step).
        context_parallel: ``(cp, cp_rank)``; with ``cp > 1`` every micro-batch is cut to this CP
            rank's tokens (:func:`fnppo.core.batching.context_parallel.shard_microbatch`) after collation and padding.
        count_multiple: round the number of micro-batches that ``microbatch_size`` or
            ``max_tokens_per_microbatch`` decides up to a multiple of this (after the DP agreement;
            the interleaved pipeline schedule runs micro-batches in groups of ``pp``); the groups
            stay within the size or token cap. An explicit ``num_microbatches`` is not changed.
        plan: the plan of these samples from :func:`plan_microbatches` with the same arguments (None:
            planned here).

    Returns:
        ``(plan, microbatches)``, micro-batch ``k`` holding the samples ``plan.microbatches[k]``.
    """
    if plan is None:
        plan = plan_microbatches(
            samples,
            mode,
            layout=layout,
            pad_to_multiple_of=pad_to_multiple_of,
            collate=collate,
            dp_group=dp_group,
            count_multiple=count_multiple,
        )
    mbs = [
        to_device(collate(group, layout=layout, pad_to_multiple_of=pad_to_multiple_of, sample_index=indices), device)
        for indices, group in zip(plan.microbatches, plan.apply(list(samples)))
    ]
    if same_length:
        longest = max(int(mb.input_ids.shape[1]) for mb in mbs)
        mbs = [pad_microbatch(mb, longest) for mb in mbs]
    cp, cp_rank = context_parallel
    if cp > 1:
        mbs = [shard_microbatch(mb, cp, cp_rank) for mb in mbs]
    return plan, mbs
