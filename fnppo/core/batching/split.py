"""Splitting a batch into micro-batches: the plan, its agreement over data parallelism, collation.

Plain torch (``torch.distributed`` for the agreement); nothing here imports Megatron.

* :func:`split_batch` decides which samples go into which micro-batch by a split rule
  (:class:`~fnppo.core.batching.splits.base.Split`: ``ByCount(k)``, ``BySize(b)``, ``ByTokens(B)``
  or your own), agrees on the number of micro-batches over the data-parallel group and returns a
  :class:`SplitPlan`;
* :class:`SplitPlan` groups samples by micro-batch (:meth:`SplitPlan.apply`) and puts per-sample
  results back in the original order (:meth:`SplitPlan.restore`, the one way fnppo restores sample
  order);
* :func:`build_microbatches` is the one call the training step makes: plan, collate
  (:func:`fnppo.core.batching.collate.collate_microbatch` or a user stage), move to the device, and optionally pad
  every micro-batch to one length.

The planner asks the rule and nothing else (no rule is known by name): its checks, its count, the
agreement over ranks, its groups at the agreed count. The flat keywords are sugar for the three
built-in rules (:func:`split_mode`, their one home, shared with :class:`fnppo.StepConfig`).
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
from fnppo.core.batching.prefix import SharedPrefix, check_prompt_groups, group_items, split_groups_to
from fnppo.core.batching.sample import LAYOUTS, Microbatch, Sample, round_up
from fnppo.core.batching.splits.base import Item, Split
from fnppo.core.batching.splits.count import ByCount
from fnppo.core.batching.splits.size import BySize
from fnppo.core.batching.splits.tokens import ByTokens
from fnppo.core.errors import check_positive_int, input_error
from fnppo.core.typing import typechecked

__all__ = [
    "Split",
    "Item",
    "SplitPlan",
    "split_batch",
    "split_mode",
    "check_split",
    "plan_microbatches",
    "build_microbatches",
    "SPLIT_MODES",
]

_FLAT = (ByCount, BySize, ByTokens)  # the rules the flat keywords build, in keyword order
SPLIT_MODES = tuple(rule.flat for rule in _FLAT)
"""The three flat keywords of a split (``num_microbatches``, ``microbatch_size``,
``max_tokens_per_microbatch``); at most one is used."""


def split_mode(
    num_microbatches: Any, microbatch_size: Any, max_tokens_per_microbatch: Any, *, fn: str, required: bool
) -> Split | None:
    """The rule the flat keywords build (``ByCount`` / ``BySize`` / ``ByTokens`` of the one given),
    checked, or None when none is given and not ``required``.

    The one home of the flat sugar, used by :func:`split_batch` (exactly one mode) and
    :class:`fnppo.StepConfig` (at most one; none means one micro-batch).

    Raises:
        InputError: two or more keywords (or none when ``required``); a size that is not an int >= 1.
    """
    values = (num_microbatches, microbatch_size, max_tokens_per_microbatch)
    given = [(rule, v) for rule, v in zip(_FLAT, values) if v is not None]
    if len(given) > 1 or (required and not given):
        names = [rule.flat for rule, _ in given]
        expected = "exactly one of them" if required else "at most one of them"
        raise input_error(fn, "/".join(SPLIT_MODES), expected, f"{names or 'none'}")
    if not given:
        return None
    rule, value = given[0]
    check_positive_int(fn, rule.flat, value)
    return rule(value)


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
    packing: SharedPrefix | None = None,
) -> SplitPlan:
    """Split a batch into micro-batches; returns a :class:`SplitPlan` (groups + inverse permutation).

    Exactly one mode: ``split`` (a split rule, :class:`~fnppo.core.batching.splits.base.Split`), or
    one of the flat keywords that build the built-in ones:

    * ``num_microbatches=k`` (:class:`~fnppo.core.batching.splits.count.ByCount`): ``k`` contiguous
      groups, sizes differing by at most one;
    * ``microbatch_size=b`` (:class:`~fnppo.core.batching.splits.size.BySize`): ``ceil(n / b)``
      contiguous groups of at most ``b`` samples (sizes differing by at most one);
    * ``max_tokens_per_microbatch=B`` (:class:`~fnppo.core.batching.splits.tokens.ByTokens`): a hard
      cap on the collated token count of every micro-batch, exactly ``mb.input_ids.numel()`` of
      :func:`collate_microbatch` with the same ``layout`` and ``pad_to_multiple_of`` (a sample counts
      ``round_up(len(prompt) + len(response), pad_to_multiple_of)`` tokens), balanced under the cap.

    With ``dp_group`` the number of micro-batches is all-reduced with MAX (every rank runs the same
    count; ranks that needed fewer split further, under the cap); a rank with fewer samples than the
    agreed count makes *every* rank raise (the smallest batch size is reduced along), so none waits
    in a collective. No micro-batch is empty; indices ascend within one, micro-batches are ordered by
    their first index; ties are broken by index (deterministic).

    Args:
        samples: the batch.
        split: the split rule (``ByCount(k)``, ``BySize(b)``, ``ByTokens(B)``, or your own).
        num_microbatches, microbatch_size, max_tokens_per_microbatch: sugar for ``split`` (exactly one
            of the four).
        dp_group: the data-parallel group to agree with, or None.
        max_seq_len: refuse samples longer than this (None: no limit).
        pad_to_multiple_of, layout: as in :func:`fnppo.core.batching.collate.collate_microbatch` (token counts).
        packing: :class:`~fnppo.core.batching.prefix.SharedPrefix` (packed layout only): the rule
            places prompt groups (tokens counted as computed, the prompt once per group or
            sub-group), not samples; None: one item per sample.

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
    if packing is not None:
        if layout != "packed":
            raise input_error(
                fn, "layout", "'packed' with shared-prefix packing (one document per group)", repr(layout)
            )
        check_prompt_groups(fn, samples)
    assert mode is not None
    return _plan(
        samples, mode, dp_group=dp_group, pad_to_multiple_of=pad_to_multiple_of, layout=layout, packing=packing
    )


def sample_items(
    samples: Sequence[Sample], pad_to_multiple_of: int, length: Callable[[Sample], int] = len
) -> list[Item]:
    """One :class:`~fnppo.core.batching.splits.base.Item` per sample: its collated tokens
    ``round_up(length(sample), pad_to_multiple_of)``, their causal attention pairs, its description."""
    items = []
    for i, s in enumerate(samples):
        n = round_up(length(s), pad_to_multiple_of)
        padded = f", padded to a multiple of {pad_to_multiple_of})" if pad_to_multiple_of > 1 else ")"
        what = f"{n} tokens (prompt {s.prompt_len} + response {s.response_len}{padded}"
        items.append(Item(samples=(i,), tokens=n, pairs=n * (n + 1) // 2, what=what))
    return items


def _items(
    fn: str,
    samples: Sequence[Sample],
    mode: Split,
    packing: SharedPrefix | None,
    *,
    layout: str,
    pad_to_multiple_of: int,
    length: Callable[[Sample], int],
    arg: str = "samples",
    index: Callable[[int], int] = lambda i: i,
) -> list[Item]:
    """The items the rule places: one per sample, or (shared-prefix packing) one per prompt group,
    split into sub-groups where the rule refuses a group whole; each accepted by the rule.

    Raises:
        InputError: an item the rule refuses on its own, naming ``<arg>[index(i)]``.
    """
    if packing is not None:
        return group_items(
            fn, samples, mode, packing, layout=layout, pad_to_multiple_of=pad_to_multiple_of, arg=arg, index=index
        )
    items = sample_items(samples, pad_to_multiple_of, length)
    for item in items:
        expected = mode.refusal(item, layout)
        if expected is not None:
            raise input_error(fn, f"{arg}[{index(item.samples[0])}]", expected, item.what)
    return items


def _plan(
    samples: Sequence[Sample],
    mode: Split,
    *,
    dp_group: Any,
    pad_to_multiple_of: int,
    layout: str,
    length: Callable[[Sample], int] = len,
    count_multiple: int = 1,
    packing: SharedPrefix | None = None,
) -> SplitPlan:
    """:func:`split_batch` on checked arguments (the step's path): the rule's checks, its count,
    the agreement over DP, its groups at the agreed count.

    ``length`` is a sample's collated token count (default ``len``: prompt + response; a collate
    stage that expands a sample, e.g. :class:`fnppo.megatron.vlm_collate.VLMCollate`, says how
    much). A count the rule decides (``fixed_count`` None) is rounded up to a multiple of
    ``count_multiple`` after the agreement; a fixed one is taken as given. With ``packing``
    (:class:`~fnppo.core.batching.prefix.SharedPrefix`) the items are prompt groups, cut in halves
    with the prompt repeated where the agreed count needs more items (not with ``split_groups=False``:
    then the groups are what the agreement counts).

    Raises:
        InputError: the checks only the data can answer: a fixed count above the batch size, an
            item the rule refuses on its own (a sample longer than the token budget), too few
            samples (or whole groups) for the agreed count.
    """
    fn = "split_batch"
    check_split(fn, samples, mode, pad_to_multiple_of=pad_to_multiple_of, length=length, layout=layout, packing=packing)
    items = _items(fn, samples, mode, packing, layout=layout, pad_to_multiple_of=pad_to_multiple_of, length=length)
    whole = packing is not None and not packing.split_groups
    n = len(items) if whole else len(samples)
    agreed, smallest = _agree(mode.count(items, layout), n, dp_group)
    rounded = ""
    if mode.fixed_count is None and agreed % count_multiple != 0:
        rounded = f", {agreed} rounded up to a multiple of {count_multiple}"
        agreed = -(-agreed // count_multiple) * count_multiple
    if agreed > smallest:
        what = "prompt groups (kept whole: SharedPrefix(split_groups=False))" if whole else "samples"
        raise input_error(
            fn,
            "samples",
            f"at least {agreed} {what} on every data-parallel rank (the group's agreed number of "
            f"micro-batches{rounded}; empty micro-batches are not supported)",
            f"{smallest} {what.split(' (')[0]} on some rank ({n} here)",
        )
    if packing is not None:
        items = split_groups_to(samples, items, agreed, pad_to_multiple_of)
    groups = [sorted(s for j in g for s in items[j].samples) for g in mode.group(items, agreed, layout)]
    return SplitPlan.from_groups(sorted(groups, key=lambda g: g[0]))


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
    layout: str = "packed",
    packing: SharedPrefix | None = None,
) -> None:
    """The checks of a split that only the data can answer, before any agreement over ranks: a
    fixed micro-batch count of at most the (mini-)batch size, and every item accepted by the rule
    on its own (``refusal``: e.g. a sample within the token budget; with ``packing``, a prompt group
    or its sub-groups).

    The one home of both checks: :func:`split_batch` runs it on its samples; the training step runs
    it on the caller's whole batch, cut into ``parts`` mini-batches (``num_minibatches``; mini-batch
    ``k`` holds samples ``k, k + parts, ...``), before anything runs, with ``arg="batch"`` and
    ``count_arg="config.num_microbatches"``.

    Args:
        fn, arg, count_arg: the function, the samples' argument and the count's argument named in errors.
        samples: the samples (``len(samples)`` divisible by ``parts``).
        mode: the split rule.
        pad_to_multiple_of, length: a sample counts ``round_up(length(sample), pad_to_multiple_of)`` tokens.
        parts: the number of equal mini-batches the samples are split into.
        layout: the micro-batch layout (``"packed"`` or ``"padded"``).
        packing: :class:`~fnppo.core.batching.prefix.SharedPrefix` or None.

    Raises:
        InputError: naming ``count_arg`` (more micro-batches than samples per mini-batch) or
            ``<arg>[i]`` (a sample, or a group kept whole, that the rule refuses on its own).
    """
    per_part = len(samples) // parts
    fixed = mode.fixed_count
    if fixed is not None and fixed > per_part:
        where = (
            f"the batch size {per_part} ("
            if parts == 1
            else f"the mini-batch size {per_part} ({len(samples)} samples / num_minibatches={parts}; "
        )
        raise input_error(fn, count_arg, f"at most {where}no empty micro-batches)", str(fixed))
    kw: dict[str, Any] = dict(layout=layout, pad_to_multiple_of=pad_to_multiple_of, length=length, arg=arg)
    if packing is None:
        _items(fn, samples, mode, None, **kw)
        return
    for k in range(parts):
        _items(fn, list(samples)[k::parts], mode, packing, index=lambda i, k=k: k + i * parts, **kw)


def plan_microbatches(
    samples: Sequence[Sample],
    mode: Split,
    *,
    layout: str,
    pad_to_multiple_of: int,
    collate: Callable[..., Microbatch],
    dp_group: Any = None,
    count_multiple: int = 1,
    packing: SharedPrefix | None = None,
) -> SplitPlan:
    """The plan of :func:`build_microbatches` (the same arguments), without collating: the training
    step plans every mini-batch before its first update, so that a refusal of the plan (too few
    samples for the count agreed over ``dp_group``, raised on every rank) comes before anything changed."""
    length = getattr(collate, "collated_length", len)  # a collate stage that expands samples counts them expanded
    return _plan(
        samples,
        mode,
        dp_group=dp_group,
        pad_to_multiple_of=pad_to_multiple_of,
        layout=layout,
        length=length,
        count_multiple=count_multiple,
        packing=packing,
    )


def build_microbatches(
    samples: Sequence[Sample],
    mode: Split,
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
    packing: SharedPrefix | None = None,
) -> tuple[SplitPlan, list[Microbatch]]:
    """Plan, collate and move to ``device``: the one call the training step makes into batching.

    The arguments are trusted (the step checked them where they entered, the whole batch before
    anything runs); the plan's and ``collate``'s own checks still run for other callers.

    Args:
        samples: the (mini-)batch.
        mode: the split rule.
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
        count_multiple: round a count the rule decides (``fixed_count`` None) up to a multiple of
            this after the DP agreement (the interleaved schedule's group of ``pp``), within its cap.
        plan: the plan of these samples from :func:`plan_microbatches` with the same arguments (None:
            planned here).
        packing: :class:`~fnppo.core.batching.prefix.SharedPrefix` (each prompt group of a
            micro-batch packed with its prompt once: ``collate(..., share_prefix=True)``) or None.

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
            packing=packing,
        )
    shared: dict[str, Any] = {} if packing is None else {"share_prefix": True}
    mbs = [
        to_device(
            collate(group, layout=layout, pad_to_multiple_of=pad_to_multiple_of, sample_index=indices, **shared),
            device,
        )
        for indices, group in zip(plan.microbatches, plan.apply(list(samples)))
    ]
    if same_length:
        longest = max(int(mb.input_ids.shape[1]) for mb in mbs)
        mbs = [pad_microbatch(mb, longest) for mb in mbs]
    cp, cp_rank = context_parallel
    if cp > 1:
        mbs = [shard_microbatch(mb, cp, cp_rank) for mb in mbs]
    return plan, mbs
