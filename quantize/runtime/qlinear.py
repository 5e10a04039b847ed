"""QuantLinear: the runtime module that replaces nn.Linear (and GPT-2's Conv1D) after quantization."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.quantize.grids.inputs import InputQuant
from lowbit.quantize.grids.integer import IntScheme, QuantizedWeight
from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.runtime.buffers import RuntimeModule, fill_buffers, one_device
from lowbit.quantize.runtime.checks import range_problems, scale_problems, static_input_problems, zero_problems
from lowbit.quantize.runtime.int8_inputs import quantized_input_linear


class QuantLinear(RuntimeModule):
    """Holds integer codes and scales; the reference path dequantizes and runs a float matmul."""

    kernel = None  # a packed-weight matmul attached by quantize.backends.prepare(), else None
    # a float dtype cast (model.to(torch.bfloat16)) reaches the bias only: codes stay int8,
    # scales, zero points and the input scale float32, so the grid is the calibrated one
    FLOAT_CAST_BUFFERS = ("bias",)

    def __init__(self, in_features: int, out_features: int, scheme: IntScheme, bias: bool,
                 groups: int, act_order: bool = False, input_quant: InputQuant | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.input_quant = input_quant  # None: inputs stay float (weight-only quantization)
        rows = 1 if scheme.strategy == "tensor" else out_features
        on = {"device": device}
        self.register_buffer("weight_codes", torch.zeros(out_features, in_features, dtype=torch.int8, **on))
        self.register_buffer("weight_scale", torch.ones(rows, groups, **on))
        self.register_buffer("weight_zero", None if scheme.symmetric else torch.zeros(rows, groups, **on))
        self.register_buffer("weight_g_idx", torch.zeros(in_features, dtype=torch.int32, **on) if act_order else None)
        self.register_buffer("bias", torch.zeros(out_features, **on) if bias else None)
        # static input quantization: the calibrated per-tensor scale (1,) float32, absmax / 127.5
        static = input_quant is not None and not input_quant.dynamic
        self.register_buffer("input_scale", torch.ones(1, **on) if static else None)

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None) -> "QuantLinear":
        """A QuantLinear holding copies of qw's tensors and bias, on the device they are all on."""
        one_device("QuantLinear.from_quantized", codes=qw.codes, scale=qw.scale, zero=qw.zero,
                   g_idx=qw.g_idx, bias=bias)
        out, inp = qw.shape
        m = cls(inp, out, qw.scheme, bias is not None, qw.scale.shape[1], qw.g_idx is not None, device="meta")
        return fill_buffers(m, weight_codes=qw.codes, weight_scale=qw.scale, weight_zero=qw.zero,
                            weight_g_idx=qw.g_idx, bias=bias)

    def quantized_weight(self) -> QuantizedWeight:
        g_idx = None if self.weight_g_idx is None else self.weight_g_idx.long()
        return QuantizedWeight(self.weight_codes, self.weight_scale, self.weight_zero, self.scheme, g_idx)

    def linear_scheme(self) -> LinearScheme:
        return LinearScheme(self.scheme, self.input_quant)

    def dequantized_weight(self) -> torch.Tensor:
        return self.quantized_weight().dequantize()

    def holds(self, scheme: LinearScheme) -> bool:
        return self.linear_scheme() == scheme

    def audit(self, name: str, storage_dtype=None) -> list[str]:
        """Problems in the codes, scales, zero points and input scale (shapes, ranges, finiteness)."""
        s = self.scheme
        shape = (1 if s.strategy == "tensor" else self.out_features, s.num_groups(self.in_features))
        if tuple(self.weight_scale.shape) != shape:
            return [f"{name}: weight_scale has shape {tuple(self.weight_scale.shape)}, {s.strategy} needs {shape}"]
        problems = scale_problems(f"{name}.weight_scale", self.weight_scale, storage_dtype)
        problems += range_problems(f"{name}.weight_codes", self.weight_codes, s.qmin, s.qmax)
        if s.symmetric != (self.weight_zero is None):
            problems.append(f"{name}: {'symmetric' if s.symmetric else 'asymmetric'} scheme but "
                            f"{'a' if self.weight_zero is not None else 'no'} zero point")
        elif self.weight_zero is not None:
            problems += zero_problems(f"{name}.weight_zero", self.weight_zero, s.qmin, s.qmax)
        if self.weight_g_idx is not None:
            problems += range_problems(f"{name}.weight_g_idx", self.weight_g_idx, 0, shape[1] - 1)
        if self.input_quant is not None and not self.input_quant.dynamic:
            problems += static_input_problems(name, self.input_scale, storage_dtype)
        return problems

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
