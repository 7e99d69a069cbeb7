"""Samples and micro-batches: the split plan, the collate stage and its inverse.
Implementation: :mod:`fnppo.core.sample`, :mod:`fnppo.core.split`, :mod:`fnppo.core.collate`."""

from __future__ import annotations

from fnppo.core.collate import collate_microbatch as collate_microbatch
from fnppo.core.collate import pad_microbatch as pad_microbatch
from fnppo.core.collate import to_device as to_device
from fnppo.core.collate import unpack_per_sample as unpack_per_sample
from fnppo.core.sample import LAYOUTS as LAYOUTS
from fnppo.core.sample import Microbatch as Microbatch
from fnppo.core.sample import Sample as Sample
from fnppo.core.sample import padding_multiple as padding_multiple
from fnppo.core.split import ByCount as ByCount
from fnppo.core.split import BySize as BySize
from fnppo.core.split import ByTokens as ByTokens
from fnppo.core.split import Split as Split
from fnppo.core.split import SplitPlan as SplitPlan
from fnppo.core.split import split_batch as split_batch

__all__ = [
    "Sample",
    "Microbatch",
    "padding_multiple",
    "LAYOUTS",
    "Split",
    "ByCount",
    "BySize",
    "ByTokens",
    "SplitPlan",
    "split_batch",
    "collate_microbatch",
    "unpack_per_sample",
    "pad_microbatch",
    "to_device",
]
