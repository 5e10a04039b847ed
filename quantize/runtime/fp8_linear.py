"""FP8Linear: the runtime module for FP8 weights (and FP8 activations), beside QuantLinear.

Buffers (names kept for export): `weight` (out, in) float8, `weight_scale` float32 ((1, 1),
(out, 1) or block grid), `input_scale` float32 scalar for static activations (None otherwise),
`bias` in the compute dtype (float32 until a
float cast, the one buffer a cast reaches: runtime/buffers.py) or None.

Three paths give the same maths: on a GPU with FP8 tensor cores (CUDA capability >= 8.9: Ada,
Hopper) `torch._scaled_mm` multiplies the FP8 codes directly; on an AVX-512 or AVX2 CPU, once
quantize.backends.prepare() has attached it, a kernel decodes the FP8 bytes in registers
(decode-sized batches); elsewhere the reference path fake-quantizes the activations and
multiplies by the dequantized weight.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.nn.functional as F

from lowbit.quantize.grids.fp8 import (
    ActivationMode,
    FP8Format,
    FP8Scheme,
    FP8Weight,
    WeightStrategy,
    dynamic_token_scale,
    fake_quantize_activation,
    fp8_dtype,
    quantize_activation,
)
from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.runtime.buffers import RuntimeModule, fill_buffers, one_device
from lowbit.quantize.runtime.checks import scale_problems, static_input_problems


class FP8Linear(RuntimeModule):
    kernel = None  # a CPU kernel attached by quantize.backends.prepare(), else None
    # a float dtype cast (model.to(torch.bfloat16)) reaches the bias only: the weight stays
    # float8, its scale and the input scale float32 (FP8 bytes and their calibrated scales)
    FLOAT_CAST_BUFFERS = ("bias",)

    def __init__(self, in_features: int, out_features: int, fmt: FP8Format, weight_strategy: WeightStrategy,
                 activations: ActivationMode, bias: bool, scale_shape: tuple[int, int], block_size: int = 128,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fmt, self.weight_strategy, self.block_size = fmt, weight_strategy, block_size
        self.activations = activations
        on = {"device": device}
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=fp8_dtype(fmt), **on))
        self.register_buffer("weight_scale", torch.ones(scale_shape, **on))
        self.register_buffer("input_scale", torch.ones((), **on) if activations == "static" else None)
        self.register_buffer("bias", torch.zeros(out_features, **on) if bias else None)

    @classmethod
    def from_weight(cls, fw: FP8Weight, bias: Optional[torch.Tensor], activations: ActivationMode,
                    input_scale: Optional[torch.Tensor] = None) -> "FP8Linear":
        """An FP8Linear holding copies of fw's tensors and bias, on the device they are all on;
        input_scale, a calibration statistic (the observers keep theirs on the CPU), joins them."""
        if (activations == "static") != (input_scale is not None):
            raise ValueError("an input_scale is required with static activations and only with them")
        device = one_device("FP8Linear.from_weight", weight=fw.data, weight_scale=fw.scale, bias=bias)
        out, inp = fw.data.shape
        m = cls(inp, out, fw.fmt, fw.strategy, activations, bias is not None, tuple(fw.scale.shape), fw.block_size,
                device="meta")
        if input_scale is not None:
            input_scale = input_scale.reshape(()).to(device)
        return fill_buffers(m, weight=fw.data, weight_scale=fw.scale, input_scale=input_scale, bias=bias)

    @classmethod
    def weight_only(cls, fw: FP8Weight, bias: Optional[torch.Tensor]) -> "FP8Linear":
        """FP8 weights and 16-bit inputs: what a weight step (rtn, gptq) leaves; the fp8 step may then
        quantize the inputs too."""
        return cls.from_weight(fw, bias, "none")

    def quantize_inputs(self, activations: ActivationMode, input_scale: Optional[torch.Tensor] = None) -> None:
        """Switch 16-bit inputs to FP8 ones (the fp8 step after a weight step)."""
        if (activations == "static") != (input_scale is not None):
            raise ValueError("an input_scale is required with static activations and only with them")
        self.activations = activations
        self.input_scale = None if input_scale is None else input_scale.reshape(()).to(self.weight_scale.device)

    def fp8_weight(self) -> FP8Weight:
        return FP8Weight(self.weight, self.weight_scale, self.fmt, self.weight_strategy, self.block_size)

    def dequantized_weight(self) -> torch.Tensor:
        return self.fp8_weight().dequantize()

    def linear_scheme(self) -> LinearScheme:
        return LinearScheme(FP8Scheme(self.fmt, self.weight_strategy, self.block_size), self.activations)

    def holds(self, scheme: LinearScheme) -> bool:
        have = self.linear_scheme()
        if self.weight_strategy != "block" and type(scheme.weights) is type(have.weights):
            # outside strategy block a block size means nothing: whichever the recipe wrote matches
            have = LinearScheme(replace(have.weights, block_size=scheme.weights.block_size), have.inputs)
        return scheme == have

    def audit(self, name: str, storage_dtype=None) -> list[str]:
        """Non-usable scales and NaN weights (a saturating cast never makes inf)."""
        problems = scale_problems(f"{name}.weight_scale", self.weight_scale, storage_dtype)
        nan = int(torch.isnan(self.weight.float()).sum())
        if nan:
            problems.append(f"{name}.weight: {nan} NaN of {self.weight.numel()} FP8 values")
        if self.activations == "static":
            problems += static_input_problems(name, self.input_scale, storage_dtype)
        return problems

    def input_scale_for(self, x: torch.Tensor) -> torch.Tensor:
        """The activation scale: per token (dynamic) or the calibrated scalar (static)."""
        return dynamic_token_scale(x, self.fmt) if self.activations == "dynamic" else self.input_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and self.kernel.accepts(x):
            return self.kernel(x)
        if self.can_use_scaled_mm(x):
            return self._forward_scaled_mm(x)
        return self._forward_reference(x)

    def _forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations != "none":
            x = fake_quantize_activation(x, self.input_scale_for(x), self.fmt)
        w = self.dequantized_weight().to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def can_use_scaled_mm(self, x: torch.Tensor) -> bool:
        """FP8 tensor cores apply: CUDA capability >= 8.9, E4M3, per-tensor/channel scales, 16-aligned."""
        if not (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)):
            return False
        return (self.activations != "none" and self.fmt == "e4m3" and x.dtype == torch.bfloat16
                and self.weight_strategy in ("tensor", "channel")
                and self.in_features % 16 == 0 and self.out_features % 16 == 0)

    def _forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        # Not exercised by the test suite (no FP8 GPU there): written to torch._scaled_mm's contract,
        # A (M, K) row-major, B (K, N) column-major (the transpose of our row-major weight), and
        # row-wise scales (M, 1) x (1, N) in float32.
        x2 = x.reshape(-1, self.in_features)
        scale_a = self.input_scale_for(x2).float()
        scale_a = scale_a.reshape(-1, 1).expand(x2.shape[0], 1).contiguous()
        scale_b = self.weight_scale.float().reshape(1, -1).expand(1, self.out_features).contiguous()
        out = torch._scaled_mm(quantize_activation(x2, scale_a, self.fmt), self.weight.t(), scale_a=scale_a,
                               scale_b=scale_b, bias=None if self.bias is None else self.bias.to(x.dtype),
                               out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        block = f" {self.block_size}x{self.block_size}" if self.weight_strategy == "block" else ""
        return (f"in={self.in_features}, out={self.out_features}, {self.fmt}, weights {self.weight_strategy}"
                f"{block}, activations {self.activations}")
