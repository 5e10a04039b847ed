"""What an export format is: the one interface checkpoint writing, reading, `lowbit export`, the
model card and the weight-bytes figure go through. A format is an instance of a subclass,
registered by name in registry.FORMATS."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .hf_folder import read_safetensors, safetensors_bytes

if TYPE_CHECKING:
    from lowbit.export.config import ExportConfig


class ExportFormat(ABC):
    name: str  # the value of export.format and `lowbit export --format`
    summary: str  # one line: what the format holds and who loads it
    # whether the checkpoint keeps quantized modules; a float format (dense) writes them dequantized,
    # so a run exporting to it is a float export, audited and carded as not quantized
    holds_quantized: bool = True

    @abstractmethod
    def write(self, model: nn.Module, tokenizer, folder: Path, cfg: ExportConfig,
              extra_files: dict[str, str]) -> None:
        """Write the whole checkpoint (tensors, config.json, tokenizer, extra_files) into `folder`,
        an empty staging folder; checkpoint.save publishes it and writes the manifest."""

    @abstractmethod
    def detects(self, config: dict) -> bool:
        """Whether a checkpoint whose config.json holds `config` is in this format."""

    def read_tensors(self, folder: Path, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint by its name in `model` (built from config.json), as read()
        and the caller's float loading expect them."""
        return read_safetensors(folder)

    def load_tokenizer(self, folder: Path, trust_remote_code: bool):
        """The checkpoint's tokenizer, from its tokenizer files."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)

    @abstractmethod
    def read(self, model: nn.Module, tensors: dict[str, torch.Tensor], config: dict, where: str) -> None:
        """Put lowbit's runtime modules into `model` (built from config.json) for the quantized layers,
        popping their tensors; the float tensors left are loaded by the caller. `where` names the
        file for errors."""

    def config_problems(self, config: dict, folder: Path) -> list[str]:
        """Where config.json's quantization settings disagree with the quantized tensors in `folder`
        (read from the file headers, not loaded), one line each naming the tensor and the config
        key; formats whose modules are built from the tensors alone find none."""
        return []

    def outer_dtype(self, cfg: ExportConfig) -> torch.dtype:
        """The dtype a streamed export reads the modules outside the decoder layers in: the one the
        format casts float tensors to (the same values, half the memory of float32)."""
        return getattr(torch, cfg.dtype)

    def weight_bytes(self, folder: Path) -> int:
        """Bytes of the weight tensors as written (codes, scales, float weights)."""
        return safetensors_bytes(folder)

    @abstractmethod
    def describe(self, config: dict) -> str:
        """The model card's Format cell for a checkpoint with this config."""

    @abstractmethod
    def loading(self, config: dict) -> list[str]:
        """The model card's "Loading" lines (markdown): how other tools load the checkpoint."""
