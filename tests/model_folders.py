"""Tiny model folders on disk (random llama + the smollm2 tokenizer), whole or damaged on purpose."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tiny_models import save_tiny_llama


def save_tiny_folder(folder: Path) -> Path:
    """A 2-layer random llama with the smollm2 tokenizer (same vocabulary), as safetensors."""
    return save_tiny_llama(folder)


def copy_folder(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def to_pickle_weights(folder: Path, extra: dict | None = None) -> Path:
    """Replace model.safetensors by a pickle-based pytorch_model.bin (plus any extra objects)."""
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    torch.save({**state, **(extra or {})}, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


def looks_like_checkpoint(path: Path) -> bool:
    """What a user (or vLLM) would take for a whole model folder."""
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def leftovers(parent: Path, name: str) -> list[str]:
    """The output folder or any staging / backup folder a failed export might have left beside it."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))
