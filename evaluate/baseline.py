"""Baseline (unquantized) figures, cached per model and protocol so repeated runs skip them.

The key holds everything that can change the figure: the protocol, the versions of lowbit,
torch and transformers, and the model's weight and config files by content (sha256), so a
cached figure never outlives the code or the weights it was measured with."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable, Optional

from lowbit.calibrate.cache import cache_dir
from lowbit.calibrate.models import BUILTIN_MODELS, materialize_builtin
from lowbit.export.manifest import write_text_atomic

CACHE_VERSION = 2  # bump when the way a baseline is measured changes
FINGERPRINTED = (".safetensors", ".bin", ".json", ".gguf")  # weights, config, tokenizer


def code_versions() -> dict:
    out = {}
    for package in ("lowbit", "torch", "transformers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out


def file_sha256(path: Path) -> str:
    """A file's sha256, memoized under the cache by (path, size, mtime): a 70B model is hashed
    once, not at every run, and a rewritten file is hashed again."""
    st = path.stat()
    memo_key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    memo = cache_dir("hashes") / memo_key
    if memo.exists():
        return memo.read_text()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    write_text_atomic(memo, digest.hexdigest())
    return digest.hexdigest()


def model_fingerprint(model_name: str) -> str:
    """Name plus, for local folders (built-in models are one), each weight, config and tokenizer
    file's sha256; a hub id stands for itself."""
    folder = materialize_builtin(BUILTIN_MODELS[model_name]) if model_name in BUILTIN_MODELS else Path(model_name)
    if not folder.is_dir():
        return model_name
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in FINGERPRINTED)
    return json.dumps([model_name, [(p.name, file_sha256(p)) for p in files]])


DEFAULT_PLACEMENT = {"device": "cpu", "dtype": "float32"}  # left out of keys: caches from before stay valid


def cache_key(model_name: str, protocol, placement: Optional[dict] = None) -> str:
    """`placement` (device and dtype the figure was measured in, placement.describe()) joins the
    key unless it is the CPU in float32: a bfloat16 GPU baseline is a different figure."""
    where = [] if placement in (None, DEFAULT_PLACEMENT) else [placement]
    key_src = json.dumps([CACHE_VERSION, code_versions(), model_fingerprint(model_name),
                          type(protocol).__name__, dataclasses.asdict(protocol), *where])
    return hashlib.sha256(key_src.encode()).hexdigest()[:16]


def cached_baseline(model_name: str, protocol, measure: Callable[[], dict], placement: Optional[dict] = None) -> dict:
    path = cache_dir("baselines") / f"{cache_key(model_name, protocol, placement)}.json"
    if path.exists():
        return {**json.loads(path.read_text()), "cached": True}
    result = measure()
    write_text_atomic(path, json.dumps(result))
    return {**result, "cached": False}
