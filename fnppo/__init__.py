"""fnppo: functional, shape-checked PPO/GRPO training steps for Megatron-core models.

The top level holds the names a training step is composed of: the data (``Sample``, ``Microbatch``),
the stages (``split_batch`` -> ``collate_microbatch`` -> ``forward_logits`` -> ``logprob_and_entropy``
-> ``ppo_loss`` -> ``finalize_grads``), the steps that compose them inside Megatron's pipeline
schedule (``train_step``, ``critic_step``, ``compute_logprobs``, ...), their configs and state.
Families live in namespaces: :mod:`fnppo.losses`, :mod:`fnppo.advantages`, :mod:`fnppo.kl`,
:mod:`fnppo.metrics`, :mod:`fnppo.batching`, :mod:`fnppo.ops`, :mod:`fnppo.typing` (pure torch) and
:mod:`fnppo.models`, :mod:`fnppo.parallel`, :mod:`fnppo.moe`, :mod:`fnppo.vlm`, :mod:`fnppo.hf`,
:mod:`fnppo.lora`, :mod:`fnppo.checkpoint`, :mod:`fnppo.testing` (Megatron), and :mod:`fnppo.sinks` (metrics to
TensorBoard, Weights & Biases, MLflow).

The code is layered (a contract in CI checks it): ``fnppo.core`` (pure torch, never imports
Megatron) < ``fnppo.megatron`` < ``fnppo.io`` < ``fnppo.steps``. The pure names below are imported
with the package; a name or namespace that needs Megatron is imported when first used, so
``import fnppo`` and all of ``fnppo.core`` work without megatron-core installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fnppo.megatron.quiet import install_warning_filters as _install_warning_filters

_install_warning_filters()  # before Megatron is imported: see fnppo/megatron/quiet.py

from fnppo.core.batching.collate import collate_microbatch as collate_microbatch  # noqa: E402
from fnppo.core.batching.sample import Microbatch as Microbatch  # noqa: E402
from fnppo.core.batching.sample import Sample as Sample  # noqa: E402
from fnppo.core.batching.split import split_batch as split_batch  # noqa: E402
from fnppo.core.errors import InputError as InputError  # noqa: E402
from fnppo.core.errors import ShapeError as ShapeError  # noqa: E402
from fnppo.core.losses import LossConfig as LossConfig  # noqa: E402
from fnppo.core.losses import ppo_loss as ppo_loss  # noqa: E402
from fnppo.core.losses import value_loss as value_loss  # noqa: E402
from fnppo.core.ops.linear_logprob import linear_logprob_and_entropy as linear_logprob_and_entropy  # noqa: E402
from fnppo.core.ops.logprob import logprob_and_entropy as logprob_and_entropy  # noqa: E402

if TYPE_CHECKING:  # what type checkers and the API reference read; at run time __getattr__ imports these
    from fnppo.models import (
        ModelConfig,
        build_gpt,
        build_optimizer,
        finalize_grads,
        forward_logits,
        forward_values,
        wrap_ddp,
    )
    from fnppo.parallel import init_parallel
    from fnppo.steps import (
        CriticConfig,
        CriticFns,
        StepConfig,
        StepFns,
        TeacherModel,
        TrainState,
        compute_logprobs,
        compute_values,
        critic_step,
        forward_only,
        shard_for_data_parallel,
        train_step,
    )

__version__ = "0.1.0"

_PURE = ("losses", "advantages", "kl", "metrics", "batching", "ops", "typing")
_MEGATRON = ("models", "parallel", "moe", "vlm", "hf", "lora", "checkpoint", "sinks", "testing")
# where the top-level names that need Megatron are found (the namespaces themselves, no name table)
_SOURCES = ("fnppo.steps", "fnppo.models", "fnppo.parallel")

__all__ = [
    # data
    "Sample",
    "Microbatch",
    # stages
    "split_batch",
    "collate_microbatch",
    "forward_logits",
    "forward_values",
    "logprob_and_entropy",
    "linear_logprob_and_entropy",
    "ppo_loss",
    "value_loss",
    "finalize_grads",
    # steps
    "train_step",
    "critic_step",
    "compute_logprobs",
    "compute_values",
    "forward_only",
    "shard_for_data_parallel",
    # configs and state
    "StepConfig",
    "StepFns",
    "CriticConfig",
    "CriticFns",
    "LossConfig",
    "TeacherModel",
    "ModelConfig",
    "TrainState",
    # model and parallel layout
    "build_gpt",
    "wrap_ddp",
    "build_optimizer",
    "init_parallel",
    # errors
    "InputError",
    "ShapeError",
]


def __getattr__(name: str) -> Any:
    """A namespace, or a top-level name that needs Megatron, imported on first use."""
    if name in _PURE or name in _MEGATRON:
        value: Any = importlib.import_module(f"fnppo.{name}")
    elif name in __all__:
        value = next(getattr(m, name) for m in map(importlib.import_module, _SOURCES) if hasattr(m, name))
    else:
        raise AttributeError(f"module 'fnppo' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_PURE, *_MEGATRON})
