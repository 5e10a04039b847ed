"""Export options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ExportConfig:
    # compressed-tensors: what vLLM and transformers load; gptq: qweight/qzeros for the GPTQ ecosystem
    format: Literal["compressed-tensors", "gptq"] = "compressed-tensors"
    overwrite: bool = False  # replace a non-empty output folder
    # dtype of the float tensors and scales in the file; the runtimes compute in it too
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
