"""Checkpoint faults that need a process of their own: a save killed (SIGKILL) at random points, a
file-size limit, a read-only directory, two runs locking one output directory at once.

Every fault runs in a child forked from the test process (``os.fork``: no new interpreter, no
re-import), a world of one gloo rank of its own with a small model; ``FNPPO_TEST_KILLS`` sets the
number of kills (4 by default), ``FNPPO_TEST_LOCK_RACES`` the lock races (10).
After every kill the next save's / resume's clean-up must leave only complete checkpoints, each
verified, and never lose one that was complete before the kill.
"""

from __future__ import annotations

import hashlib
import json
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


@pytest.mark.parametrize("limit", [512, 4096], ids=["torch.save-writer", "dcp-writer"])
def test_a_file_size_limit_is_named_as_such_whichever_writer_meets_it(tmp_path, limit):
    """``ulimit -f`` (RLIMIT_FSIZE) in a child. At 512 bytes ``common.pt`` meets it: torch's own writer
    (``torch.save``) loses the ``EFBIG`` and says only ``basic_ios::clear: iostream error`` (torch 2.13)
    or ``unexpected pos ...`` (torch 2.11); at 4096 bytes the rank's shard file meets it (an ``OSError``
    with ``EFBIG``). Either way the error names the file-size limit and "File too large", and nothing
    is left behind. (Python ignores SIGXFSZ from its start, so the write fails instead of the process.)"""
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN

    def small_file_limit(state) -> str:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        fnppo.checkpoint.save_checkpoint(tmp_path / "fsize", state)
        return "no error"

    code, msg = _in_child(small_file_limit)
    assert code == 1 and msg.startswith("CheckpointError: save_checkpoint: argument 'directory' expected "), msg
    assert f"reached the file-size limit (RLIMIT_FSIZE, `ulimit -f`): {limit} bytes" in msg, msg
    assert "File too large" in msg, msg
    if limit == 512:
        assert "common.pt reached the file-size limit" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "debris after the file-size limit"


def _fake_checkpoint(d: Path, marker: str, complete: bool = True) -> Path:
    """A directory shaped like a checkpoint: a marker file, and (``complete``) a manifest listing it."""
    d.mkdir(parents=True)
    (d / "marker").write_text(marker)
    if complete:
        entry = {"size": len(marker), "sha256": hashlib.sha256(marker.encode()).hexdigest()}
        (d / "manifest.json").write_text(json.dumps({"step": 4, "files": {"marker": entry}}))
    return d


@pytest.mark.parametrize("new_id", ["0123456789ab", "zyx987654321"])
@pytest.mark.parametrize("new_complete", [True, False], ids=["new-complete", "new-incomplete"])
def test_a_save_killed_between_its_renames_restores_the_right_checkpoint(tmp_path, new_id, new_complete):
    """A replacing save moves the previous ``step4`` aside (``.step4.tmp-old-<id>``) and then renames its
    own ``.step4.tmp-<id>`` into place; killed in between, both are left and ``step4`` is missing. The
    clean-up (at the next save or resume: ``latest_checkpoint``) keeps the new one when it is complete
    (it has its manifest) and puts the previous one back otherwise; the other is removed. The new one's
    id sorts before ``old-`` (save ids are hex) or after it: the order of the listing must not matter."""
    _fake_checkpoint(tmp_path / ".step4.tmp-old-5a5a5a5a5a5a", "previous")
    _fake_checkpoint(tmp_path / f".step4.tmp-{new_id}", "new", complete=new_complete)
    _fake_checkpoint(tmp_path / "step2", "older")
    latest = fnppo.checkpoint.latest_checkpoint(tmp_path)
    assert latest == tmp_path / "step4"
    assert (latest / "marker").read_text() == ("new" if new_complete else "previous")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step2", "step4"]
    assert (tmp_path / "step2" / "marker").read_text() == "older"  # a complete checkpoint is never touched


def test_a_live_save_s_temporary_directory_is_left_alone(tmp_path):
    """A temporary directory that a live save holds (its flock) is not removed or restored by the clean-up
    of another process; once released it is."""
    from fnppo.io.checkpoint.lock import hold_while_writing

    live = _fake_checkpoint(tmp_path / ".step6.tmp-abcdefabcdef", "writing", complete=False)
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the live save: holds its directory until told to stop
        with hold_while_writing(live):
            os.write(w, b"h")
            os.read(go_r, 1)
        os._exit(0)
    assert os.read(r, 1) == b"h"
    assert fnppo.checkpoint.remove_stale_saves(tmp_path) == [] and live.is_dir()
    os.write(go_w, b"g")
    os.waitpid(pid, 0)
    assert fnppo.checkpoint.remove_stale_saves(tmp_path) == [f"removed {live.name}"] and not live.exists()
    for fd in (r, w, go_r, go_w):
        os.close(fd)


def _good_manifest() -> dict:
    return {
        "format": "fnppo-checkpoint-2",
        "step": 4,
        "states": None,
        "layout": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "vpp": 0, "ep": 1, "etp": 1, "cp": 1},
        "lora_bases": {"": None},
        "files": {"marker": {"size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}},
    }


def _edit(**changes) -> bytes:
    return json.dumps({**_good_manifest(), **changes}).encode()


#: damaged manifests: case -> (the manifest.json bytes, what the refusal names)
DAMAGED_MANIFESTS = {
    "truncated": (json.dumps(_good_manifest()).encode()[:40], "which is not valid JSON (truncated or corrupt: "),
    "empty": (b"", "which is not valid JSON (an empty file)"),
    "not-utf8": (b'{"step": 4, "files": {"\xff": 1}}', "which is not valid JSON (not UTF-8 text"),
    "array": (b"[1, 2]", "holding a JSON array (an object is expected)"),
    "step-missing": (json.dumps({"files": {}}).encode(), "holding 'step' = None (an int >= 0 is expected)"),
    "step-str": (_edit(step="4"), "holding 'step' = '4' (an int >= 0 is expected)"),
    "step-bool": (_edit(step=True), "holding 'step' = True"),
    "step-negative": (_edit(step=-1), "holding 'step' = -1"),
    "files-array": (_edit(files=["marker"]), "holding 'files' holding a JSON array"),
    "file-entry-array": (_edit(files={"marker": [3]}), "files['marker'] holding a JSON array"),
    "file-size-str": (
        _edit(files={"marker": {"size": "3", "sha256": "0" * 64}}),
        "files['marker']['size'] = '3' (an int >= 0 is expected)",
    ),
    "file-sha-short": (
        _edit(files={"marker": {"size": 3, "sha256": "abc"}}),
        "files['marker']['sha256'] = 'abc' (64 hex digits are expected)",
    ),
    "file-outside": (
        _edit(files={"../marker": {"size": 3, "sha256": "0" * 64}}),
        "a file name '../marker' (a relative path inside the checkpoint is expected)",
    ),
    "states-str": (_edit(states="policy"), "'states' = 'policy' (null or a list of train-state names is expected)"),
    "layout-array": (_edit(layout=[1, 1]), "'layout' = [1, 1] (an object of parallel sizes is expected)"),
    "layout-str-size": (_edit(layout={"tp": "2"}), "'layout' = {'tp': '2'}"),
    "lora-bases-array": (_edit(lora_bases=[]), "'lora_bases' holding a JSON array"),
    "lora-base-str": (_edit(lora_bases={"": "llama"}), "lora_bases[''] holding a JSON string"),
    "lora-base-tensors": (
        _edit(lora_bases={"": {"arch": None, "dtype": "float32", "tensors": {"w": "abc"}}}),
        "lora_bases['']['tensors'] not an object of digest pairs",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGED_MANIFESTS))
def test_a_damaged_manifest_is_refused_by_name(tmp_path, case):
    """A manifest that is truncated, empty, not UTF-8, not JSON or not shaped as ``save_checkpoint``
    writes it: ``verify_checkpoint`` (and so ``load_checkpoint``, ``read_checkpoint``) and
    ``latest_checkpoint`` raise ``CheckpointError`` naming the file and the first wrong key, never a
    raw ``JSONDecodeError`` / ``AttributeError`` / ``TypeError``; the well-formed manifest verifies."""
    data, needle = DAMAGED_MANIFESTS[case]
    good = tmp_path / "good"
    good.mkdir()
    (good / "marker").write_bytes(b"abc")
    (good / "manifest.json").write_bytes(json.dumps(_good_manifest()).encode())
    assert fnppo.checkpoint.verify_checkpoint(good)["step"] == 4
    d = tmp_path / "runs" / "step4"
    shutil.copytree(good, d)
    (d / "manifest.json").write_bytes(data)
    with pytest.raises(fnppo.checkpoint.CheckpointError) as err:
        fnppo.checkpoint.verify_checkpoint(d)
    msg = str(err.value)
    assert msg.startswith("verify_checkpoint: argument 'directory' expected a manifest.json "), msg
    assert f"received '{d / 'manifest.json'}'" in msg and needle in msg, msg
    if case not in ("truncated", "empty", "not-utf8", "array", "step-missing", "step-str", "step-bool"):
        # a readable step: the newest checkpoint, refused by latest_checkpoint too (unless fallback)
        (tmp_path / "runs" / "step4" / "manifest.json").write_bytes(data)
        with pytest.raises(fnppo.checkpoint.CheckpointError, match=r"^latest_checkpoint: argument 'root' "):
            fnppo.checkpoint.latest_checkpoint(tmp_path / "runs")
