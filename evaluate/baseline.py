"""Baseline (unquantized) figures, cached per model and protocol so repeated runs skip them."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Callable

from lowbit.calibrate.cache import cache_dir
from lowbit.calibrate.models import BUILTIN_MODELS

CACHE_VERSION = 1  # bump when the way a baseline is measured changes


def model_fingerprint(model_name: str) -> str:
    """Name plus, for local folders, the weight files' sizes and mtimes (a changed model misses)."""
    folder = Path(model_name)
    if model_name in BUILTIN_MODELS or not folder.is_dir():
        return model_name
    weights = [p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")]  # .bin: --allow-pickle
    stats = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in weights)
    return f"{folder.resolve()}|{stats}"


def cached_baseline(model_name: str, protocol, measure: Callable[[], dict]) -> dict:
    key_src = json.dumps([CACHE_VERSION, model_fingerprint(model_name), dataclasses.asdict(protocol)])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    path = cache_dir("baselines") / f"{key}.json"
    if path.exists():
        return {**json.loads(path.read_text()), "cached": True}
    result = measure()
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return {**result, "cached": False}
