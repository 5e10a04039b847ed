"""GGUFLinear: a linear whose weight is stored as a .gguf tensor stores it, GGML block bytes.

Buffers: `weight` (out, in / block · type_size) uint8, the bytes `gguf_packing.pack` writes (and a
.gguf file holds, byte for byte); `bias` float32 or None. `scheme` names the block type. The
exporter copies `weight` as it is, so what a GGUF file holds is exactly what calibration chose.

The forward multiplies by the dequantized weight, decoded once and kept (float32) until the module
moves: this module is for calibrating, evaluating and exporting, not a fast runtime (llama.cpp is
the runtime for these files).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lowbit.quantize.grids.gguf import GGUFScheme, GGUFWeight
from lowbit.quantize.grids.gguf_packing import pack, unpack
from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.runtime.buffers import RuntimeModule, fill_buffers, one_device


class GGUFLinear(RuntimeModule):
    # a float dtype cast (model.to(torch.bfloat16)) reaches the bias only; the block bytes are
    # uint8 and stay so (the decoded weight is made again, in float32, after any move or cast)
    FLOAT_CAST_BUFFERS = ("bias",)

    def __init__(self, in_features: int, out_features: int, scheme: GGUFScheme, bias: bool,
                 device: torch.device | str | None = None):
        super().__init__()
        if in_features % scheme.block_size:  # the grid's message; its finiteness check needs data (none
            scheme.check_weight(torch.empty(0, in_features))  # here, and a fake or meta tensor answers none)
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        row_bytes = in_features // scheme.block_size * scheme.layout.type_size
        self.register_buffer("weight", torch.zeros(out_features, row_bytes, dtype=torch.uint8, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self._dense: Optional[torch.Tensor] = None

    @classmethod
    def from_weight(cls, gw: GGUFWeight, bias: Optional[torch.Tensor]) -> "GGUFLinear":
        """A GGUFLinear holding gw's block bytes and a copy of bias, on the device they are all on."""
        one_device("GGUFLinear.from_weight", levels=gw.levels, d=gw.d, dmin=gw.dmin, sub_scale=gw.sub_scale,
                   sub_min=gw.sub_min, bias=bias)
        rows, cols = gw.levels.shape
        m = cls(cols, rows, gw.scheme, bias is not None, device="meta")
        return fill_buffers(m, weight=pack(gw), bias=bias)

    def hold(self, gw: GGUFWeight) -> None:
        """Take gw's block bytes in place of its own (same type and shape); decoded again on the next forward."""
        self.weight.copy_(pack(gw).to(self.weight.device))
        self._dense = None

    def gguf_weight(self) -> GGUFWeight:
        return unpack(self.weight.cpu(), self.scheme)

    def dequantized_weight(self) -> torch.Tensor:
        return self.gguf_weight().dequantize().to(self.weight.device)

    def linear_scheme(self) -> LinearScheme:
        return LinearScheme(self.scheme)

    def holds(self, scheme: LinearScheme) -> bool:
        return self.linear_scheme() == scheme

    def audit(self, name: str, storage_dtype=None) -> list[str]:
        """Non-finite block scales (the levels are in range by construction: packed bits)."""
        gw = self.gguf_weight()
        problems = []
        for field_name in ("d", "dmin"):
            value = getattr(gw, field_name)
            bad = 0 if value is None else int((~torch.isfinite(value.float())).sum())
            if bad:
                problems.append(f"{name}: {bad} NaN or inf block {field_name} values")
        return problems

    def _apply(self, fn, recurse=True):
        self._dense = None  # moved or cast: decode again from the bytes
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense is None:
            self._dense = self.dequantized_weight()
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self._dense.to(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"gguf={self.scheme.type}, bias={self.bias is not None}")
