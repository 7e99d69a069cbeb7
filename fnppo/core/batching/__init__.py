"""Batching (pure torch): :mod:`~fnppo.core.batching.sample` (the :class:`Sample` and :class:`Microbatch`
pytrees), :mod:`~fnppo.core.batching.checks` (their value checks), :mod:`~fnppo.core.batching.splits`
(the split rules), :mod:`~fnppo.core.batching.split` (the plan and its agreement over data parallelism),
:mod:`~fnppo.core.batching.collate` (collation and its inverse) and
:mod:`~fnppo.core.batching.context_parallel` (context-parallel shards and exact CP attention)."""
