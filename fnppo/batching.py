"""Samples and micro-batches: the split plan, the split rules (every rule of
:mod:`fnppo.core.batching.splits`, found in its folder), the collate stage and its inverse.
Implementation: :mod:`fnppo.core.batching.sample`, :mod:`fnppo.core.batching.split`, :mod:`fnppo.core.batching.splits`, :mod:`fnppo.core.batching.collate`."""

from __future__ import annotations

from fnppo.core.batching import splits as _splits
from fnppo.core.batching.collate import collate_microbatch as collate_microbatch
from fnppo.core.batching.collate import pad_microbatch as pad_microbatch
from fnppo.core.batching.collate import to_device as to_device
from fnppo.core.batching.collate import unpack_per_sample as unpack_per_sample
from fnppo.core.batching.prefix import SharedPrefix as SharedPrefix
from fnppo.core.batching.sample import LAYOUTS as LAYOUTS
from fnppo.core.batching.sample import Microbatch as Microbatch
from fnppo.core.batching.sample import Sample as Sample
from fnppo.core.batching.sample import padding_multiple as padding_multiple
from fnppo.core.batching.split import SplitPlan as SplitPlan
from fnppo.core.batching.split import split_batch as split_batch
from fnppo.core.batching.splits import *  # noqa: F403 - the split rules: fnppo.core.batching.splits.__all__
from fnppo.core.batching.splits.base import Item as Item
from fnppo.core.batching.splits.base import Split as Split

__all__ = [
    "Sample",
    "Microbatch",
    "padding_multiple",
    "LAYOUTS",
    "Split",
    "Item",
    *_splits.__all__,
    "SharedPrefix",
    "SplitPlan",
    "split_batch",
    "collate_microbatch",
    "unpack_per_sample",
    "pad_microbatch",
    "to_device",
]
