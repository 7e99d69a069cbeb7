"""``--partial-rollouts``: responses continued across weight updates, each token with its policy version.

A stand-in for an engine updated mid-generation (prime-rl, slime and xtuner's partial rollouts): with
``--staleness K`` the sampler holds the weights of the last K + 1 versions; every response's first
token is sampled by the oldest (K updates old, as every token of the per-sample run is), and before
each later token the engine moves on to the next newer weights with probability 1/2 (never past the
current ones). The samples carry each token's version (``Sample.versions``);
``fnppo.losses.Staleness.prepare`` turns them into each token's age for the version being trained,
which the decoupled loss reads per token (``alpha = (K - 1) / K`` with the token's own K).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from toy.task import RESPONSE_LEN

#: the probability that the engine moves to the next newer weights before a token
ADVANCE = 0.5


def version_schedule(seed: int, step: int, n: int, n_versions: int):
    """Which of the ``n_versions`` weights (0: the oldest) samples token ``t`` of response ``i``:
    ``[n, RESPONSE_LEN]`` int64, 0 at ``t = 0``, non-decreasing, at most ``n_versions - 1``; a function
    of (seed, step) for the global batch, so every layout samples the same tokens."""
    g = torch.Generator().manual_seed(seed * 104_729 + step * 7 + 3)
    moves = (torch.rand(n, RESPONSE_LEN - 1, generator=g) < ADVANCE).long()
    index = torch.cat([torch.zeros(n, 1, dtype=torch.long), moves.cumsum(1)], dim=1)
    return index.clamp_max(n_versions - 1)


def token_metrics(samples, layout, device) -> dict[str, float]:
    """The token-level staleness of the prepared samples over every data-parallel rank: mean and max
    age and the expired fraction, over the response tokens (those of ``Staleness.prepare``'s metrics)."""
    ages = torch.cat([s.staleness.double() for s in samples])
    sums = torch.tensor([float(ages.sum()), float(ages.numel())], dtype=torch.float64)
    top = torch.tensor([float(ages.max()) if ages.numel() else 0.0], dtype=torch.float64)
    if layout.dp > 1:
        sums, top = sums.to(device), top.to(device)
        dist.all_reduce(sums, group=layout.dp_group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=layout.dp_group)
        sums, top = sums.cpu(), top.cpu()
    return {
        "offpolicy/token_staleness_mean": float(sums[0] / sums[1]) if float(sums[1]) else 0.0,
        "offpolicy/token_staleness_max": float(top[0]),
    }
