"""MXFP4Linear: a linear whose weight is MXFP4 (E2M1 codes, an E8M0 scale per 32), 16-bit inputs.

Buffers, as compressed-tensors' `mxfp4-pack-quantized` stores them: `weight_packed` (out, in / 2)
uint8, two codes per byte, the first in the low nibble; `weight_scale` (out, in / 32) uint8, biased
exponents; `bias` or None. The forward decodes the weight into the input's dtype on every call
(no decoded copy is kept: the module's memory is the format's 4.25 bits per weight); a reference
path for calibrating, evaluating and exporting, not a fast kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.grids.mxfp4 import BLOCK, MXScheme, MXWeight, pack_codes, unpack_codes
from lowbit.quantize.runtime.buffers import RuntimeModule, fill_buffers, one_device


class MXFP4Linear(RuntimeModule):
    FLOAT_CAST_BUFFERS = ("bias",)  # codes and exponents are uint8 and stay so

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device | str | None = None):
        super().__init__()
        MXScheme().check_columns(in_features, "MXFP4Linear")
        self.in_features, self.out_features = in_features, out_features
        on = {"device": device, "dtype": torch.uint8}
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, **on))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // BLOCK, **on))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    @classmethod
    def from_weight(cls, mw: MXWeight, bias: Optional[torch.Tensor]) -> "MXFP4Linear":
        """An MXFP4Linear holding mw's packed codes, exponents and a copy of bias, on their device."""
        one_device("MXFP4Linear.from_weight", codes=mw.codes, exponents=mw.exponents, bias=bias)
        rows, cols = mw.codes.shape
        m = cls(cols, rows, bias is not None, device="meta")
        return fill_buffers(m, weight_packed=pack_codes(mw.codes), weight_scale=mw.exponents, bias=bias)

    def mx_weight(self) -> MXWeight:
        return MXWeight(unpack_codes(self.weight_packed), self.weight_scale)

    def dequantized_weight(self) -> torch.Tensor:
        return self.mx_weight().dequantize()

    def linear_scheme(self) -> LinearScheme:
        return LinearScheme(MXScheme())

    def holds(self, scheme: LinearScheme) -> bool:
        return self.linear_scheme() == scheme

    def audit(self, name: str, storage_dtype=None) -> list[str]:
        """Scales that are NaN in E8M0 (255); codes are 4-bit by construction."""
        nan = int((self.weight_scale == 255).sum())
        return [f"{name}.weight_scale: {nan} NaN (255) E8M0 scales"] if nan else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mxfp4"
