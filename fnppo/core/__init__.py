"""fnppo.core: pure torch, never Megatron. Grouped by job:

* :mod:`fnppo.core.errors`, :mod:`fnppo.core.typing` -- the errors and the call-time shape checks;
* :mod:`fnppo.core.segments`, :mod:`fnppo.core.metrics` -- per-sequence sums and the metric pairs;
* :mod:`fnppo.core.batching` -- samples, micro-batches, the split, collation, context-parallel shards;
* :mod:`fnppo.core.ops` -- the log-prob heads, RoPE, the grouped matmul, the batch-invariant kernel choice;
* :mod:`fnppo.core.kernels` -- the Triton and batch-invariant kernels behind the ops;
* :mod:`fnppo.core.losses` -- the losses and their parts, rollout correction, staleness, KL controllers;
* :mod:`fnppo.core.advantages` -- the advantage estimators.
"""
