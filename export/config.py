"""Export options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ExportConfig:
    format: Literal["compressed-tensors"] = "compressed-tensors"  # what vLLM and transformers load
    overwrite: bool = False  # replace a non-empty output folder
    # dtype of the float tensors and scales in the file; the runtimes compute in it too
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
