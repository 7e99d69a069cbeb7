"""Shared-prefix packing: the samples of a prompt group packed with their prompt once.

In GRPO every prompt is sampled G times; packed one sample after another, the trunk computes
``G (P + R)`` tokens where ``P + G R`` would do. :class:`SharedPrefix` (the ``packing`` of
:class:`fnppo.StepConfig` / :class:`fnppo.CriticConfig`) packs a group of samples that share a
prompt ``x`` (length ``P``) with responses ``y_1 .. y_G`` as one document::

    [ x[:-1] | x[-1] y_1 | x[-1] y_2 | ... | x[-1] y_G ]

The shared prefix is the prompt without its last token; every response segment starts with a copy
of the last prompt token, so every position still has one label (the last prompt position of
segment ``g`` predicts ``y_g[0]``), and segment ``g``'s positions continue from the prompt
(``P - 1, P, ...``). Attention: the prefix is causal among itself; a segment sees the whole prefix
and itself causally, nothing else. Every token of sample ``g`` then sees exactly the tokens it sees
alone, at the same positions, so its log-probs, entropies and loss are those of the unshared
sample up to floating-point rounding; the prefix's activations are computed once and its gradient
is the sum over the group's segments, as if each sample had its own copy. A group costs
``(P - 1) + sum_g (R_g + 1)`` computed tokens instead of ``sum_g (P + R_g)``.

Groups (:func:`prompt_groups`): samples with the same declared ``Sample.group``, else samples with
equal ``prompt_ids``; a group of one is packed exactly as without sharing. The planner keeps a
group whole, or splits it into sub-groups with the prompt repeated when a split rule refuses it
whole or more micro-batches are needed (:func:`group_items`); ``SharedPrefix(split_groups=False)``
refuses instead. Collation is :func:`fnppo.core.batching.collate.collate_microbatch` with
``share_prefix=True``; the attention kernels read the runs of the pack from the micro-batch
(``branch_ids``, ``root_ids``).

Reference: the packed document-causal attention this extends, arXiv:2107.02027 (Krell et al.).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fnppo.core.batching.sample import Sample, round_up
from fnppo.core.batching.splits.base import Item, Split
from fnppo.core.errors import check_bool, input_error

__all__ = [
    "SharedPrefix",
    "prompt_groups",
    "check_prompt_groups",
    "group_item",
    "group_items",
    "split_groups_to",
    "Pack",
    "pack_layout",
    "branch_tensors",
]


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    """Pack each prompt group with its prompt once (see the module docstring).

    ``split_groups``: a group that a split rule refuses whole (e.g. more tokens than
    ``max_tokens_per_microbatch``), or that must be cut for the micro-batch count, is split into
    sub-groups that each repeat the prompt (True); False refuses such a batch by name.
    """

    split_groups: bool = True

    def __post_init__(self) -> None:
        check_bool("fnppo.SharedPrefix", "split_groups", self.split_groups)


def _prompt_key(s: Sample) -> tuple[int, bytes]:
    return s.prompt_len, s.prompt_ids.detach().to(device="cpu", dtype=torch.int64).numpy().tobytes()


def _short(ids: torch.Tensor) -> str:
    values = ids.tolist()
    return f"{values[:8]}{'...' if len(values) > 8 else ''} ({len(values)} tokens)"


def prompt_groups(samples: Sequence[Sample]) -> list[list[int]]:
    """The prompt groups of ``samples``: indices with the same declared ``group`` (``("group", g)``),
    or with ``group`` None and equal ``prompt_ids``; each ascending, the groups ordered by their
    first index."""
    by_key: dict[Any, list[int]] = {}
    for i, s in enumerate(samples):
        key = ("group", s.group) if s.group is not None else ("prompt", _prompt_key(s))
        by_key.setdefault(key, []).append(i)
    return sorted(by_key.values(), key=lambda g: g[0])


def check_prompt_groups(fn: str, samples: Sequence[Sample], *, arg: str = "samples") -> list[list[int]]:
    """The prompt groups, after what shared-prefix packing needs of the samples: a declared group's
    samples have equal prompts, no sample carries multi-modal items (their placeholders expand by
    sample), and a group's routed experts (routing replay) agree on the prompt tokens the group
    computes once (rows ``0 .. P - 2``).

    Raises:
        InputError: naming ``<arg>[i]``.
    """
    for i, s in enumerate(samples):
        if any(int(t.shape[0]) for t in s.multi_modal.values()):
            raise input_error(
                fn,
                f"{arg}[{i}].multi_modal",
                "no multi-modal items with shared-prefix packing (an item expands inside its own sample)",
                f"keys {sorted(s.multi_modal)}",
            )
    groups = prompt_groups(samples)
    for g in groups:
        first = samples[g[0]]
        key = _prompt_key(first)
        for i in g[1:]:
            s = samples[i]
            if _prompt_key(s) != key:
                raise input_error(
                    fn,
                    f"{arg}[{i}].prompt_ids",
                    f"the prompt of {arg}[{g[0]}] (both declare group={s.group}; a group shares its prompt)",
                    f"{_short(s.prompt_ids)} (vs {_short(first.prompt_ids)})",
                )
            if first.routed_experts is not None and s.routed_experts is not None:
                p = first.prompt_len - 1
                if not torch.equal(s.routed_experts[:p].to(torch.int64), first.routed_experts[:p].to(torch.int64)):
                    raise input_error(
                        fn,
                        f"{arg}[{i}].routed_experts",
                        f"the routes of {arg}[{g[0]}] on the shared prompt tokens (rows 0..{p - 1}: the group "
                        "computes them once)",
                        "other experts on the shared prompt",
                    )
    return groups


def group_item(samples: Sequence[Sample], indices: Sequence[int], pad_to_multiple_of: int) -> Item:
    """The :class:`~fnppo.core.batching.splits.base.Item` of a prompt group packed as one document:
    ``tokens = round_up((P - 1) + sum_g (R_g + 1), pad)``, ``pairs`` the causal pairs of that
    document less those between different segments. One sample: its own item, as unshared."""
    first = samples[indices[0]]
    p = first.prompt_len - 1
    segs = [samples[i].response_len + 1 for i in indices]
    n = round_up(p + sum(segs), pad_to_multiple_of)
    across = (sum(segs) ** 2 - sum(s * s for s in segs)) // 2
    padded = f", padded to a multiple of {pad_to_multiple_of})" if pad_to_multiple_of > 1 else ")"
    if len(indices) == 1:
        what = f"{n} tokens (prompt {first.prompt_len} + response {first.response_len}{padded}"
    else:
        what = f"{n} tokens as computed (a group of {len(indices)} samples: prompt {first.prompt_len} once + responses {sum(segs) - len(segs)}{padded}"
    return Item(samples=tuple(indices), tokens=n, pairs=n * (n + 1) // 2 - across, what=what)


def group_items(
    fn: str,
    samples: Sequence[Sample],
    rule: Split,
    packing: SharedPrefix,
    *,
    layout: str,
    pad_to_multiple_of: int,
    arg: str = "samples",
    index: Callable[[int], int] = lambda i: i,
) -> list[Item]:
    """One item per prompt group, each split into sub-groups (in sample order, each as large as
    the rule accepts whole) where ``rule`` refuses it whole and ``packing.split_groups`` allows.

    Raises:
        InputError: a sample the rule refuses on its own (``<arg>[i]``), or a group it refuses whole
            with ``split_groups=False``; ``index`` maps a position in ``samples`` to the one named.
    """
    items: list[Item] = []
    for g in prompt_groups(samples):
        whole = group_item(samples, g, pad_to_multiple_of)
        expected = rule.refusal(whole, layout)
        if expected is None:
            items.append(whole)
            continue
        if len(g) > 1 and not packing.split_groups:
            names = ", ".join(f"{arg}[{index(i)}]" for i in g[:4]) + (", ..." if len(g) > 4 else "")
            raise input_error(
                fn,
                f"{arg}[{index(g[0])}]",
                f"{expected}; shared-prefix packing keeps the group ({names}) whole with split_groups=False",
                whole.what,
            )
        current: list[int] = []
        for i in g:
            alone = group_item(samples, [i], pad_to_multiple_of)
            refused = rule.refusal(alone, layout)
            if refused is not None:
                raise input_error(fn, f"{arg}[{index(i)}]", refused, alone.what)
            if current and rule.refusal(group_item(samples, [*current, i], pad_to_multiple_of), layout) is not None:
                items.append(group_item(samples, current, pad_to_multiple_of))
                current = []
            current.append(i)
        items.append(group_item(samples, current, pad_to_multiple_of))
    return sorted(items, key=lambda it: it.samples[0])


def split_groups_to(samples: Sequence[Sample], items: Sequence[Item], k: int, pad_to_multiple_of: int) -> list[Item]:
    """At least ``k`` items where possible: the item with the most samples (the first on ties) cut in
    two halves (in sample order, the prompt repeated) until there are ``k`` or every item is one sample."""
    out = list(items)
    while len(out) < k:
        j = max(range(len(out)), key=lambda t: (out[t].size, -t))
        if out[j].size == 1:
            break
        idx = out[j].samples
        half = (len(idx) + 1) // 2
        parts = [
            group_item(samples, idx[:half], pad_to_multiple_of),
            group_item(samples, idx[half:], pad_to_multiple_of),
        ]
        out = sorted([*out[:j], *parts, *out[j + 1 :]], key=lambda it: it.samples[0])
    return out


@dataclasses.dataclass(frozen=True)
class Pack:
    """Where the samples of one micro-batch go in its packed row (or padded rows).

    Sample ``i`` is one run of tokens: its tokens from ``firsts[i]`` on (0: the whole sample; ``P - 1``:
    its segment only, the prefix being another sample's) at ``starts[i]`` onwards. ``own_prefix[i]``:
    its prompt tokens belong to it alone (``seq_ids`` ``i`` there; -1 on a prefix shared by several).
    ``doc_lens``: the packed documents' padded lengths (``cu_seqlens``); ``spans`` per sample
    ``(prefix start, segment start)``; ``branches`` per document the run lengths (its prefix, each
    segment, the last one with the padding), None unless shared.
    """

    starts: list[int]
    firsts: list[int]
    own_prefix: list[bool]
    doc_lens: list[int]
    spans: tuple[tuple[int, int], ...]
    branches: list[list[int]] | None


def pack_layout(samples: Sequence[Sample], pad_to_multiple_of: int, share_prefix: bool) -> Pack:
    """The :class:`Pack` of ``samples`` in the packed layout: one document per sample, or (with
    ``share_prefix``) per prompt group (:func:`prompt_groups`), ``[prefix | segment_1 | ... | pad]``."""
    n = len(samples)
    starts, firsts, own = [0] * n, [0] * n, [True] * n
    spans: list[tuple[int, int]] = [(0, 0)] * n
    docs, branches, offset = [], [], 0
    groups = prompt_groups(samples) if share_prefix else [[i] for i in range(n)]
    for g in groups:
        p = samples[g[0]].prompt_len - 1
        segs = [samples[i].response_len + 1 for i in g]
        length = round_up(p + sum(segs), pad_to_multiple_of)
        seg_start = offset + p
        for k, i in enumerate(g):
            starts[i], firsts[i], own[i] = (offset, 0, len(g) == 1) if k == 0 else (seg_start, p, False)
            spans[i] = (offset, seg_start)
            seg_start += segs[k]
        docs.append(length)
        branches.append([p, *segs[:-1], segs[-1] + length - p - sum(segs)])
        offset += length
    return Pack(starts, firsts, own, docs, tuple(spans), branches if share_prefix else None)


def branch_tensors(branches: list[list[int]], device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(branch_ids, root_ids)`` ``[1, T]`` int64 of a shared pack: every run (a document's prefix,
    each segment) numbered in order; a token's root is its document's prefix."""
    branch, root, b = [], [], 0
    for runs in branches:
        prefix = b
        for k, n in enumerate(runs):
            branch.append(torch.full((n,), b, dtype=torch.int64))
            root.append(torch.full((n,), prefix if k else b, dtype=torch.int64))
            b += 1
    return torch.cat(branch).to(device)[None], torch.cat(root).to(device)[None]
