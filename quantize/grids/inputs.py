"""Input (activation) grids of integer linears: symmetric INT8, a scale per token (dynamic) or
one calibrated per tensor (static). Pure functions; the runtime's products live in
lowbit.quantize.runtime.int8_inputs."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class InputQuant:
    """How a linear's input activations are quantized at run time."""

    bits: int = 8
    # True: one scale per token, from that token's absmax, computed at run time;
    # False: one per-tensor scale calibrated beforehand (QuantLinear.input_scale)
    dynamic: bool = True

    def __post_init__(self):
        if self.bits != 8:
            raise ValueError(f"input quantization supports 8 bits only, got {self.bits}")

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1  # 127; codes clamp to [-128, 127]


def _half_range(qmax: int) -> float:
    # absmax maps to (qmax - qmin) / 2 = 127.5, the grid compressed-tensors (and so vLLM and
    # transformers) uses for symmetric activations; lowbit's weight grids do the same
    return (2 * qmax + 1) / 2


def per_token_scale(x2d: torch.Tensor, qmax: int) -> torch.Tensor:
    """(tokens, 1) scale mapping each token's absmax onto the grid's half range."""
    # the inf-norm is the absmax in one read, without an abs() copy of the activations
    s = torch.linalg.vector_norm(x2d.float(), ord=float("inf"), dim=-1, keepdim=True) / _half_range(qmax)
    return torch.where(s > 0, s, torch.ones_like(s))


def static_scale_from_absmax(absmax: torch.Tensor, qmax: int) -> torch.Tensor:
    """(1,) per-tensor scale from a calibrated absmax."""
    s = absmax.float().reshape(1) / _half_range(qmax)
    return torch.where(s > 0, s, torch.ones_like(s))
