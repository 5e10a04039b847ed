"""Which folders lowbit may write or replace: never one it did not write, never a source's.

A non-empty output is replaced only with `overwrite` (a command-line decision) and only when it is
a lowbit output: its manifest.json lists every file in it. A folder without one, or holding a
file its manifest does not list (the user's notes, a .git folder), is refused before any work,
and again just before it would be replaced. An output that is, lies inside or contains the model
or checkpoint a command reads is refused too: replacing it would delete the source.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

from .manifest import MANIFEST

NAME_BYTES = 255 - len(".") - len(".partial-12345678")  # the longest hidden sibling lowbit writes
LISTED = 3  # unlisted files named in a refusal


class OutputError(FileExistsError):
    """An output folder lowbit will not write or replace; the message names the user's input."""


def check_output_dir(out_dir: Path, overwrite: bool, flag: str = "--output", shown: Optional[str] = None) -> None:
    """Refuse, naming `flag` and the user's `shown` text, an output lowbit may not write or replace."""
    out_dir, shown = Path(out_dir), shown or str(out_dir)
    check_output_name(out_dir, flag, shown)
    check_not_a_link(out_dir, flag, shown)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{flag} {shown} exists and is not a folder; choose another {flag}")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise OutputError(f"output folder {shown} is not empty; choose another {flag} or pass --overwrite "
                          "(which replaces only a folder lowbit wrote)")
    check_replaceable(out_dir, flag, shown)


def check_output_name(out_dir: Path, flag: str, shown: str) -> None:
    """A name that can be a folder beside which lowbit writes its hidden `.NAME.*` siblings."""
    name = Path(os.path.abspath(out_dir)).name
    if shown.rstrip("/") in (".", "..") or not name:
        raise OutputError(f"{flag} {shown} is not a new folder's name (it is the current folder, its parent or "
                          f"the root); give a folder name, e.g. {flag} runs/my-model")
    if len(name.encode()) > NAME_BYTES:
        raise OutputError(f"{flag}: the folder name is {len(name.encode())} bytes; lowbit writes hidden folders "
                          f"beside it named .NAME.partial-…, so it may be at most {NAME_BYTES} bytes")


def check_not_a_link(out_dir: Path, flag: str = "--output", shown: Optional[str] = None) -> None:
    """Refuse an output that is a symbolic link, dangling or not. The link is the user's: lowbit
    publishes by renaming a finished folder into the output's place (moving a previous one aside),
    which would replace or move the link itself, never write into the folder it points to."""
    if out_dir.is_symlink():
        real = os.path.realpath(out_dir)
        raise OutputError(f"{flag} {shown or out_dir} is a symbolic link (to {real}); lowbit writes its output by "
                          f"renaming a finished folder into place, which would replace the link, not fill the "
                          f"folder it points to: pass the real folder's path, {flag} {real}")


def check_replaceable(out_dir: Path, flag: str = "--output", shown: Optional[str] = None) -> None:
    """A non-empty folder may be replaced only when its manifest.json lists every file in it."""
    shown = shown or str(out_dir)
    listed = _manifest_files(out_dir)
    if listed is None:
        raise OutputError(f"{flag} {shown} is not a lowbit output (it has no manifest.json of lowbit's), so "
                          "--overwrite will not replace it; delete it yourself or choose another folder")
    unlisted = [p.relative_to(out_dir).as_posix() for p in sorted(out_dir.rglob("*"))
                if not p.is_dir() and p.relative_to(out_dir).as_posix() not in listed | {MANIFEST}]
    if unlisted:
        more = f" and {len(unlisted) - LISTED} more" if len(unlisted) > LISTED else ""
        raise OutputError(f"{flag} {shown} holds files lowbit did not write ({', '.join(unlisted[:LISTED])}{more}), "
                          "so --overwrite will not replace it; move them out or delete the folder yourself")


def _manifest_files(folder: Path) -> Optional[set[str]]:
    """The file names folder/manifest.json lists, or None when it has no readable lowbit manifest."""
    try:
        files = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(files) if isinstance(files, dict) else None


def check_apart(out_dir: Path, sources: Iterable[tuple[str, Path]], flag: str = "--output",
                shown: Optional[str] = None) -> None:
    """Refuse an output equal to, inside or containing a source folder (what=label, path)."""
    out, shown = Path(out_dir).resolve(), shown or str(out_dir)
    for what, source in sources:
        src = Path(source).resolve()
        if out == src:
            relation = "is"
        elif src in out.parents:
            relation = "lies inside"
        elif out in src.parents:
            relation = "contains"
        else:
            continue
        raise OutputError(f"{flag} {shown} {relation} the {what} {source}; writing there could replace the "
                          f"{what}: choose a folder apart from it")
