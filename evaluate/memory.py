"""Weight memory, exact from the tensors."""
from __future__ import annotations

from pathlib import Path

from safetensors import safe_open
from torch import nn


def model_weight_bytes(model: nn.Module, bytes_per_param: float | None = None) -> int:
    """Bytes of the model's unique parameters, at their dtype or at bytes_per_param."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += int(p.numel() * (bytes_per_param or p.element_size()))
    return total


def checkpoint_weight_bytes(folder: str | Path) -> int:
    """Bytes of every tensor in a checkpoint's safetensors files (codes, scales, float weights)."""
    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                total += numel * _dtype_bytes(t.get_dtype())
    return total


def _dtype_bytes(dtype: str) -> int:
    return {"F64": 8, "F32": 4, "I32": 4, "U32": 4, "I64": 8, "BF16": 2, "F16": 2, "I16": 2,
            "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}[dtype]
