"""INT8 input (activation) quantization of linears: per-token dynamic or per-tensor static.

Symmetric grids only (zero point 0), so an int8 x int8 matmul needs no correction terms:
    y = (Xq @ Wq^T) * x_scale (tokens, 1) * w_scale (1, out) + bias
`torch._int_mm` runs that product with int32 accumulation (on CPU too in torch >= 2.6);
everything else (4-bit or grouped weights, asymmetric weights) takes the reference path:
fake-quantize the input, dequantize the weight, float matmul.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    s = x2d.abs().amax(dim=-1, keepdim=True).float() / _half_range(qmax)
    return torch.where(s > 0, s, torch.ones_like(s))


def static_scale_from_absmax(absmax: torch.Tensor, qmax: int) -> torch.Tensor:
    """(1,) per-tensor scale from a calibrated absmax."""
    s = absmax.float().reshape(1) / _half_range(qmax)
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_input(x2d: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """int8 codes of x (tokens, in) on the symmetric grid of `scale` ((tokens, 1) or (1,))."""
    return torch.round(x2d.float() / scale).clamp(-qmax - 1, qmax).to(torch.int8)


def int_mm_usable(module, x2d: torch.Tensor) -> bool:
    """Whether the weight is a plain symmetric int8 per-channel/tensor grid `_int_mm` can use."""
    s = module.scheme
    if s.bits != 8 or not s.symmetric or s.strategy == "group" or module.weight_g_idx is not None:
        return False
    if x2d.device.type == "cpu":
        return True
    # CUDA kernels need more than 16 rows and sizes in multiples of 8
    return x2d.device.type == "cuda" and x2d.shape[0] > 16 and x2d.shape[1] % 8 == 0 \
        and module.out_features % 8 == 0


def quantized_input_linear(module, x: torch.Tensor) -> torch.Tensor:
    """QuantLinear.forward when its input is quantized too (module.input_quant is set)."""
    iq = module.input_quant
    x2d = x.reshape(-1, x.shape[-1])
    if iq.dynamic:
        x_scale = per_token_scale(x2d, iq.qmax)
    else:
        x_scale = module.input_scale.float().reshape(1, 1)
    codes = quantize_input(x2d, x_scale, iq.qmax)
    if int_mm_usable(module, x2d):
        acc = torch._int_mm(codes, module.weight_codes.t())  # (tokens, out) int32
        w_scale = module.weight_scale.float().reshape(1, -1)  # per-channel (out, 1) or tensor (1, 1)
        y = acc.float() * x_scale * w_scale
    else:  # reference: the same quantized input, a float matmul
        y = F.linear(codes.float() * x_scale, module.dequantized_weight().float())
    if module.bias is not None:
        y = y + module.bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], module.out_features)
