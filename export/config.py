"""Export options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from .formats.registry import FORMATS

Format = Literal[tuple(FORMATS)]  # the registered formats' names, so recipes are checked against them
Dtype = Literal["bfloat16", "float16", "float32"]
DTYPES = get_args(Dtype)


@dataclass(frozen=True)
class ExportConfig:
    # a name in export/formats/registry.py's FORMATS; each format's summary says what it holds
    format: Format = "compressed-tensors"
    overwrite: bool = False  # replace a non-empty output folder
    # dtype of the float tensors and scales in the file; the runtimes compute in it too
    dtype: Dtype = "bfloat16"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown export format {self.format!r}; valid: {', '.join(FORMATS)}")
