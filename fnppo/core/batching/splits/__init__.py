"""The split rules: the protocol (:mod:`~fnppo.core.batching.splits.base`) and one module per rule
(:mod:`~fnppo.core.batching.splits.count`, :mod:`~fnppo.core.batching.splits.size`,
:mod:`~fnppo.core.batching.splits.tokens`). The planner that asks them is :mod:`fnppo.core.batching.split`."""
