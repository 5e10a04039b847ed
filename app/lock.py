"""One run per output folder: an fcntl lock on `.NAME.lock` beside it, holding the owner's pid.

The operating system releases the lock when its process ends, however it ends (a SIGKILL
included), so a stale file never blocks a later run.
"""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from lowbit.export.staging import make_parent
from lowbit.export.files import os_error


class OutputInUseError(OSError):
    """Another live process is writing the same output folder."""


def lock_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.lock")


@contextmanager
def output_lock(output: Path):
    """Hold the output's lock for the block; refuse at once, naming the holder's pid, if it is taken."""
    make_parent(output)
    path = lock_path(output)
    fd = _acquire(path, output)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # before unlocking: a run that opened this file re-checks it
        os.close(fd)


def _acquire(path: Path, output: Path) -> int:
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:  # the folder refuses new files (/proc, a read-only mount): say so for the output
            raise os_error(err, f"cannot create files in {path.parent} for output {output} ({err.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputInUseError(
                f"output {output} is being written by another lowbit run (pid {holder}); wait for it "
                "to finish or choose another --output") from None
        if _still_at(path, fd):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)  # the previous holder removed the file between our open and lock: retry


def _still_at(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
