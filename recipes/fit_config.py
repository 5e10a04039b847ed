"""The recipe's `fit:` key and `lowbit fit`'s flags: a budget (bits per weight, or a memory size such as
8GB or 7.5GiB at a context and batch) and how to measure for it, checked when the recipe loads."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, Optional

from lowbit.calibrate.data import CalibrationConfig
from lowbit.calibrate.messages import short_repr
from lowbit.evaluate import sensitivity
from lowbit.quantize.grids.gguf import LAYOUTS
from lowbit.quantize.grids.gguf_plan import F16
from lowbit.quantize.grids.formats import grid_named

SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B)\s*$", re.IGNORECASE)
SIZE_UNITS = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

MAX_BITS = 16  # f16, the widest candidate: a budget above it buys nothing a 16 bits budget does not
COUNTS = ("context", "batch", "prefill_chunk", "samples", "seq_len")  # whole numbers of tokens or sequences
WEIGHT_CANDIDATES = {"compressed-tensors": sensitivity.INT_CANDIDATES, "gguf": sensitivity.CANDIDATES}


def parse_size(text: str, key: str = "memory") -> int:
    match = SIZE.match(text) if isinstance(text, str) else None
    number = _number(match.group(1)) if match else math.nan
    if not math.isfinite(number):  # no number, "1.2.3", or so many digits that float() says inf
        raise ValueError(f"{key} {short_repr(text)}: give a size such as 8GB, 256MB or 7.5GiB")
    return int(number * SIZE_UNITS[match.group(2).lower()])


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


@dataclass(frozen=True)
class FitConfig:
    """A budget and how to measure for it (the recipe's `fit:` key, and `lowbit fit`'s flags)."""

    format: Literal["compressed-tensors", "gguf"] = "compressed-tensors"  # what the plan is written as
    bits_per_weight: Optional[float] = None  # over the decoder-layer linears; or memory:
    memory: Optional[str] = None  # e.g. 8GB, 7.5GiB: weights + KV cache + prefill workspace
    context: int = 4096  # tokens per sequence (with memory)
    batch: int = 1  # sequences at once (with memory)
    # prompt tokens per forward (vLLM's chunked prefill, llama.cpp's ubatch); None: the largest of
    # 512, 256, 128 at which a plan fits (smaller chunks prefill slower, in less memory)
    prefill_chunk: Optional[int] = None
    # the runtime's memory beyond its tensors and workspace (code pages, allocator pools, module
    # objects): lowbit's lean CPU runtime measured 38 MiB on smollm2-135m; a GPU runtime needs more
    # (CUDA context, graphs: set it, e.g. 1GiB for vLLM)
    overhead: str = "40MiB"
    types: tuple[str, ...] = ()  # candidate weight formats; () = the format's defaults
    kv_formats: tuple[str, ...] = ()  # candidate KV formats (memory budgets); () = all the format writes
    dataset: str = "wiki"
    samples: int = 2
    seq_len: int = 256

    # each message starts with the key it is about: `lowbit fit` names its flag there instead (app/fit.py)
    def __post_init__(self):
        if (self.bits_per_weight is None) == (self.memory is None):
            raise ValueError("give one budget: bits_per_weight, or memory (with context and batch)")
        if self.bits_per_weight is not None:
            _check_bits(self.bits_per_weight)
        if self.memory is not None and parse_size(self.memory) <= 0:
            raise ValueError(f"memory must be positive, got {short_repr(self.memory)}")
        parse_size(self.overhead, "overhead")
        for key in COUNTS:
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be a whole number of at least 1, got {value}")
        for kind in self.weight_candidates:
            _check_weight_format(kind, self.format)
        bad = [k for k in self.kv_candidates if k not in sensitivity.KV_CANDIDATES]
        if bad:
            raise ValueError(f"kv_formats {bad}: valid {', '.join(sensitivity.KV_CANDIDATES)}")
        if self.format == "gguf" and set(self.kv_candidates) != {F16}:
            raise ValueError("the GGUF export keeps a 16-bit KV cache (llama.cpp sets its cache type at "
                             "load time); kv_formats other than f16 need format: compressed-tensors")

    @property
    def weight_candidates(self) -> tuple[str, ...]:
        return self.types or WEIGHT_CANDIDATES[self.format]

    @property
    def kv_candidates(self) -> tuple[str, ...]:
        if self.kv_formats:
            return self.kv_formats
        return sensitivity.KV_CANDIDATES if self.format == "compressed-tensors" and self.memory else (F16,)

    @property
    def calibration(self) -> CalibrationConfig:
        return CalibrationConfig(self.dataset, self.samples, self.seq_len)


def _check_bits(bits: float) -> None:
    """A budget in (0, MAX_BITS]: refused before anything is measured (minutes on a small model)."""
    if not (math.isfinite(bits) and bits > 0):
        raise ValueError(f"bits_per_weight must be a positive number, got {bits}")
    if bits > MAX_BITS:
        raise ValueError(f"bits_per_weight {bits:g} is above {MAX_BITS}, the bits per weight of the widest "
                         f"candidate (f16); valid budgets are above 0 and at most {MAX_BITS}, e.g. 4.5")


def _check_weight_format(kind: str, fmt: str) -> None:
    if fmt == "gguf":
        if kind not in LAYOUTS and kind != F16:
            raise ValueError(f"types: {short_repr(kind)} is not a GGML type; "
                             f"valid: {', '.join(sorted(LAYOUTS))}, {F16}")
        return
    grid_named(kind)  # raises naming the valid forms
