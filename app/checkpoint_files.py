"""What a checkpoint's files say before any module is built: whether they are the files lowbit
wrote (manifest.json's sizes and sha256), and whether config.json's quantization settings agree
with the quantized tensors (read from the safetensors headers)."""
from __future__ import annotations

import json
from pathlib import Path

from lowbit.export.formats.hf_folder import CONFIG
from lowbit.export.formats.registry import format_of
from lowbit.export.manifest import MANIFEST, verify_manifest

RECIPE_FILE = "recipe.yaml"
FOREIGN = "not checked: no manifest.json (a checkpoint from another tool)"


def read_config(folder: Path) -> dict:
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def file_integrity(folder: Path) -> tuple[str, list[str]]:
    """(what the report says of the files, problems): every file against manifest.json; a lowbit
    checkpoint (recipe.yaml) without one is a problem, another tool's checkpoint is not."""
    manifest = folder / MANIFEST
    if manifest.is_file():
        try:
            problems = verify_manifest(folder)
        except (ValueError, KeyError, TypeError, AttributeError) as err:  # a damaged manifest.json
            problems = [f"{manifest}: unreadable ({type(err).__name__}: {err})"]
        if problems:
            return f"FAILED: {len(problems)} file(s) differ from {MANIFEST}", problems
        return f"every file matches {MANIFEST} (size and sha256)", []
    if (folder / RECIPE_FILE).is_file():
        return "not checked", [f"{manifest}: missing; a lowbit checkpoint (it has {RECIPE_FILE}) lists every "
                               "file's size and sha256 there, so damaged or swapped files would go unseen"]
    return FOREIGN, []


def config_disagreements(folder: Path, config: dict) -> list[str]:
    """Each quantized tensor whose shape (packed width, scales, zero point) config.json's
    quantization settings contradict, naming the tensor and the key."""
    fmt = format_of(config)
    if fmt is None or not config.get("quantization_config"):
        return []
    return fmt.config_problems(config, folder)
