"""Write a quantized model as a checkpoint, atomically, and read it back into runtime modules."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from .config import ExportConfig
from .formats.gguf import GGUF_FILE
from .formats.hf_folder import CONFIG, INDEX, WEIGHTS
from .formats.registry import FORMATS
from .manifest import MANIFEST
from .staging import write_staged
from .reader import load, read_tensors  # noqa: F401  (re-exported: checkpoint.load)


def save(model: nn.Module, tokenizer, out_dir: str | Path, cfg: ExportConfig,
         extra_files: dict[str, str] | None = None, overwrite: bool = False) -> Path:
    """Write the checkpoint into a staging folder beside out_dir, then rename it into place.

    The manifest is written last into the staging folder, so a folder at out_dir is always
    whole; a crash leaves at most a hidden `.NAME.partial-*` folder. overwrite: replace a folder
    lowbit wrote there (output_folder.py), never another. What a run's export (portions.py) does
    with a model in memory, without its audit and without asking where the decoder layers are
    (`lowbit export` reads checkpoints of architectures outside lowbit's table too).
    """
    return write_staged(out_dir, overwrite, extra_files,
                        lambda staging: FORMATS[cfg.format].write(model, tokenizer, staging, cfg, extra_files or {}))


def is_checkpoint(folder: Path) -> bool:
    """A published lowbit export (manifest present), any safetensors model folder, or lowbit's GGUF folder."""
    folder = Path(folder)
    has_weights = any((folder / name).is_file() for name in (WEIGHTS, INDEX, GGUF_FILE))
    return (folder / CONFIG).is_file() and has_weights


def is_lowbit_export(folder: Path) -> bool:
    return is_checkpoint(folder) and (Path(folder) / MANIFEST).is_file()
