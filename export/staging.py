"""Publishing a checkpoint folder whole or not at all: it is written into a hidden staging folder
beside its place, the manifest goes in last, and the folder is renamed into place (replacing only a
folder lowbit wrote there)."""
from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable

from .files import os_error, out_of_space_names
from .manifest import write_manifest
from .output_folder import check_not_a_link, check_output_dir, check_replaceable


def write_staged(out_dir: str | Path, overwrite: bool, extra_files: dict[str, str] | None,
                 write: Callable[[Path], None]) -> Path:
    """write(staging) fills a hidden folder beside out_dir; the manifest goes in last and the folder
    is renamed into place, so a folder at out_dir is always whole."""
    out_dir = Path(out_dir)
    for name in extra_files or {}:
        check_plain_name(name, "extra file name")
    check_output_dir(out_dir, overwrite)
    make_parent(out_dir)
    staging = out_dir.with_name(f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        with out_of_space_names(out_dir, "cannot write the checkpoint"):
            write(staging)
            write_manifest(staging)
        publish(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def make_parent(out_dir: Path) -> None:
    """Create the folder that will hold out_dir, or say clearly why it cannot be."""
    parent = out_dir.parent if out_dir.parent != Path("") else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file where a folder should be, a read-only or full disk
        raise os_error(err, f"cannot create the folder {parent} for output {out_dir} ({err.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"cannot create files in {parent} for output {out_dir} (permission denied)")


def check_plain_name(name: str, what: str) -> None:
    """A name used as one file or folder name: it may not climb out of (or hide in) its folder."""
    rules = [
        (lambda n: isinstance(n, str) and n, "must be a non-empty string"),
        (lambda n: "/" not in n and "\\" not in n, "may not contain / or \\"),
        (lambda n: not n.startswith("."), "may not start with '.' (., .., hidden and staging names)"),
        (lambda n: all(ord(c) >= 32 for c in n), "may not contain control characters"),
        (lambda n: len(n.encode()) <= 200, "may not be longer than 200 bytes"),
    ]
    for ok, problem in rules:
        if not ok(name):
            raise ValueError(f"{what} {name!r} {problem}: it becomes a file or folder name")


def publish(staging: Path, out_dir: Path) -> None:
    """Rename a finished folder to out_dir; a folder lowbit wrote there is replaced (moved aside
    first), checked again here: files may have appeared in it since the command began, or a link
    been made there, which is the user's and never renamed."""
    check_not_a_link(out_dir)
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()  # an empty folder made for the output
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    check_replaceable(out_dir)
    old = out_dir.with_name(f".{out_dir.name}.old-{int(time.time())}")  # --overwrite: move it aside
    out_dir.rename(old)
    try:
        staging.rename(out_dir)
    except BaseException:
        old.rename(out_dir)  # the previous checkpoint goes back where it was
        raise
    shutil.rmtree(old, ignore_errors=True)
