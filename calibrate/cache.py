"""Where lowbit keeps what it derives once: built-in models, corpora, baseline figures."""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


VARIABLE = "LOWBIT_CACHE"


class CacheError(OSError):
    """The cache folder cannot be made or written; the message names LOWBIT_CACHE and the path."""


def cache_root() -> Path:
    return Path(os.environ.get(VARIABLE, Path.home() / ".cache" / "lowbit"))


def check_cache() -> Path:
    """The cache folder, made if need be: checked when a command that uses it starts, so an unusable
    LOWBIT_CACHE is refused in one line before the work (a run's corpus is read only at evaluation)."""
    root = cache_dir()
    if not os.access(root, os.W_OK | os.X_OK):
        raise CacheError(f"{_unusable(root)}: it is not writable (permission denied); {_advice()}")
    return root


def cache_dir(*parts: str) -> Path:
    path = cache_root().joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file where a folder should be, /dev/null/x, a read-only disk
        blocker = _first_existing(path)
        why = (f"{blocker} is not a folder" if not blocker.is_dir()
               else f"{path} cannot be made in {blocker} ({err.strerror})")
        raise CacheError(f"{_unusable(cache_root())}: {why}; {_advice()}") from None
    return path


def _unusable(root: Path) -> str:
    if VARIABLE in os.environ:
        return f"{VARIABLE}={root} cannot be used as lowbit's cache folder"
    return f"lowbit's cache folder {root} (the default; {VARIABLE} is not set) cannot be used"


def _advice() -> str:
    unset = " or unset it (default ~/.cache/lowbit)" if VARIABLE in os.environ else ""
    return f"set {VARIABLE} to a writable folder{unset}"


def _first_existing(path: Path) -> Path:
    """The nearest of path and its parents that exists: what stood in the way of making it."""
    return next(p for p in (path, *path.parents) if p.exists())


@contextmanager
def exclusive(path: Path):
    """Hold an exclusive fcntl lock on `path` for the block, waiting for another holder to finish.
    The operating system releases it when its process ends, however it ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
