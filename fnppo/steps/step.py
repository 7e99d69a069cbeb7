# temporary re-export shim (redesign): removed at integration
"""Re-exports of the steps from their modules (protocols, config, plan, checks, schedule, train, infer).

Setting a name on this module (a test's spy, e.g. ``finalize_grads`` or
``linear_logprob_and_entropy``) sets it on every steps module that holds that name, so that code
written against the former single module keeps working until the imports are rewritten.
"""

from __future__ import annotations

import sys
import types

from fnppo.core.linear_logprob import linear_logprob_and_entropy as linear_logprob_and_entropy
from fnppo.megatron.grads import FinalizeNotCalledError as FinalizeNotCalledError
from fnppo.megatron.grads import finalize_grads as finalize_grads
from fnppo.steps import checks, config, infer, plan, protocols, schedule, train
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
from fnppo.steps.protocols import LogprobFn as LogprobFn
from fnppo.steps.protocols import LossFn as LossFn
from fnppo.steps.protocols import StepFns as StepFns
from fnppo.steps.protocols import ValueLossFn as ValueLossFn
from fnppo.steps.schedule import run_schedule as _run_schedule  # noqa: F401 (set through _RENAMED)
from fnppo.steps.train import critic_step as critic_step
from fnppo.steps.train import train_step as train_step

__all__ = [
    "StepFns", "StepConfig", "TrainState", "train_step", "compute_logprobs", "forward_only", "shard_for_data_parallel",
    "CollateFn", "ForwardFn", "LogprobFn", "LossFn",
    "CriticFns", "CriticConfig", "ValueLossFn", "critic_step", "compute_values",
]

_MODULES = (protocols, config, plan, checks, schedule, train, infer)
_RENAMED = {"_run_schedule": "run_schedule"}


class _Shim(types.ModuleType):
    def __setattr__(self, name: str, value: object) -> None:
        target = _RENAMED.get(name, name)
        for module in _MODULES:
            if target in vars(module):
                setattr(module, target, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Shim
