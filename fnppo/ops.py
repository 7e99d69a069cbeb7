"""The log-prob kernels, rotary embeddings and the grouped matmul, usable on their own (pure torch,
Triton on CUDA). Implementation: :mod:`fnppo.core.ops.logprob`, :mod:`fnppo.core.ops.linear_logprob`,
:mod:`fnppo.core.ops.rope`, :mod:`fnppo.core.ops.grouped_matmul`."""

from __future__ import annotations

from fnppo.core.ops.divergence import logprob_entropy_and_divergence as logprob_entropy_and_divergence
from fnppo.core.ops.divergence import logprob_entropy_and_topk as logprob_entropy_and_topk
from fnppo.core.ops.grouped_matmul import grouped_matmul as grouped_matmul
from fnppo.core.ops.linear_distill import linear_logprob_entropy_and_divergence as linear_logprob_entropy_and_divergence
from fnppo.core.ops.linear_logprob import linear_logprob_and_entropy as linear_logprob_and_entropy
from fnppo.core.ops.linear_logprob_graphs import BackwardGraphs as BackwardGraphs
from fnppo.core.ops.logprob import logprob_and_entropy as logprob_and_entropy
from fnppo.core.ops.rope import apply_rotary as apply_rotary
from fnppo.core.ops.rope import thd_positions as thd_positions

__all__ = [
    "logprob_and_entropy",
    "linear_logprob_and_entropy",
    "linear_logprob_entropy_and_divergence",
    "logprob_entropy_and_divergence",
    "logprob_entropy_and_topk",
    "BackwardGraphs",
    "apply_rotary",
    "thd_positions",
    "grouped_matmul",
]
