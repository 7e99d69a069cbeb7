"""Real megatron-core on CPU: a context manager and an N-rank launcher for tests.

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
block (it seeds Megatron's RNG trackers with ``model_parallel_cuda_manual_seed``).

:func:`run_ranks` runs a picklable function on N gloo ranks in separate processes (started with
``spawn``; each call gets its own free port), each inside :func:`megatron_on_cpu` with the requested
TP/PP layout, and returns every rank's result. If any rank raises, all ranks are stopped and the
first error is re-raised with its remote traceback. The rank processes are kept for the next call
of the same size (imports are paid once; ``fresh=True`` for new ones).

Sequence parallelism works with fnppo's local spec (:mod:`fnppo.megatron.norms`); Megatron's
tensor-parallel layers and mappings see a ``torch`` whose tensor factories map CUDA devices to the
CPU (their backward functions run outside the function mode). Limits: no Transformer Engine
layers, no fused CUDA kernels (bias-gelu, rope and softmax fusions must be off). Context
parallelism runs through fnppo's own packed attention (:mod:`fnppo.core.context_parallel`). Everything else fnppo uses (local layer spec, TP, PP, virtual pipeline, DP, DDP,
distributed optimizer) is the real Megatron code path.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fnppo.megatron.parallel import free_port

__all__ = ["megatron_on_cpu", "run_ranks", "RankError", "synthetic_samples"]

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
        global _CPU_STREAM
        if _CPU_STREAM is None:
            _CPU_STREAM = super().__new__(cls)
        return _CPU_STREAM

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        pass


_CPU_STREAM: _CpuStream | None = None


def _uneven_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``_gather_along_first_dim`` where gloo lacks it: blocks of unequal sizes
    (``output_split_sizes``, e.g. the tokens an expert-TP rank routes) are padded to the largest,
    gathered, and cut back."""
    if getattr(original, "_fnppo", False):
        return original

    def gather(input_: torch.Tensor, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False) -> torch.Tensor:
        sizes = None if output_split_sizes is None else [int(n) for n in output_split_sizes]
        if sizes is None or len(set(sizes)) == 1 or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        import torch.distributed as dist

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

    def reduce_scatter(input_: torch.Tensor, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False) -> torch.Tensor:
        sizes = None if input_split_sizes is None else [int(n) for n in input_split_sizes]
        if sizes is None or len(set(sizes)) == 1 or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        import torch.distributed as dist

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
    from megatron.core.tensor_parallel import layers as mlayers
    from megatron.core.tensor_parallel import mappings as mmappings
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = None, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    patches = [
        (mmappings, "_gather_along_first_dim", _uneven_gather(mmappings._gather_along_first_dim)),
        (mmappings, "_reduce_scatter_along_first_dim", _uneven_reduce_scatter(mmappings._reduce_scatter_along_first_dim)),
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
    from megatron.core.tensor_parallel import mappings

    # Autograd runs backward functions outside the block's TorchFunctionMode, and Megatron's
    # communication functions (e.g. the expert all-to-all and gathers) allocate on
    # torch.cuda.current_device() in their backward too: their forward and backward enter the mode.
    # Activation recomputation reruns the forward inside the backward (CheckpointFunction) too.
    for cls in [*vars(mappings).values(), *vars(mrandom).values()]:
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function) and cls is not torch.autograd.Function:
            for method in ("forward", "backward"):
                if isinstance(cls.__dict__.get(method), staticmethod):
                    patches.append((cls, method, staticmethod(_in_cpu_mode(cls.__dict__[method].__func__))))
    if cpu_mode_active():  # nested (e.g. init_parallel inside an explicit block): nothing to add
        yield
        return
    saved = [(obj, name, obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)) for obj, name, _ in patches]
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


def exit_cpu_mode_for_process() -> None:
    """Leave the block entered by :func:`enter_cpu_mode_for_process`, if any."""
    while _AUTO_STACK:
        _AUTO_STACK.pop().close()


def _dumps(obj: Any) -> bytes:
    """Serialize a rank's result by value (tensors too: no shared-memory handles that die with the rank)."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(data), weights_only=False)


class RankError(RuntimeError):
    """A rank of :func:`run_ranks` raised; the message holds its rank and remote traceback."""


def _run_rank(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, kwargs: dict,
              layout: dict[str, Any], seed: int, timeout_s: float) -> tuple[bool, Any, bool]:
    """One call of ``fn`` on one rank: the process group and Megatron's groups set up, then torn down.

    Returns ``(ok, payload, clean)``: the serialized result or the traceback, and whether the process
    is back in its starting state (process group destroyed, environment, dtype, threads and
    call-time checking restored), which a reusable worker needs to take the next call.
    """
    from fnppo.megatron.parallel import destroy_parallel, init_parallel
    from fnppo.core.typing import set_typechecking, typechecking_enabled

    saved_env = dict(os.environ)
    saved = (torch.get_default_dtype(), torch.get_num_threads(), typechecking_enabled())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    try:
        with megatron_on_cpu():
            init_parallel(layout["tp"], layout["pp"], vpp=layout["vpp"], ep=layout["ep"], etp=layout["etp"], seed=seed,
                          device="cpu", timeout_s=timeout_s, cp=layout["cp"])
            try:
                out = fn(*args, **kwargs)
            finally:
                with contextlib.suppress(Exception):
                    destroy_parallel()
        ok, payload = True, _dumps(out)
    except BaseException:  # noqa: BLE001 - forwarded to the parent with its traceback
        ok, payload = False, traceback.format_exc()
    import torch.distributed as dist

    clean = not dist.is_initialized() and not _AUTO_STACK
    os.environ.clear()
    os.environ.update(saved_env)
    torch.set_default_dtype(saved[0])
    torch.set_num_threads(saved[1])
    set_typechecking(saved[2])
    return ok, payload, clean


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, kwargs: dict,
               layout: dict[str, Any], seed: int, timeout_s: float, results: Any) -> None:
    """A fresh rank process: one call, then exit."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    ok, payload, _clean = _run_rank(rank, world_size, port, fn, args, kwargs, layout, seed, timeout_s)
    results.put((0, rank, ok, payload, True))


def _worker_main(rank: int, world_size: int, tasks: Any, results: Any) -> None:
    """A reusable rank process: calls from ``tasks`` until ``None``; every result is tagged with its call id."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    while True:
        task = tasks.get()
        if task is None:
            return
        call_id, port, fn, args, kwargs, layout, seed, timeout_s = task
        ok, payload, clean = _run_rank(rank, world_size, port, fn, args, kwargs, layout, seed, timeout_s)
        results.put((call_id, rank, ok, payload, clean))
        if not clean:
            return  # a rank that could not tear its groups down takes no further call


class _Workers:
    """``world_size`` spawned rank processes that take one :func:`run_ranks` call after another.

    Importing torch and Megatron takes a rank seconds; a pool pays it once per world size instead of
    once per call. It is discarded (its processes killed) after any call that did not end cleanly on
    every rank: an error, a timeout, a dead rank, or a rank left with a process group.
    """

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_worker_main, args=(r, world_size, self.tasks[r], self.results), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.calls = 0

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def submit(self, task: tuple) -> int:
        self.calls += 1
        for q in self.tasks:
            q.put((self.calls, *task))
        return self.calls

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()


_POOLS: dict[int, _Workers] = {}


def _collect(procs: list[Any], results: Any, world_size: int, call_id: int, deadline: float) -> tuple[dict[int, Any], bool]:
    """Every rank's result of call ``call_id`` (raising :class:`RankError` on the first failure), and
    whether every rank ended clean."""
    out: dict[int, Any] = {}
    clean = True
    while len(out) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RankError(f"run_ranks: ranks {sorted(set(range(world_size)) - set(out))} timed out")
        try:
            cid, rank, ok, value, rank_clean = results.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in out and p.exitcode not in (0, None)]
            if dead:
                raise RankError(f"run_ranks: rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
            continue
        if cid != call_id:
            continue
        if not ok:
            raise RankError(f"run_ranks: rank {rank} of {world_size} raised:\n{value}")
        out[rank] = _loads(value)
        clean = clean and rank_clean
    return out, clean


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
    timeout_s: float = 300.0,
    cp: int = 1,
    fresh: bool | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks (real Megatron on CPU).

    Each rank is a separate process (``spawn``) in which ``torch.distributed`` and Megatron's
    model-parallel groups are initialized for this call, for ``tp`` x ``cp`` x ``pp`` (``cp``: context
    parallel; data parallel fills the rest; MoE layers use ``ep`` x ``etp``, see
    :func:`fnppo.init_parallel`), on a port of its own, with the RNG trackers (and torch's generator)
    seeded with ``seed``, and torn down afterwards. ``fn`` must be importable (a module-level
    function). Returns the list of per-rank return values (tensors are passed back by value). If a
    rank raises, all ranks are stopped and :class:`RankError` carries the first failing rank's
    traceback; a rank that neither returns nor raises within ``timeout_s`` seconds is reported the
    same way.

    The rank processes are reused by later calls of the same ``world_size`` (they stay up, idle,
    until the interpreter exits): between calls each rank destroys its process groups and restores
    its environment variables, default dtype, thread count and call-time checking; anything else a
    ``fn`` changes at module level stays for the next call. ``fresh=True`` (or the environment
    variable ``FNPPO_FRESH_RANKS=1``) starts new processes for this call and ends them after it.
    After a failed call the reused processes are ended too.
    """
    layout = dict(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, cp=cp)
    if fresh is None:
        fresh = os.environ.get("FNPPO_FRESH_RANKS", "0") not in ("", "0")
    port = free_port()
    deadline = time.monotonic() + timeout_s + 60.0
    if fresh:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, kwargs, layout, seed, timeout_s, results),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        try:
            out, _ = _collect(procs, results, world_size, 0, deadline)
        finally:
            for p in procs:
                if p.is_alive():
                    p.join(timeout=5.0 if len(out) == world_size else 0.0)
                if p.is_alive():
                    p.kill()
                    p.join()
        return [out[r] for r in range(world_size)]
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _POOLS[world_size] = _Workers(world_size)
    call_id = pool.submit((port, fn, args, kwargs, layout, seed, timeout_s))
    try:
        out, clean = _collect(pool.procs, pool.results, world_size, call_id, deadline)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.kill()
        raise
    if not clean:
        _POOLS.pop(world_size, None)
        pool.kill()
    return [out[r] for r in range(world_size)]


def synthetic_samples(
    n: int,
    *,
    vocab_size: int = 64,
    seed: int = 0,
    prompt_len: tuple[int, int] = (2, 6),
    response_len: tuple[int, int] = (1, 8),
    with_ref: bool = True,
    with_rollout: bool = False,
    masked_tokens: bool = True,
    multi_modal_every: int = 0,
):
    """``n`` random :class:`~fnppo.core.batch.Sample` s with varied lengths, for tests and demos.

    Old/ref/rollout log-probs are drawn around -2 (plausible values), advantages are standard
    normal, and with ``masked_tokens`` some response tokens are masked out (tool output in a
    multi-turn response). With ``multi_modal_every=k``, every k-th sample carries an ``"images"``
    tensor. Deterministic in ``seed``.
    """
    from fnppo.core.batch import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (), generator=g))
        r = int(torch.randint(response_len[0], response_len[1] + 1, (), generator=g))
        mask = None
        if masked_tokens and r > 2 and i % 3 == 0:
            mask = torch.ones(r)
            mask[1] = 0.0
        mm = {}
        if multi_modal_every and i % multi_modal_every == 0:
            mm = {"images": torch.randn(1 + i % 2, 3, 4, 4, generator=g)}
        out.append(
            Sample(
                prompt_ids=torch.randint(0, vocab_size, (p,), generator=g),
                response_ids=torch.randint(0, vocab_size, (r,), generator=g),
                advantages=torch.randn(r, generator=g),
                old_logprobs=-2.0 + 0.3 * torch.randn(r, generator=g),
                ref_logprobs=(-2.0 + 0.3 * torch.randn(r, generator=g)) if with_ref else None,
                rollout_logprobs=(-2.0 + 0.3 * torch.randn(r, generator=g)) if with_rollout else None,
                response_mask=mask,
                multi_modal=mm,
            )
        )
    return out
