"""Export options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, get_args

from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids.gguf import LAYOUTS

from .formats.registry import FORMATS
from .runtimes import RUNTIMES

Format = Literal[tuple(FORMATS)]  # the registered formats' names, so recipes are checked against them
Dtype = Literal["bfloat16", "float16", "float32"]
DTYPES = get_args(Dtype)
GGUFType = Literal[tuple(LAYOUTS)]  # GGML block types lowbit writes (q8_0, q4_0, q4_1, q5_0, q4_k, q6_k)
GGUF_TYPES = get_args(GGUFType)


@dataclass(frozen=True)
class ExportConfig:
    # a name in export/formats/registry.py's FORMATS; each format's summary says what it holds
    format: Format = "compressed-tensors"
    # dtype of the float tensors and scales in the file; the runtimes compute in it too
    dtype: Dtype = "bfloat16"
    # gguf only: the GGML type float linears are rounded to (llama.cpp's reference RTN; rows its
    # block does not divide get llama.cpp's fallback); None keeps them in `dtype`. Linears a gguf
    # recipe quantized keep the type their step chose.
    type: Optional[GGUFType] = None
    embedding_type: Optional[GGUFType] = None  # gguf only: the token embedding's type; None: `dtype`
    # the runtime that must load the checkpoint (export/runtimes.py): a plan it cannot load is refused
    # before any work; None checks nothing (and is left out of a run's recipe.yaml)
    target: Optional[Literal[tuple(RUNTIMES)]] = None

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown export format {short_repr(self.format)}; valid: {', '.join(FORMATS)}")
        for key in ("type", "embedding_type"):
            value = getattr(self, key)
            if value is not None and value not in GGUF_TYPES:
                raise ValueError(f"export.{key} {short_repr(value)} is not a GGUF type; valid: {', '.join(GGUF_TYPES)}")
            if value is not None and self.format != "gguf":
                raise ValueError(f"export.{key} applies to format gguf only (format is {short_repr(self.format)})")
