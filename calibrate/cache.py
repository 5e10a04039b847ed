"""Where lowbit keeps what it derives once: built-in models, corpora, baseline figures."""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    root = Path(os.environ.get("LOWBIT_CACHE", Path.home() / ".cache" / "lowbit"))
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


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
