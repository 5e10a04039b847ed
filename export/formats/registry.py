"""Every checkpoint format lowbit writes and reads, by name. A new format is one file (or folder)
in export/formats with an ExportFormat subclass, and one line here."""
from __future__ import annotations

import json
from pathlib import Path

from .base import ExportFormat
from .compressed_tensors import CompressedTensorsFormat
from .dense import DenseFormat
from .gguf import GGUFFormat
from .gptq import GPTQFormat
from .hf_folder import CONFIG, safetensors_bytes

FORMATS: dict[str, ExportFormat] = {f.name: f for f in (
    CompressedTensorsFormat(),
    GPTQFormat(),
    DenseFormat(),
    GGUFFormat(),
)}


def format_of(config: dict) -> ExportFormat | None:
    """The registered format a checkpoint with this config.json is in, or None."""
    return next((f for f in FORMATS.values() if f.detects(config)), None)


def format_of_folder(folder: str | Path) -> ExportFormat | None:
    path = Path(folder) / CONFIG
    if not path.is_file():
        return None
    return format_of(json.loads(path.read_text(encoding="utf-8")))


def checkpoint_weight_bytes(folder: str | Path) -> int:
    """Weight bytes of a written checkpoint, as its format counts them (a folder of safetensors
    files in no registered format: every tensor in them)."""
    fmt = format_of_folder(folder)
    return fmt.weight_bytes(Path(folder)) if fmt is not None else safetensors_bytes(folder)
