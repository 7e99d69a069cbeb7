"""``--profile-step``: wall time per phase, torch.profiler and cProfile summaries of one step."""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class _Phases:
    """Wall time per named phase of a profiled step (device-synchronized at both ends)."""

    def __init__(self, device, enabled: bool):
        self.device, self.enabled, self.times = device, enabled, []

    def __call__(self, name: str):
        if not self.enabled:
            return contextlib.nullcontext()
        return self._timed(name)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _timed(self, name: str):
        @contextlib.contextmanager
        def block():
            self._sync()
            t0 = time.perf_counter()
            yield
            self._sync()
            self.times.append((name, time.perf_counter() - t0))

        return block()


def profiled(enabled: bool, args, out_dir: Path, device, rank0: bool):
    """Context of one training step: a :class:`_Phases` timer, and with ``enabled`` torch.profiler
    (kernels and operators) and cProfile (Python functions) around it; rank 0 writes the report."""

    @contextlib.contextmanager
    def block():
        phases = _Phases(device, enabled)
        if not enabled:
            yield phases
            return

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        cpu_prof = cProfile.Profile()
        with profile(activities=activities) as prof:
            cpu_prof.enable()
            t0 = time.perf_counter()
            yield phases
            phases._sync()
            wall = time.perf_counter() - t0
            cpu_prof.disable()
        if not rank0:
            return
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.end - e.time_range.start for e in kernels) / 1e6
        lines = [
            f"profiled step {args.profile_step} on {device}: {wall:.3f} s wall, "
            f"{len(kernels)} kernels taking {busy:.3f} s of device time"
        ]
        lines += [f"  {name}: {dt:.3f} s" for name, dt in phases.times]
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50))
        if device.type == "cuda":
            lines.append(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=50))
        stream = io.StringIO()
        pstats.Stats(cpu_prof, stream=stream).sort_stats("cumulative").print_stats(45)
        stream.write("\n")
        pstats.Stats(cpu_prof, stream=stream).sort_stats("tottime").print_stats(30)
        lines.append(stream.getvalue())
        path = Path(args.profile_out) if args.profile_out else out_dir / "profile.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        parts = ", ".join(f"{name} {dt:.3f} s" for name, dt in phases.times)
        print(f"profile of step {args.profile_step}: {wall:.3f} s ({parts}) -> {path}", flush=True)

    return block()
