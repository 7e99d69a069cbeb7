"""Checkpoint faults that need a process of their own: a save killed (SIGKILL) at random points, a
file-size limit, a read-only directory, two runs locking one output directory at once.

Every fault runs in a child forked from the test process (``os.fork``: no new interpreter, no
re-import), a world of one gloo rank of its own with a small model; ``FNPPO_TEST_KILLS`` sets the
number of kills (4 by default), ``FNPPO_TEST_LOCK_RACES`` the lock races (10).
After every kill the next save's / resume's clean-up must leave only complete checkpoints, each
verified, and never lose one that was complete before the kill.
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

import fnppo

KILLS = int(os.environ.get("FNPPO_TEST_KILLS", 4))  # SIGKILLs at random points of a save
LOCK_RACES = int(os.environ.get("FNPPO_TEST_LOCK_RACES", 10))  # two processes locking one directory at once


def _state() -> fnppo.TrainState:
    cfg = fnppo.ModelConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        vocab_size=32,
        max_seq_len=16,
    )
    ddp = fnppo.wrap_ddp(fnppo.build_gpt(cfg), use_distributed_optimizer=True)
    return fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-2))


def _child_state() -> fnppo.TrainState:
    """In a forked child: a world of one rank of its own (its own port), and the small model."""
    from fnppo.megatron.parallel import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    fnppo.init_parallel(1, 1, seed=1, device="cpu", timeout_s=60.0)
    return _state()


def _in_child(work) -> tuple[int, str]:
    """Run ``work(state)`` (returning a str) in a forked child; (its exit status, what it returned or raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        os.close(r)
        try:
            msg, code = str(work(_child_state())), 0
        except BaseException as err:  # noqa: BLE001 - sent back to the parent
            msg, code = f"{type(err).__name__}: {err}", 1
        os.write(w, msg.encode())
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), text


def _debris(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def _saving_child(root: Path, k: int, names: list[str]) -> tuple[int, float]:
    """A forked run that saves over ``names`` and new names until it is killed; (pid, seconds per save)
    once its first save is done."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            state = _child_state()
            i = 0
            while True:
                t0 = time.perf_counter()
                fnppo.checkpoint.save_checkpoint(root / [*names, f"n{k}_{i}"][i % 3], state)
                if i == 1:
                    os.write(w, f"{time.perf_counter() - t0:.6f}".encode())
                i += 1
        finally:
            os._exit(3)
    os.close(w)
    took = os.read(r, 64).decode()
    os.close(r)
    assert took, "the saving child died before its second save"
    return pid, float(took)


def test_a_killed_save_leaves_nothing_half_written_and_loses_nothing(tmp_path):
    """SIGKILL at random points of the writing phase of saves (which replace the complete checkpoints
    ``a`` and ``b`` or write new ones). What the kill leaves is cleaned up by the next resume
    (``latest_checkpoint``, odd rounds) or by the next save (the next round's child, even rounds): no
    temporary directory left, ``a`` and ``b`` still there, every checkpoint verifies."""
    rng, names = random.Random(7), ["a", "b"]
    killed_mid_save, left, lost, unverified = 0, [], [], []
    debris: list[str] = []
    for k in range(KILLS + 1):
        pid, _ = _saving_child(tmp_path, k, names)  # its first two saves cleaned up the last round's debris
        left += [d for d in debris if (tmp_path / d).exists()]
        if k == KILLS:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        while not _debris(tmp_path):  # a save is writing: kill it at a random point of its writing
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        debris = _debris(tmp_path)
        killed_mid_save += int(debris != [])
        if k % 2:  # the next resume cleans up
            fnppo.checkpoint.latest_checkpoint(tmp_path)
            left += _debris(tmp_path)
        lost += [n for n in names if not (tmp_path / n).is_dir()]
        for d in tmp_path.iterdir():
            if d.name.startswith("."):
                continue
            try:
                fnppo.checkpoint.verify_checkpoint(d)
            except fnppo.checkpoint.CheckpointError as err:
                unverified.append(f"{d.name}: {err}")
    assert killed_mid_save >= KILLS // 2, killed_mid_save  # the kills did land inside saves
    assert left == [], left
    assert lost == [], lost
    assert unverified == [], unverified[:3]


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to the user 'nobody' needs root")
def test_file_size_limit_and_read_only_directory_are_named_and_leave_nothing(tmp_path, request):
    def small_file_limit(state) -> str:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        fnppo.checkpoint.save_checkpoint(tmp_path / "fsize", state)
        return "no error"

    code, msg = _in_child(small_file_limit)
    assert code == 1 and msg.startswith("CheckpointError: save_checkpoint: argument 'directory' expected "), msg
    assert "file-size limit (RLIMIT_FSIZE" in msg and "4096 bytes" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "debris after the file-size limit"

    ro = Path(tempfile.mkdtemp(prefix="fnppo-readonly-"))  # under /tmp: 'nobody' may enter it, not write
    ro.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(ro, ignore_errors=True))

    def as_nobody(state) -> str:  # root ignores permissions: the writer runs as an unprivileged user
        os.setgid(65534)
        os.setuid(65534)
        fnppo.checkpoint.save_checkpoint(ro / "step1", state)
        return "no error"

    code, msg = _in_child(as_nobody)
    assert code == 1 and msg.startswith("CheckpointError: save_checkpoint: argument 'directory' expected "), msg
    assert "read-only or not writable" in msg, msg
    assert sorted(p.name for p in ro.iterdir()) == []


def test_ctrl_c_inside_torchs_checkpoint_writer_stays_a_keyboard_interrupt(tmp_path):
    """torch's checkpoint writer wraps whatever a rank's write raises in its ``CheckpointException``: a
    Ctrl-C that lands there still reaches the caller as ``KeyboardInterrupt`` (the example's exit 130
    and resume hint), not as a failed write, and nothing is left behind."""

    def interrupted(state) -> str:
        import torch.distributed.checkpoint as dcp

        def ctrl_c(*args, **kwargs):
            raise KeyboardInterrupt

        dcp.FileSystemWriter.write_data = ctrl_c  # in the forked child only
        fnppo.checkpoint.save_checkpoint(tmp_path / "step1", state)
        return "no error"

    code, msg = _in_child(interrupted)
    assert code == 1 and msg.startswith("KeyboardInterrupt"), msg
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _lock_and_report(d: Path, go: int, result: int, end: int) -> None:
    """A forked run: wait for ``go``, lock ``d``, report 0 (got it), 1 (refused by name) or 2 (another
    error) on ``result``, hold the lock until ``end``, then exit."""
    os.read(go, 1)
    lock, code = None, 0
    try:
        lock = fnppo.checkpoint.lock_directory(d)
    except fnppo.checkpoint.CheckpointError as err:
        expected = f"lock_directory: argument 'root' expected a directory no other run is using, received '{d}'"
        code = 1 if str(err).startswith(expected) and "locked by process" in str(err) else 2
    os.write(result, bytes([code]))
    os.read(end, 1)
    if lock is not None:
        lock.release()
    os._exit(0)


def test_two_runs_started_together_in_one_directory(tmp_path):
    """Two processes released at once (one pipe) lock the same directory and hold what they got
    until both have answered: one gets the lock, the other is refused by name, every time."""
    outcomes = []
    for i in range(LOCK_RACES):
        d = tmp_path / f"run{i % 4}"
        go, result, end = os.pipe(), os.pipe(), os.pipe()
        pids = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                _lock_and_report(d, go[0], result[1], end[0])
            pids.append(pid)
        os.write(go[1], b"gg")
        outcomes.append(sorted(os.read(result[0], 1)[0] for _ in range(2)))
        os.write(end[1], b"ee")
        for pid in pids:
            os.waitpid(pid, 0)
        for fd in (*go, *result, *end):
            os.close(fd)
    assert outcomes == [[0, 1]] * LOCK_RACES, outcomes
    # released on any exit: a killed holder's lock is free again at once
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        held = fnppo.checkpoint.lock_directory(tmp_path / "killed")  # kept: released only by the kill
        os.write(w, b"held" if held.held else b"lost")
        time.sleep(60)
        os._exit(0)
    os.close(w)
    assert os.read(r, 4) == b"held"
    os.close(r)
    with pytest.raises(fnppo.checkpoint.CheckpointError, match=f"locked by process {pid} "):
        fnppo.checkpoint.lock_directory(tmp_path / "killed")
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    with fnppo.checkpoint.lock_directory(tmp_path / "killed") as lock:
        assert lock.held
    assert not lock.held
    with pytest.raises(fnppo.checkpoint.CheckpointError, match="argument 'root' expected a path"):
        fnppo.checkpoint.lock_directory(None)
