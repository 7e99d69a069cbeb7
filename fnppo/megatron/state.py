"""What persists between training steps: :class:`TrainState` (model chunks, optimizer, step counter).

It lives in the Megatron layer (it holds Megatron's DDP chunks and optimizer) so that everything
above, the checkpoint layer (:mod:`fnppo.io.checkpoint`) and the steps (:mod:`fnppo.steps`), types it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from torch import nn

__all__ = ["TrainState", "TrainStates"]


@dataclass(frozen=True)
class TrainState:
    """What persists between steps: DDP-wrapped model chunks, Megatron optimizer, step counter."""

    model: tuple[nn.Module, ...]
    optimizer: Any
    step: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.model, nn.Module):
            object.__setattr__(self, "model", (self.model,))
        else:
            object.__setattr__(self, "model", tuple(self.model))


TrainStates: TypeAlias = TrainState | Mapping[str, TrainState]
"""What a checkpoint holds: one train state, or named train states (a policy and a critic, ...)."""
