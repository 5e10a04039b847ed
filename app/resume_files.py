"""The resume folder proves itself: every data file a run keeps there is recorded (size and sha256)
when written, in the JSON record that names it, and each JSON record carries the sha256 of its own
content. --resume checks them all before it uses any (check_folder), so a file that a kill
cut short, a full disk, a user's edit or a flipped bit changed is never read as finished work: what
it held is computed again from the last layer that proves itself, and a record that cannot be
trusted at all (state.json: which run this was) is refused in one line naming it."""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Optional

from lowbit.export.checkpoint import is_lowbit_export
from lowbit.export.manifest import MANIFEST, sha256_of, write_text_atomic

STATE = "state.json"
EXPORTED = "exported.json"
CHECKPOINT = "checkpoint"
PROGRESS = "progress.json"
CHECKPOINT_FILES = "checkpoint_files"  # exported.json: the checkpoint's files as its export wrote them
# files the results stage writes into the checkpoint again (a kill there may leave them half changed)
REWRITTEN = frozenset({"results.json", "recipe.yaml", "report.html", "report.md", "README.md"})
SEAL = "sha256"  # the key holding the sha256 of a record's own content


class DamagedRecord(ValueError):
    """A JSON record of the resume folder that is not as lowbit wrote it."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def file_record(path: Path) -> dict:
    """What proves `path` later: its size and sha256, taken right after it was written (as manifest.json's)."""
    return {"bytes": path.stat().st_size, SEAL: sha256_of(path)}


def file_differs(path: Path, record: Optional[dict]) -> str:
    """Why `path` is not the file `record` describes, in words ('' when it is)."""
    if record is None:
        return "not recorded when it was written"
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"{size} bytes where {record['bytes']} were written"
    if sha256_of(path) != record[SEAL]:
        return "its content changed since it was written (sha256 differs)"
    return ""


def _content_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_sealed(path: Path, body: dict) -> None:
    """`body` as JSON with the sha256 of its content beside it, written atomically."""
    write_text_atomic(path, json.dumps({**body, SEAL: _content_digest(body)}, indent=1))


def read_sealed(path: Path) -> dict:
    """A record written by write_sealed; DamagedRecord naming the file when it is not as written."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DamagedRecord(path, f"not the JSON lowbit wrote ({err})") from None
    if not isinstance(saved, dict) or SEAL not in saved:
        raise DamagedRecord(path, "not a record lowbit wrote (no sha256 of its content)")
    body = {k: v for k, v in saved.items() if k != SEAL}
    if _content_digest(body) != saved[SEAL]:
        raise DamagedRecord(path, "its content changed since it was written (sha256 differs)")
    return body


def read_sealed_or_none(path: Path) -> Optional[dict]:
    """The record, or None where it is absent or damaged (for summaries that must not fail)."""
    try:
        return read_sealed(path) if path.is_file() else None
    except (OSError, DamagedRecord):
        return None


def note(line: str) -> None:
    print(f"[lowbit] {line}", file=sys.stderr)


LOST = "lost"  # progress "outputs": the last finished layer's outputs were needed and did not prove themselves


def layer_file_name(index: int) -> str:
    return f"layer{index}.safetensors"


def outputs_file_name(index: int) -> str:
    return f"hidden{index}.safetensors"


def empty_progress() -> dict:
    # outputs: the file holding the last finished layer's outputs (what the next layer reads), None
    # where the walk did not compute them (nothing reads them), LOST where they must be computed again
    return {"finished": 0, "results": [], "files": {}, "outputs": None}


def check_step_folder(folder: Path) -> None:
    """Leave `folder`'s progress.json naming only layers whose files prove themselves: from the first
    that does not, the step computes its layers again; outputs that do not prove themselves are
    computed again from the restored layers. Each repair is said in one line naming the file."""
    path = folder / PROGRESS
    if not path.is_file():
        return
    try:
        saved = read_sealed(path)
    except DamagedRecord as err:
        note(f"{err}; {folder.name} computes its layers again (they cannot be proved without it)")
        path.unlink()
        return
    for index in range(saved["finished"]):
        name = layer_file_name(index)
        why = file_differs(folder / name, saved["files"].get(name))
        if why:
            note(f"{folder / name}: {why}; {folder.name} computes its layers again from layer {index}")
            write_sealed(path, _truncated(folder, saved, index))
            return
    outputs = saved["outputs"]
    why = file_differs(folder / outputs, saved["files"].get(outputs)) if outputs not in (None, LOST) else ""
    if why:
        note(f"{folder / outputs}: {why}; the outputs of {folder.name}'s finished layers are computed again "
             "from their saved state")
        write_sealed(path, _truncated(folder, saved, saved["finished"]))


def _truncated(folder: Path, saved: dict, finished: int) -> dict:
    """`saved` cut to its first `finished` layers, the outputs lost; files no longer recorded deleted."""
    kept = {layer_file_name(i) for i in range(finished)}
    for name in set(saved["files"]) - kept:
        (folder / name).unlink(missing_ok=True)
    return {"finished": finished, "results": saved["results"][:finished],
            "files": {n: r for n, r in saved["files"].items() if n in kept},
            "outputs": LOST if finished else None}


def kept_in(folder: Path) -> str:
    """What a failed run left in its resume folder that --resume uses, in words ('' for nothing)."""
    if (folder / EXPORTED).is_file() and is_lowbit_export(folder / CHECKPOINT):
        return "the exported checkpoint (--resume evaluates it without recalibrating)"
    if not (folder / STATE).is_file():
        return ""
    finished = finished_layers(folder)
    damaged = [p.parent.name for p in sorted(folder.glob(f"step*/{PROGRESS}")) if read_sealed_or_none(p) is None]
    kept = [f"{finished} finished layers (--resume continues after them)"] if finished else []
    if damaged:  # never started over without --resume: what they hold is checked there
        kept.append(f"the damaged progress records of {', '.join(damaged)} (--resume checks their layers)")
    return "; ".join(kept)


def finished_layers(folder: Path) -> int:
    """Layers finished by every step together, as their records say (a damaged record: none)."""
    saved = (read_sealed_or_none(p) for p in folder.glob(f"step*/{PROGRESS}"))
    return sum(s["finished"] for s in saved if s)


def check_folder(folder: Path) -> None:
    """Every record and file of the resume folder checked before any is used (resume_files.py): an
    exported checkpoint that does not prove itself is exported again, a step's layers from the first
    that does not prove itself are computed again; stale scratch activations go."""
    shutil.rmtree(folder / "activations", ignore_errors=True)  # a walk's scratch, never resumed from
    for step in sorted(folder.glob("step*/")):
        check_step_folder(step)
    why = _export_differs(folder)
    if why:
        note(f"{why}; the checkpoint is exported again from the finished layers")
        (folder / EXPORTED).unlink()


def _export_differs(folder: Path) -> str:
    """Why the exported checkpoint cannot be used as it is ('' when it can, or there is none)."""
    if not (folder / EXPORTED).is_file():
        return ""
    try:
        files = read_sealed(folder / EXPORTED)[CHECKPOINT_FILES]
    except DamagedRecord as err:
        return str(err)
    for name, record in files.items():
        why = file_differs(folder / CHECKPOINT / name, record)
        if why:
            return f"{folder / CHECKPOINT / name}: {why}"
    if not (folder / CHECKPOINT / MANIFEST).is_file():  # rewritten whole by the results stage, but needed there
        return f"{folder / CHECKPOINT / MANIFEST}: missing"
    return ""
