"""Run a Python program as ``python script.py args`` (or ``torchrun --nproc-per-node N script.py args``)
would, without paying torch's, Megatron's and fnppo's imports in every process.

:func:`run_script` forks each process from one server (``multiprocessing``'s fork server, started on
first use) that imported :data:`PRELOAD` once; in the fork the program runs as ``__main__`` with its
own ``sys.argv``, working directory, environment (``torchrun``'s rank, world size and rendezvous
variables for ``nproc`` > 1) and standard output and error. What a fork cannot show is what those
imports print: ``tests/test_docs.py`` checks that once, in a new interpreter. A test whose property
is about the imports themselves (what a refusal imports before it exits) launches a real
``python`` (``subprocess``) instead.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

from fnppo.megatron.parallel import free_port

ROOT = Path(__file__).resolve().parents[1]
#: what the guides, README and examples import: paid once by the fork server, not once a process
PRELOAD = ["torch", "fnppo", "fnppo.steps", "fnppo.models", "fnppo.parallel", "fnppo.checkpoint", "fnppo.losses"]
_SERVER: list = []  # the fork-server context, once started (set_forkserver_preload only acts before that)


def script_env() -> dict:
    """The environment a test gives a program: this checkout importable, one OpenMP thread."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")


def _forked_main(path: str, code: str | None, args: list, cwd: str, env: dict, out: str) -> None:
    """In a fork of the server: what ``python path *args`` (``python -c code *args``) in ``cwd`` would
    do, its output to the files ``out.stdout`` and ``out.stderr``."""
    gc.freeze()  # the server's preloaded objects: out of the collector's scans (Megatron collects around checkpoints)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        with open(f"{out}.{name}", "w") as f:
            os.dup2(f.fileno(), fd)
    sys.argv = [path if code is None else "-c", *args]
    sys.path.insert(0, os.path.dirname(path) if code is None else "")
    try:
        if code is None:
            runpy.run_path(path, run_name="__main__")
        else:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _torchrun_env(nproc: int) -> list[dict]:
    """The environment ``torchrun --nproc-per-node nproc`` gives each process: rank, world size, rendezvous."""
    port, world = str(free_port()), str(nproc)
    ranks = [dict(RANK=r, LOCAL_RANK=r, ROLE_RANK=r, GROUP_RANK="0") for r in map(str, range(nproc))]
    sizes = dict(WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, ROLE_WORLD_SIZE=world)
    return [dict(script_env(), **rank, **sizes, MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for rank in ranks]


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def run_script(
    path: Path | None,
    args: tuple | list = (),
    *,
    nproc: int = 1,
    cwd: Path | None = None,
    code: str | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """Run the program ``path`` (or the source ``code``, as ``python -c``) with ``args`` in ``cwd`` (by
    default ``path``'s folder) as ``python`` would, or with ``nproc`` > 1 as ``torchrun
    --nproc-per-node nproc`` would, each process a fork of the preloaded server. Returns the first
    process's exit code and output; with ``nproc`` > 1 the exit code is the first non-zero one, and
    the output of a failed process is appended to stderr. A process still running after ``timeout``
    seconds, or 10 s after another one failed, is killed (exit code -9)."""
    assert (path is None) != (code is None), "run_script: a path or code"
    if not _SERVER:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _SERVER.append(ctx)
    cwd = Path(cwd or path.parent)  # type: ignore[union-attr]
    envs = [script_env()] if nproc == 1 else _torchrun_env(nproc)
    name = "code" if path is None else path.name
    outs = [cwd / f".{name}.{os.getpid()}.{time.monotonic_ns()}.r{r}" for r in range(nproc)]
    procs = [
        _SERVER[0].Process(target=_forked_main, args=(str(path), code, list(args), str(cwd), env, str(out)))
        for env, out in zip(envs, outs, strict=True)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    failed_at = None  # as torchrun does: one process failing ends the others (after a grace period)
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() > failed_at + 10.0:
            break
        time.sleep(0.05)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()
    texts = [[_read(Path(f"{out}.{n}")) for n in ("stdout", "stderr")] for out in outs]
    for out in outs:
        for n in ("stdout", "stderr"):
            Path(f"{out}.{n}").unlink(missing_ok=True)
    codes = [proc.exitcode for proc in procs]
    stderr = texts[0][1] + "".join(
        f"\n--- rank {r} of {nproc} exited with {c}:\n{texts[r][0][-3000:]}\n{texts[r][1][-6000:]}"
        for r, c in enumerate(codes)
        if c != 0 and r > 0
    )
    code_ = next((c for c in codes if c not in (0, -9)), next((c for c in codes if c != 0), 0))  # -9: ended here
    return subprocess.CompletedProcess([name, *args], code_, texts[0][0], stderr)
