"""Where evaluation runs and in which dtype (evaluate.device / evaluate.dtype).

auto: on a GPU when torch sees one, in bfloat16 there (the dtype users serve), else on the CPU in
float32 (the dtype the baseline is loaded in, and what CPU kernels expect). The evaluated model
and its reference are placed alike, so every comparison is made in one dtype on one device; a
runtime module keeps its codes and float32 scales through the move (quantize/runtime).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype

    def describe(self) -> dict:
        return {"device": self.device.type, "dtype": str(self.dtype).removeprefix("torch.")}


def resolve_placement(device: str = "auto", dtype: str = "auto") -> Placement:
    """The device and dtype an evaluate config asks for, with auto resolved for this machine."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("evaluate.device is cuda but torch sees no GPU here "
                         f"(torch {torch.__version__}, CUDA {torch.version.cuda}); use auto or cpu")
    elif device not in ("cpu", "cuda"):
        raise ValueError(f"evaluate.device must be auto, cpu or cuda, got {device!r}")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"evaluate.dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    return Placement(torch.device(device), DTYPES[dtype])


def place(model, placement: Placement):
    """`model` moved to the placement's device and its float tensors cast to its dtype, in place
    (a no-op where it is there already)."""
    return model.to(device=placement.device, dtype=placement.dtype)


def placement_of(model) -> dict:
    """Where a model is and its compute dtype (its first floating parameter's), as describe() says."""
    param = next(p for p in model.parameters() if p.is_floating_point())
    return Placement(param.device, param.dtype).describe()
