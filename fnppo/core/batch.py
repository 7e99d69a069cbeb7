# temporary re-export shim (redesign): removed at integration
"""Former home of samples, micro-batches, the sample checks and collation; re-exports only.

The code lives in :mod:`fnppo.core.sample` (``Sample``, ``Microbatch``, ``padding_multiple``),
:mod:`fnppo.core.checks` (the sample checks), :mod:`fnppo.core.collate` (``collate_microbatch``,
``unpack_per_sample``, ``pad_microbatch``, ``to_device``, ``routing_fill``),
:mod:`fnppo.core.errors` (``check_positive_int``) and :mod:`fnppo.core.split` (``SplitPlan``,
``split_batch``). Import from there.
"""

from fnppo.core.checks import check_devices as check_devices
from fnppo.core.checks import check_lengths as check_lengths
from fnppo.core.checks import check_routed_experts as check_routed_experts
from fnppo.core.checks import check_routing_rows as check_routing_rows
from fnppo.core.checks import check_same_fields as check_same_fields
from fnppo.core.checks import check_sample_values as check_sample_values
from fnppo.core.checks import check_token_ids as check_token_ids
from fnppo.core.checks import routing_dtype_holds as routing_dtype_holds
from fnppo.core.collate import collate_microbatch as collate_microbatch
from fnppo.core.collate import pad_microbatch as pad_microbatch
from fnppo.core.collate import routing_fill as routing_fill
from fnppo.core.collate import to_device as to_device
from fnppo.core.collate import unpack_per_sample as unpack_per_sample
from fnppo.core.errors import check_positive_int as check_positive_int
from fnppo.core.sample import LAYOUTS as LAYOUTS
from fnppo.core.sample import Microbatch as Microbatch
from fnppo.core.sample import Sample as Sample
from fnppo.core.sample import padding_multiple as padding_multiple
# SplitPlan / split_batch only for tests/test_imports.py; no cycle: split never imports batch
from fnppo.core.split import SplitPlan as SplitPlan
from fnppo.core.split import split_batch as split_batch

__all__ = [
    "Sample",
    "Microbatch",
    "SplitPlan",
    "collate_microbatch",
    "split_batch",
    "unpack_per_sample",
    "padding_multiple",
    "LAYOUTS",
]
