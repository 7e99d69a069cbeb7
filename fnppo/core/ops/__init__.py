"""Tensor operations (pure torch; Triton on CUDA from :mod:`fnppo.core.kernels`):
:mod:`~fnppo.core.ops.logprob` (log-prob and entropy from logits), :mod:`~fnppo.core.ops.linear_logprob`
and :mod:`~fnppo.core.ops.linear_logprob_graphs` (the same from hidden states and the output weight),
:mod:`~fnppo.core.ops.rope` (rotary embeddings), :mod:`~fnppo.core.ops.grouped_matmul` and
:mod:`~fnppo.core.ops.batch_invariant` (the batch-invariant numerics; which kernels a model takes: :mod:`fnppo.megatron.numerics`)."""
