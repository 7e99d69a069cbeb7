"""Operating-system locks for checkpoint directories, and the removal of what a dead save left behind.

* :func:`lock_directory`: one run per output directory. An exclusive ``fcntl.flock`` on
  ``<root>/.fnppo.lock``, held by the returned :class:`DirectoryLock` until it is released, closed,
  garbage-collected or the process ends in any way (the kernel drops the lock of a killed process:
  no stale lock file to delete by hand). A second run locking the same directory is refused at once,
  naming the process that holds it.
* A save holds an exclusive ``flock`` on its own temporary directory ``.<name>.tmp-<id>`` while it
  writes (:func:`hold_while_writing`). A temporary directory nobody holds belongs to a save that died
  (killed, out of disk, ...): :func:`remove_stale_saves` removes it at the next save and at resume,
  and never touches a complete checkpoint. A save killed between moving the previous checkpoint aside
  and renaming the new one into place leaves both complete: the new one (it has its manifest) is
  renamed into place, else the previous one is put back.

Linux/POSIX only (``fcntl``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from fnppo.io.checkpoint.manifest import MANIFEST, TMP_MARK, checkpoint_error

__all__ = ["LOCK_FILE", "DirectoryLock", "lock_directory", "hold_while_writing", "remove_stale_saves"]

LOCK_FILE = ".fnppo.lock"
OLD_MARK = f"{TMP_MARK}old-"  # ".<name>.tmp-old-<id>": the previous checkpoint, moved aside during a replace


class DirectoryLock:
    """An exclusive OS lock on a run's output directory (from :func:`lock_directory`).

    Held until :meth:`release` (also on ``with`` exit, garbage collection and any process exit).
    """

    def __init__(self, root: Path, fd: int) -> None:
        self.root, self._fd = root, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"DirectoryLock({str(self.root)!r}, held={self.held})"


def lock_directory(root: str | os.PathLike) -> DirectoryLock:
    """Lock ``root`` (created if missing) for this process: one run per output directory.

    Call it once at the start of a run (on the rank that writes, or every rank of one node) and keep
    the returned object for the run's life (``with lock_directory(out): ...``). Non-blocking: a
    directory another process holds is refused at once.

    Raises:
        CheckpointError: ``root`` is locked by another run (``lock_directory: argument 'root' expected a
            directory no other run is using, received '<root>', locked by process <pid> ...``) or is
            not a usable directory.
    """
    if not isinstance(root, (str, os.PathLike)):
        raise checkpoint_error("lock_directory", "root", "a path (str or os.PathLike)", f"{root!r}")
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise checkpoint_error(
            "lock_directory", "root", "a directory that can be created and written to", f"{str(path)!r} ({err})"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = ""
        with contextlib.suppress(OSError, ValueError):
            holder = os.pread(fd, 64, 0).decode().strip()
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise checkpoint_error("lock_directory", "root", "a lockable directory", f"{str(path)!r} ({err})") from None
        raise checkpoint_error(
            "lock_directory",
            "root",
            "a directory no other run is using",
            f"{str(path)!r}, locked by process {holder or '(unknown)'} (another run writes there; "
            "wait for it to end or choose another directory)",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return DirectoryLock(path, fd)


@contextlib.contextmanager
def hold_while_writing(tmp: Path) -> Iterator[None]:
    """Hold an exclusive flock on the (just created) temporary directory ``tmp`` for the ``with`` body."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _unheld(d: Path) -> bool:
    """Whether no live save holds ``d`` (its flock can be taken right now)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _final_name(d: Path) -> str:
    """``step4`` for ``.step4.tmp-<id>`` and ``.step4.tmp-old-<id>``."""
    return d.name[1:].split(TMP_MARK, 1)[0]


def remove_stale_saves(parent: str | os.PathLike) -> list[str]:
    """Remove the temporary directories of dead saves under ``parent``; returns what was done.

    Only ``.<name>.tmp-<id>`` directories that no live save holds are touched; complete checkpoints
    never. When ``<name>`` itself is missing (the save died between its two renames), a temporary
    directory with its manifest is renamed into place, else the previous checkpoint moved aside is put
    back. Safe to call from several processes at once.
    """
    parent = Path(parent)
    if not parent.is_dir():
        return []
    done: list[str] = []
    stale = [d for d in sorted(parent.iterdir()) if d.name.startswith(".") and TMP_MARK in d.name and d.is_dir()]
    # new (complete) saves first, then the previous checkpoints moved aside
    for d in sorted(stale, key=lambda d: OLD_MARK in d.name):
        if not _unheld(d):
            continue
        final = parent / _final_name(d)
        complete = (d / MANIFEST).is_file()
        with contextlib.suppress(OSError):
            if complete and not final.exists():
                os.rename(d, final)
                done.append(f"restored {final.name} from {d.name}")
                continue
            shutil.rmtree(d)
            done.append(f"removed {d.name}")
    return done
