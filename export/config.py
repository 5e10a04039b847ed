"""Export options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Format = Literal["compressed-tensors", "gptq"]
FORMATS = get_args(Format)
Dtype = Literal["bfloat16", "float16", "float32"]
DTYPES = get_args(Dtype)


@dataclass(frozen=True)
class ExportConfig:
    # compressed-tensors: what vLLM and transformers load; gptq: qweight/qzeros for the GPTQ ecosystem
    format: Format = "compressed-tensors"
    overwrite: bool = False  # replace a non-empty output folder
    # dtype of the float tensors and scales in the file; the runtimes compute in it too
    dtype: Dtype = "bfloat16"
