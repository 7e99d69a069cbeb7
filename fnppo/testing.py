"""An N-rank launcher for tests: real megatron-core on CPU over gloo, one process per rank.

:func:`run_ranks` runs a picklable function on N gloo ranks in separate processes (started with
``spawn``; each call gets its own free port), each inside :func:`~fnppo.megatron.runtime.megatron_on_cpu`
(the CPU mode of :mod:`fnppo.megatron.runtime`, re-exported here) with the requested TP/PP layout,
and returns every rank's result. If any rank raises, all ranks are stopped and the first error is
re-raised with its remote traceback. The rank processes are kept for the next call of the same
size (imports are paid once; ``fresh=True`` for new ones). :func:`tiny_model_config` is the small
GPT the tests build, :func:`synthetic_samples` draws random samples for tests and demos;
:class:`LiveBytes` measures the torch memory a piece of code holds.

Not imported by the library.
"""

from __future__ import annotations

import contextlib
import gc
import io
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fnppo.core.batching.sample import Sample
from fnppo.core.typing import set_typechecking, typechecking_enabled
from fnppo.megatron.config import ModelConfig
from fnppo.megatron.parallel import destroy_parallel, free_port, init_parallel
from fnppo.megatron.runtime import cpu_mode_active as cpu_mode_active
from fnppo.megatron.runtime import cpu_mode_entered_for_process
from fnppo.megatron.runtime import enter_cpu_mode_for_process as enter_cpu_mode_for_process
from fnppo.megatron.runtime import exit_cpu_mode_for_process as exit_cpu_mode_for_process
from fnppo.megatron.runtime import megatron_on_cpu as megatron_on_cpu

__all__ = ["megatron_on_cpu", "run_ranks", "RankError", "tiny_model_config", "synthetic_samples", "LiveBytes"]


def tiny_model_config(*, moe: bool = False, **overrides: Any) -> ModelConfig:
    """The small GPT of the tests: 2 layers, hidden 32, 4 heads in 2 query groups, FFN 64,
    vocabulary 64, sequences up to 32 tokens, :class:`~fnppo.megatron.config.ModelConfig`'s defaults
    otherwise; ``moe=True`` makes every layer 4 experts (top-2, expert FFN 48, no load-balancing
    loss). ``overrides`` replace or add any field: ``tiny_model_config(num_layers=4, tie_embeddings=True)``.
    """
    fields: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        vocab_size=64,
        max_seq_len=32,
    )
    if moe:
        fields.update(num_experts=4, moe_topk=2, moe_ffn_hidden_size=48, moe_load_balancing="none")
    return ModelConfig(**{**fields, **overrides})


def _dumps(obj: Any) -> bytes:
    """Serialize a rank's result by value (tensors too: no shared-memory handles that die with the rank)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


class RankError(RuntimeError):
    """A rank of :func:`run_ranks` raised; the message holds its rank and remote traceback."""


def _run_rank(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    layout: dict[str, Any],
    seed: int,
    timeout_s: float,
) -> tuple[bool, Any, bool]:
    """One call of ``fn`` on one rank: the process group and Megatron's groups set up, then torn down.

    Returns ``(ok, payload, clean)``: the serialized result or the traceback, and whether the process
    is back in its starting state (process group destroyed, environment, dtype, threads and
    call-time checking restored), which a reusable worker needs to take the next call.
    """
    saved_env = dict(os.environ)
    saved = (torch.get_default_dtype(), torch.get_num_threads(), typechecking_enabled())
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    try:
        with megatron_on_cpu():
            init_parallel(
                layout["tp"],
                layout["pp"],
                vpp=layout["vpp"],
                ep=layout["ep"],
                etp=layout["etp"],
                seed=seed,
                device="cpu",
                timeout_s=timeout_s,
                cp=layout["cp"],
            )
            try:
                out = fn(*args, **kwargs)
            finally:
                with contextlib.suppress(Exception):
                    destroy_parallel()
        ok, payload = True, _dumps(out)
    except BaseException:  # noqa: BLE001 - forwarded to the parent with its traceback
        ok, payload = False, traceback.format_exc()
    out = None
    gc.collect()  # what the call built, process groups included, goes now rather than during a later call
    clean = not dist.is_initialized() and not cpu_mode_entered_for_process()
    os.environ.clear()
    os.environ.update(saved_env)
    torch.set_default_dtype(saved[0])
    torch.set_num_threads(saved[1])
    set_typechecking(saved[2])
    return ok, payload, clean


#: a pooled rank with more threads than this is replaced: a Mixture-of-Experts train step leaves
#: its model and process groups behind (an uncollected cycle in Megatron), about 50 gloo threads each
_MAX_WORKER_THREADS = 160


def _thread_count() -> int:
    """Threads of this process (Linux), or 0 where ``/proc`` does not tell."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    layout: dict[str, Any],
    seed: int,
    timeout_s: float,
    results: Any,
) -> None:
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
        # what survives a call (modules imported, caches) is not garbage: frozen out of the collector's
        # scans, so the next call's collections (its own, Megatron's around checkpoints) scan only the
        # next call's objects (half a million objects after torch and Megatron: 0.26 s per full scan)
        gc.freeze()
        clean = clean and _thread_count() <= _MAX_WORKER_THREADS
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
        self.procs = [
            ctx.Process(target=_worker_main, args=(r, world_size, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
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


def _collect(
    procs: list[Any], results: Any, world_size: int, call_id: int, deadline: float
) -> tuple[dict[int, Any], bool]:
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
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world_size, port, fn, args, kwargs, layout, seed, timeout_s, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
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
    """``n`` random :class:`~fnppo.core.batching.sample.Sample` s with varied lengths, for tests and demos.

    Old/ref/rollout log-probs are drawn around -2 (plausible values), advantages are standard
    normal, and with ``masked_tokens`` some response tokens are masked out (tool output in a
    multi-turn response). With ``multi_modal_every=k``, every k-th sample carries an ``"images"``
    tensor. Deterministic in ``seed``.
    """
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


class LiveBytes:
    """The peak of the bytes that torch storages allocated inside ``with LiveBytes() as m:`` hold while
    still alive (``m.peak``), on any device: a dispatch mode sees every op; an output storage that is
    none of the op's inputs' is an allocation (views, in-place ops and a ``recv`` into a buffer are
    not), kept by a weak reference until freed, and the sum over those alive is taken at every op.
    Memory that torch's ops do not allocate (a collective's internal buffers) is not seen. Enter it
    again to measure more code: the peak and the storages still alive carry over."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[Any, int]] = {}
        self.peak = 0
        self._mode: Any = None

    def __enter__(self) -> LiveBytes:
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                seen = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen:
                        st = t.untyped_storage()
                        tracker.live[st._cdata] = (StorageWeakRef(st), st.nbytes())
                tracker.live = {k: v for k, v in tracker.live.items() if not v[0].expired()}
                tracker.peak = max(tracker.peak, sum(n for _, n in tracker.live.values()))
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._mode = None
