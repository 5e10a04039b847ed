"""INT8 input (activation) quantization of linears: per-token dynamic or per-tensor static.

Symmetric grids only (zero point 0), so an int8 x int8 matmul needs no correction terms:
    y = (Xq @ Wq^T) * x_scale (tokens, 1) * w_scale (1, out) + bias
For a plain int8 per-channel/tensor weight, Xq @ Wq^T is taken one of two ways: `torch._int_mm`
(int32 accumulation) where it is fast (CUDA; a CPU with native int8 matmuls, calibrate.hardware's
int8_native: torch runs it on oneDNN only with AVX512-VNNI, elsewhere as a scalar loop, ~6x slower
than a float32 matmul), else a float32 matmul of the same integer codes. Its sums are exact
integers while every partial sum stays within 2^24, which always holds for in_features <= 1024
(|code products| <= 2^14); beyond, they are within float32 rounding of the int32 sum.
Everything else (4-bit or grouped weights, asymmetric weights) takes the reference path:
fake-quantize the input, dequantize the weight, float matmul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.calibrate.hardware import cpu_info
from lowbit.quantize.grids.inputs import per_token_scale


def input_codes(x2d: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """Codes of x (tokens, in) on the symmetric grid of `scale` ((tokens, 1) or (1,)) as float32
    integers: one new tensor, rounded and clamped in place."""
    return torch.div(x2d.float(), scale).round_().clamp_(-qmax - 1, qmax)


def plain_int8_grid(module) -> bool:
    """Whether the weight is a plain symmetric int8 per-channel/tensor grid (one scale per output
    row), so that the integer product Xq @ Wq^T can be scaled afterwards."""
    s = module.scheme
    return s.bits == 8 and s.symmetric and s.strategy != "group" and module.weight_g_idx is None


def cpu_int_mm_fast() -> bool:
    """torch._int_mm runs oneDNN's VNNI kernels on this CPU (torch needs oneDNN enabled too)."""
    return cpu_info().int8_native and torch.backends.mkldnn.enabled


def product_path(device) -> str:
    """How plain int8 W8A8 linears on this device multiply (recorded in the step's details)."""
    if torch.device(device).type == "cpu" and not cpu_int_mm_fast():
        return "float32 matmul of the int8 codes (torch._int_mm is a scalar loop on this CPU)"
    return "torch._int_mm (int8, int32 accumulation)"


def int_mm_fast(module, x2d: torch.Tensor) -> bool:
    """Whether torch._int_mm beats a float32 matmul of the codes here (see the module docstring)."""
    if x2d.device.type == "cpu":
        return cpu_int_mm_fast()
    # CUDA kernels need more than 16 rows and sizes in multiples of 8
    return x2d.device.type == "cuda" and x2d.shape[0] > 16 and x2d.shape[1] % 8 == 0 \
        and module.out_features % 8 == 0


def integer_product(module, codes: torch.Tensor, use_int_mm: bool) -> torch.Tensor:
    """Xq @ Wq^T (tokens, out) as float32: _int_mm's int32, or a float32 matmul of the codes."""
    if use_int_mm:
        return torch._int_mm(codes.to(torch.int8), module.weight_codes.t()).float()
    return codes @ module.weight_codes.t().float()


def quantized_input_linear(module, x: torch.Tensor, use_int_mm: bool | None = None) -> torch.Tensor:
    """QuantLinear.forward when its input is quantized too (module.input_quant is set).
    use_int_mm: None picks by int_mm_fast; True/False forces a way (tests compare the two)."""
    iq = module.input_quant
    x2d = x.reshape(-1, x.shape[-1])
    if iq.dynamic:
        x_scale = per_token_scale(x2d, iq.qmax)
    else:
        x_scale = module.input_scale.float().reshape(1, 1)
    codes = input_codes(x2d, x_scale, iq.qmax)
    if plain_int8_grid(module):
        use_int_mm = int_mm_fast(module, x2d) if use_int_mm is None else use_int_mm
        y = integer_product(module, codes, use_int_mm)
        y.mul_(x_scale).mul_(module.weight_scale.float().reshape(1, -1))  # per-channel (out, 1) or (1, 1)
    else:  # reference: the same quantized input, a float matmul with the dequantized weight
        y = F.linear(codes.mul_(x_scale), module.dequantized_weight().float())
    if module.bias is not None:
        y.add_(module.bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], module.out_features)
