"""Where lowbit keeps what it derives once: built-in models, corpora, baseline figures."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    root = Path(os.environ.get("LOWBIT_CACHE", Path.home() / ".cache" / "lowbit"))
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
