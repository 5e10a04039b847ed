"""QuantLinear: the runtime module that replaces nn.Linear (and GPT-2's Conv1D) after quantization."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.quantize.grids.inputs import InputQuant
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.grids.quantized_weight import QuantizedWeight
from lowbit.quantize.runtime.int8_inputs import quantized_input_linear


class QuantLinear(nn.Module):
    """Holds integer codes and scales; the reference path dequantizes and runs a float matmul."""

    kernel = None  # a packed-weight matmul attached by quantize.backends.prepare(), else None

    def __init__(self, in_features: int, out_features: int, scheme: IntScheme, bias: bool,
                 groups: int, act_order: bool = False, input_quant: InputQuant | None = None):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.input_quant = input_quant  # None: inputs stay float (weight-only quantization)
        rows = 1 if scheme.strategy == "tensor" else out_features
        self.register_buffer("weight_codes", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(rows, groups))
        self.register_buffer("weight_zero", None if scheme.symmetric else torch.zeros(rows, groups))
        self.register_buffer("weight_g_idx", torch.zeros(in_features, dtype=torch.int32) if act_order else None)
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        # static input quantization: the calibrated per-tensor scale (1,) float32, absmax / 127.5
        static = input_quant is not None and not input_quant.dynamic
        self.register_buffer("input_scale", torch.ones(1) if static else None)

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None) -> "QuantLinear":
        out, inp = qw.shape
        m = cls(inp, out, qw.scheme, bias is not None, qw.scale.shape[1], qw.g_idx is not None)
        m.weight_codes.copy_(qw.codes)
        m.weight_scale = qw.scale.detach().float().clone()
        if qw.zero is not None:
            m.weight_zero = qw.zero.detach().float().clone()
        if qw.g_idx is not None:
            m.weight_g_idx = qw.g_idx.to(torch.int32).clone()
        if bias is not None:
            m.bias = bias.detach().float().clone()
        return m

    def quantized_weight(self) -> QuantizedWeight:
        g_idx = None if self.weight_g_idx is None else self.weight_g_idx.long()
        return QuantizedWeight(self.weight_codes, self.weight_scale, self.weight_zero, self.scheme, g_idx)

    def linear_scheme(self) -> LinearScheme:
        return LinearScheme(self.scheme, self.input_quant)

    def dequantized_weight(self) -> torch.Tensor:
        return self.quantized_weight().dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quant is not None:  # W8A8: int8 inputs too, never a weight-only kernel
            return quantized_input_linear(self, x)
        if self.kernel is not None and self.kernel.accepts(x):
            return self.kernel(x)
        w = self.dequantized_weight().to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        s = self.scheme
        group = f", group_size={s.group_size}" if s.group_size else ""
        act = ""
        if self.input_quant is not None:
            act = f", input int{self.input_quant.bits} {'per-token' if self.input_quant.dynamic else 'static'}"
        return (f"in={self.in_features}, out={self.out_features}, int{s.bits}, "
                f"{'sym' if s.symmetric else 'asym'}, {s.strategy}{group}{act}")
