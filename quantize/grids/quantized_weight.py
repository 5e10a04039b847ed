"""QuantizedWeight: integer codes plus the scales and zero points that give them meaning."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lowbit.quantize.grids.integer import IntScheme, compute_scale_zero, dequantize_codes, quantize_codes


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # (out, in) int8 in [-2^(bits-1), 2^(bits-1))
    scale: torch.Tensor  # (out, G) float32, or (1, 1) per-tensor
    zero: Optional[torch.Tensor]  # (out, G) like scale, integer-valued, signed; None when symmetric
    scheme: IntScheme
    g_idx: Optional[torch.Tensor] = None  # (in,) group of each input column, for act-order

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        if self.g_idx is None:
            return dequantize_codes(self.codes, self.scale, self.zero, self.scheme)
        # act-order with permuted groups: column j uses group g_idx[j]
        s = self.scale[:, self.g_idx]
        q = self.codes.float()
        if self.zero is not None:
            q = q - self.zero.float()[:, self.g_idx]
        return q * s


def quantize_rtn(w: torch.Tensor, scheme: IntScheme) -> QuantizedWeight:
    """Round-to-nearest on min/max scales: the baseline every other algorithm must beat."""
    scale, zero = compute_scale_zero(w, scheme)
    codes = quantize_codes(w, scale, zero, scheme)
    return QuantizedWeight(codes, scale.float(), zero, scheme)
