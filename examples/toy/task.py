"""The "count on" task: prompts ``BOS a``, the ideal response ``a+1 .. a+4`` (mod 8), its rewards."""

from __future__ import annotations

import torch

PAD, BOS = 0, 1
FIRST_SYMBOL, NUM_SYMBOLS = 2, 8
VOCAB = 16
PROMPT_LEN, RESPONSE_LEN = 2, 4


def make_prompts(seed: int, step: int, n: int):
    """``[n, PROMPT_LEN]`` prompts ``BOS a``; a function of (seed, step) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    sym = torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + NUM_SYMBOLS, (n, 1), generator=g)
    return torch.cat([torch.full((n, 1), BOS), sym], dim=1)


def reward(prompt, response) -> float:
    """Fraction of response positions equal to ``a+1, a+2, ...`` (mod NUM_SYMBOLS)."""
    a = int(prompt[1]) - FIRST_SYMBOL
    target = FIRST_SYMBOL + (a + 1 + torch.arange(response.numel())) % NUM_SYMBOLS
    return float((response == target).float().mean()) if response.numel() else 0.0


def token_rewards(prompt, response):
    """Per-token rewards of ``--algo ppo``: ``1 / RESPONSE_LEN`` for each right token (they sum to :func:`reward`)."""
    a = int(prompt[1]) - FIRST_SYMBOL
    target = FIRST_SYMBOL + (a + 1 + torch.arange(response.numel())) % NUM_SYMBOLS
    return (response == target).float() / max(1, response.numel())
