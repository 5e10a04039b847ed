"""Write a quantized model as a checkpoint, atomically, and read it back into runtime modules."""
from __future__ import annotations

import warnings
from pathlib import Path

from torch import nn

from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.layer_source import MemoryLayers

from .config import ExportConfig
from .formats.gguf import GGUF_FILE
from .formats.hf_folder import CONFIG, INDEX, WEIGHTS
from .manifest import MANIFEST
from .portions import save_in_portions
from .reader import load, read_tensors  # noqa: F401  (re-exported: checkpoint.load)


def save(model: nn.Module, tokenizer, out_dir: str | Path, cfg: ExportConfig,
         extra_files: dict[str, str] | None = None, overwrite: bool = False) -> Path:
    """Write the checkpoint into a staging folder beside out_dir, then rename it into place.

    The manifest is written last into the staging folder, so a folder at out_dir is always
    whole; a crash leaves at most a hidden `.NAME.partial-*` folder. overwrite: replace a folder
    lowbit wrote there (output_folder.py), never another. Written as a run writes it
    (portions.py), the whole model in one portion.
    """
    with warnings.catch_warnings():  # a guessed layout warns of quantization targets: the export needs only
        warnings.simplefilter("ignore")  # where the decoder layers are
        arch = arch_for(model)
    return save_in_portions(model, tokenizer, out_dir, cfg, arch, MemoryLayers(model, arch), extra_files,
                            overwrite=overwrite)


def is_checkpoint(folder: Path) -> bool:
    """A published lowbit export (manifest present), any safetensors model folder, or lowbit's GGUF folder."""
    folder = Path(folder)
    has_weights = any((folder / name).is_file() for name in (WEIGHTS, INDEX, GGUF_FILE))
    return (folder / CONFIG).is_file() and has_weights


def is_lowbit_export(folder: Path) -> bool:
    return is_checkpoint(folder) and (Path(folder) / MANIFEST).is_file()
