"""The steps: ``train_step``, ``critic_step``, ``compute_logprobs``, ``compute_values``, ``forward_only``.

They compose the stages inside Megatron's pipeline schedule; this package is the only place that
knows their order. Modules: :mod:`~fnppo.steps.protocols` (stage signatures), :mod:`~fnppo.steps.config`
(configs, state), :mod:`~fnppo.steps.plan` (the per-call plan), :mod:`~fnppo.steps.checks` (entry checks),
:mod:`~fnppo.steps.schedule` (Megatron plumbing), :mod:`~fnppo.steps.train`, :mod:`~fnppo.steps.infer`.
"""

from __future__ import annotations

from fnppo.steps.config import Batching as Batching
from fnppo.steps.config import CriticConfig as CriticConfig
from fnppo.steps.config import StepConfig as StepConfig
from fnppo.steps.config import TrainState as TrainState
from fnppo.steps.infer import compute_logprobs as compute_logprobs
from fnppo.steps.infer import compute_values as compute_values
from fnppo.steps.infer import forward_only as forward_only
from fnppo.steps.infer import shard_for_data_parallel as shard_for_data_parallel
from fnppo.steps.protocols import CollateFn as CollateFn
from fnppo.steps.protocols import CriticFns as CriticFns
from fnppo.steps.protocols import ForwardFn as ForwardFn
from fnppo.steps.protocols import FusedHead as FusedHead
from fnppo.steps.protocols import HeadFn as HeadFn
from fnppo.steps.protocols import LogprobFn as LogprobFn
from fnppo.steps.protocols import LossFn as LossFn
from fnppo.steps.protocols import StepFns as StepFns
from fnppo.steps.protocols import ValueLossFn as ValueLossFn
from fnppo.steps.teacher import TeacherModel as TeacherModel
from fnppo.steps.train import critic_step as critic_step
from fnppo.steps.train import train_step as train_step

__all__ = [
    "Batching",
    "CriticConfig",
    "StepConfig",
    "TrainState",
    "compute_logprobs",
    "compute_values",
    "forward_only",
    "shard_for_data_parallel",
    "CollateFn",
    "CriticFns",
    "ForwardFn",
    "FusedHead",
    "HeadFn",
    "LogprobFn",
    "LossFn",
    "StepFns",
    "ValueLossFn",
    "TeacherModel",
    "critic_step",
    "train_step",
]
