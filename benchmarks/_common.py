"""Timing, peak-memory and fp64-reference helpers shared by ``benchmarks/logprob.py`` and
``benchmarks/linear_logprob.py`` (imported as a sibling module: ``from _common import ...``)."""

from __future__ import annotations

import gc
import statistics
import time

import torch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, reps, warmup, back_to_back=1):
    """Median wall time of ``fn()`` in ms (CUDA events on GPU).

    ``back_to_back=n > 1``: each timed sample runs ``fn`` n times without waiting in between and
    counts a 1/n share, so the host's launch latency at the start of a call is hidden behind the
    previous call's GPU work (as it is inside a training step, behind the model's layers).
    """
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(back_to_back):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / back_to_back)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fwd_bwd(method, leaves, *rest):
    """A step that clears the gradients of ``leaves`` and backpropagates ``method(*leaves, *rest)``."""

    def step():
        for t in leaves:
            t.grad = None
        method(*leaves, *rest).backward()

    return step


def peak_extra_bytes(step, device, leaves):
    """Peak CUDA memory during ``step()`` above what was allocated before it, in bytes (gradients
    of ``leaves`` cleared before and after); None off CUDA."""
    if device.type != "cuda":
        return None
    for t in leaves:
        t.grad = None
    gc.collect()
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    for t in leaves:
        t.grad = None
    return peak - base


def fp64_logprob_entropy(x, labels, t, g_lp, g_h):
    """fp64 reference: ``lp``, ``ent`` of ``log_softmax(x / t)``, and the backward of
    ``sum(g_lp * lp) + sum(g_h * ent)`` (either term left out when its weight is None) into ``x``'s leaves."""
    logp = (x / t).log_softmax(-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    loss = (lp * g_lp.double()).sum() if g_lp is not None else 0
    loss = loss + ((ent * g_h.double()).sum() if g_h is not None else 0)
    loss.backward()
    return lp, ent
