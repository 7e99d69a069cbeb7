"""Real megatron-core on CPU: the process-wide mode that redirects Megatron's CUDA-only calls.

Megatron-core is written for CUDA, but its models, DDP, distributed optimizer, gradient finalizer
and pipeline schedules run on CPU over gloo once a handful of CUDA-only calls are redirected.
:func:`megatron_on_cpu` does that redirection for the duration of a ``with`` block:

* a ``TorchFunctionMode`` maps ``device="cuda"`` / ``device=<int>`` arguments to the CPU, makes
  ``Tensor.cuda()`` the identity and makes ``Tensor.type()`` report ``torch.cuda.*`` names (Megatron
  asserts on them);
* ``CUDA_DEVICE_MAX_CONNECTIONS=1`` is set in the environment (Megatron's TP layers advise it);
* ``torch.cuda.current_device``, ``synchronize``, ``get_rng_state``, ``set_rng_state`` and
  ``manual_seed`` act on the CPU (``Stream`` / ``current_stream`` / ``stream``: one no-op stream,
  for the MoE token dispatchers), and Megatron's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` act on the CPU
  generator;
* Megatron's communication and recomputation autograd functions (``tensor_parallel.mappings``,
  ``CheckpointFunction``) run their forward and backward in the mode, and its gathers /
  reduce-scatters of blocks of unequal sizes (expert tensor parallelism), which gloo lacks, pad
  the blocks to one size (gather) or all-reduce the whole input (reduce-scatter).

Build models with ``use_cpu_initialization=True`` and call :func:`fnppo.init_parallel` inside the
block (it seeds Megatron's RNG trackers with ``model_parallel_cuda_manual_seed``). On the gloo
backend :func:`fnppo.megatron.parallel.init_parallel` enters the mode for the whole process
(:func:`enter_cpu_mode_for_process`) until :func:`fnppo.megatron.parallel.destroy_parallel`.

Sequence parallelism works with fnppo's local spec (:mod:`fnppo.megatron.norms`); Megatron's
tensor-parallel layers and mappings see a ``torch`` whose tensor factories map CUDA devices to the
CPU (their backward functions run outside the function mode). Limits: no Transformer Engine
layers, no fused CUDA kernels (bias-gelu, rope and softmax fusions must be off). Context
parallelism runs through fnppo's own packed attention (:mod:`fnppo.core.batching.context_parallel`).
Everything else fnppo uses (local layer spec, TP, PP, virtual pipeline, DP, DDP, distributed
optimizer) is the real Megatron code path. The N-rank test launcher is :mod:`fnppo.testing`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import layers as mlayers
from megatron.core.tensor_parallel import mappings as mmappings
from megatron.core.tensor_parallel import random as mrandom
from torch.overrides import TorchFunctionMode

__all__ = [
    "megatron_on_cpu",
    "cpu_mode_active",
    "enter_cpu_mode_for_process",
    "exit_cpu_mode_for_process",
    "cpu_mode_entered_for_process",
]

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments to the CPU (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to,) and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _CpuFactories:
    """``torch`` as seen by Megatron's tensor-parallel layers and mappings inside :func:`megatron_on_cpu`.

    Their autograd backward functions allocate buffers with ``device=torch.cuda.current_device()``
    (e.g. the reduce-scatter of sequence parallelism); backward runs outside the function mode, so
    the tensor factories of this stand-in map CUDA devices to the CPU. Everything else is ``torch``.
    """

    _FACTORIES = ("empty", "zeros", "ones", "full")

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name not in self._FACTORIES:
            return value

        def factory(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs and _is_cuda_device(kwargs["device"]):
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)

        return factory


def _cpu_synchronize(*args: Any, **kwargs: Any) -> None:
    """``torch.cuda.synchronize`` inside :func:`megatron_on_cpu`: nothing to wait for."""


_cpu_synchronize._fnppo_cpu = True  # type: ignore[attr-defined]  # how cpu_mode_active recognizes it


class _CpuEvent:
    """``torch.cuda.Event`` inside :func:`megatron_on_cpu`: CPU work is already done when recorded."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """The one "stream" of :func:`megatron_on_cpu` (MoE dispatchers and shared experts ask for side
    streams; on the CPU every stream is this one, so no cross-stream bookkeeping is triggered)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _CpuStream:
        return _CPU_STREAM

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        pass


_CPU_STREAM: _CpuStream = object.__new__(_CpuStream)  # the one instance ``_CpuStream(...)`` returns


def _uneven_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``_gather_along_first_dim`` where gloo lacks it: blocks of unequal sizes
    (``output_split_sizes``, e.g. the tokens an expert-TP rank routes) are padded to the largest,
    gathered, and cut back."""
    if getattr(original, "_fnppo", False):
        return original

    def gather(
        input_: torch.Tensor, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False
    ) -> torch.Tensor:
        sizes = None if output_split_sizes is None else [int(n) for n in output_split_sizes]
        if sizes is None or len(set(sizes)) == 1 or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        width = max(sizes)
        padded = input_.new_zeros((width, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)

    gather._fnppo = True  # type: ignore[attr-defined]
    return gather


def _uneven_reduce_scatter(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``_reduce_scatter_along_first_dim`` with unequal ``input_split_sizes`` where gloo
    lacks it: the whole input is summed over the group (all-reduce) and each rank keeps its block."""
    if getattr(original, "_fnppo", False):
        return original

    def reduce_scatter(
        input_: torch.Tensor, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False
    ) -> torch.Tensor:
        sizes = None if input_split_sizes is None else [int(n) for n in input_split_sizes]
        if sizes is None or len(set(sizes)) == 1 or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return torch.split(total, sizes, dim=0)[group.rank()].contiguous()

    reduce_scatter._fnppo = True  # type: ignore[attr-defined]
    return reduce_scatter


def _in_cpu_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        with _CudaToCpuMode():
            return fn(*args)

    return run


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Run real megatron-core on CPU inside the block (see the module docstring for what it does)."""

    def get_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = None, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    patches = [
        (mmappings, "_gather_along_first_dim", _uneven_gather(mmappings._gather_along_first_dim)),
        (
            mmappings,
            "_reduce_scatter_along_first_dim",
            _uneven_reduce_scatter(mmappings._reduce_scatter_along_first_dim),
        ),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "synchronize", _cpu_synchronize),
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda s, *a, **k: torch.set_rng_state(s)),
        (torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed))),
        (torch.cuda, "Stream", _CpuStream),
        (torch.cuda, "current_stream", lambda *a, **k: _CpuStream()),
        (torch.cuda, "stream", lambda s=None: contextlib.nullcontext()),
        (mrandom, "_get_cuda_rng_state", get_state),
        (mrandom, "_set_cuda_rng_state", set_state),
        (mlayers, "torch", _CpuFactories()),
        (mmappings, "torch", _CpuFactories()),
    ]
    # Autograd runs backward functions outside the block's TorchFunctionMode, and Megatron's
    # communication functions (e.g. the expert all-to-all and gathers) allocate on
    # torch.cuda.current_device() in their backward too: their forward and backward enter the mode.
    # Activation recomputation reruns the forward inside the backward (CheckpointFunction) too.
    for cls in [*vars(mmappings).values(), *vars(mrandom).values()]:
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function) and cls is not torch.autograd.Function:
            for method in ("forward", "backward"):
                if isinstance(cls.__dict__.get(method), staticmethod):
                    patches.append((cls, method, staticmethod(_in_cpu_mode(cls.__dict__[method].__func__))))
    if cpu_mode_active():  # nested (e.g. init_parallel inside an explicit block): nothing to add
        yield
        return
    saved = [
        (obj, name, obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)) for obj, name, _ in patches
    ]
    for obj, name, value in patches:
        setattr(obj, name, value)
    # Megatron's TP layers advise this CUDA setting (stream concurrency) at build time; no CUDA here.
    saved_env = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    mode = _CudaToCpuMode()
    try:
        with mode:
            yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        if saved_env is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        else:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = saved_env


def cpu_mode_active() -> bool:
    """Whether :func:`megatron_on_cpu` is in effect (entered explicitly or by ``init_parallel``)."""
    return getattr(torch.cuda.synchronize, "_fnppo_cpu", False)


# The block init_parallel entered for this process (like torch.distributed's own process-wide state),
# closed by destroy_parallel.
_AUTO_STACK: list[contextlib.ExitStack] = []


def enter_cpu_mode_for_process() -> bool:
    """Enter :func:`megatron_on_cpu` until :func:`exit_cpu_mode_for_process` (used by ``init_parallel``).

    Returns False when it is already in effect (an explicit ``with megatron_on_cpu():`` block or an
    earlier call), in which case nothing is entered.
    """
    if cpu_mode_active():
        return False
    stack = contextlib.ExitStack()
    stack.enter_context(megatron_on_cpu())
    _AUTO_STACK.append(stack)
    return True


def cpu_mode_entered_for_process() -> bool:
    """Whether :func:`enter_cpu_mode_for_process` entered the mode and it has not been left yet."""
    return bool(_AUTO_STACK)


def exit_cpu_mode_for_process() -> None:
    """Leave the block entered by :func:`enter_cpu_mode_for_process`, if any."""
    while _AUTO_STACK:
        _AUTO_STACK.pop().close()
