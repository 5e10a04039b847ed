"""manifest.json: every file of a checkpoint with its size and sha256, to detect partial copies."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .files import out_of_space_names

MANIFEST = "manifest.json"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> dict:
    """(Re)write folder/manifest.json for every file in the folder except itself, atomically."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST
                   and not p.name.startswith("."))
    manifest = {"files": {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
                          for p in files}}
    write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def verify_manifest(folder: Path) -> list[str]:
    """Problems found (missing, resized or altered files); empty when the folder matches."""
    path = folder / MANIFEST
    if not path.is_file():
        return [f"{path} is missing"]
    problems = []
    for name, entry in json.loads(path.read_text(encoding="utf-8"))["files"].items():
        file = folder / name
        if not file.is_file():
            problems.append(f"{file}: listed in {MANIFEST} but missing")
        elif file.stat().st_size != entry["bytes"] or sha256_of(file) != entry["sha256"]:
            problems.append(f"{file}: differs from {MANIFEST} (size or sha256)")
    return problems


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a hidden temporary file beside `path`, fsync, then rename over it; a failed write
    leaves no temporary file, and a full disk or a file-size limit is reported naming `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with out_of_space_names(path), open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
