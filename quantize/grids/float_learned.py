"""The float grids' learned-rounding views (FP8 E4M3/E5M2, MXFP4's E2M1): per weight an offset in
[-0.5, 0.5] of the format's spacing where the weight lies (its binade's step, or the subnormal step),
added before the cast rounds to the nearest value, through a straight-through round. The scales stay
as round-to-nearest sets them: MXFP4's are powers of two chosen by the block's maximum, a step no
gradient crosses; on FP8 a learned clipping factor per scale (as the integer view has) made a tiny
llama's held-out error worse than round-to-nearest's, where offsets alone made it 0.79x (40 steps,
the same on AVX-512 and AVX2). At offset 0 each view is its grid's round-to-nearest, bit for bit."""
from __future__ import annotations

import torch
from torch import nn

from lowbit.quantize.grids.fp8 import FP8Scheme, FP8Weight, element_scale, fp8_max, saturating_cast, weight_scale
from lowbit.quantize.grids.integer_learned import straight_through
from lowbit.quantize.grids.mxfp4 import MXScheme, MXWeight, block_exponents, e2m1_codes, e2m1_values, element_scales

# format -> (mantissa bits, exponent of the smallest normal value)
SPACING = {"e4m3": (3, -6), "e5m2": (2, -14), "e2m1": (1, 0)}
E2M1_MAX = 6.0


def float_step(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """The spacing of `fmt`'s values around each y: 2^(floor(log2 |y|) - mantissa bits), and the
    subnormal spacing below the smallest normal value (zero included)."""
    mantissa, smallest = SPACING[fmt]
    _, exponent = torch.frexp(y)  # |y| = m * 2^exponent, m in [0.5, 1): floor(log2 |y|) = exponent - 1
    binade = torch.where(y == 0, torch.full_like(exponent, smallest), (exponent - 1).clamp(min=smallest))
    return torch.ldexp(torch.ones_like(y), binade - mantissa)


class OffsetRounding(nn.Module):
    """What both float views share: the weight over its per-element scales (y), each weight's step,
    and the learned offset; a view says how a shifted value rounds (`nearest`) and its largest value."""

    def __init__(self, y: torch.Tensor, scale: torch.Tensor, fmt: str, top: float):
        super().__init__()
        self.top = top
        self.register_buffer("scale", scale)  # broadcasts against y
        self.register_buffer("y", y)
        self.register_buffer("step", float_step(y, fmt))
        self.offset = nn.Parameter(torch.zeros_like(y))

    def shifted(self) -> torch.Tensor:
        return self.y + self.offset * self.step

    def fake_weight(self) -> torch.Tensor:
        shifted = self.shifted()
        held = self.nearest(shifted.detach())
        return straight_through(held, shifted.clamp(-self.top, self.top)) * self.scale

    @torch.no_grad()
    def keep_in_range(self) -> None:
        self.offset.clamp_(-0.5, 0.5)


class FP8LearnedRounding(OffsetRounding):
    def __init__(self, w: torch.Tensor, scheme: FP8Scheme):
        w = w.detach().float()
        scale = weight_scale(w, scheme.strategy, scheme.format, scheme.block_size)
        per_element = element_scale(scale, w.shape, scheme.strategy, scheme.block_size)
        super().__init__(w / per_element, per_element, scheme.format, fp8_max(scheme.format))
        self.scheme = scheme
        self.register_buffer("fp8_scale", scale)  # one per tensor, channel or block, as the weight stores it

    def nearest(self, shifted: torch.Tensor) -> torch.Tensor:
        return saturating_cast(shifted, self.scheme.format).float()

    @torch.no_grad()
    def weight(self) -> FP8Weight:
        s = self.scheme
        data = saturating_cast(self.shifted(), s.format)
        return FP8Weight(data, self.fp8_scale, s.format, s.strategy, s.block_size)


class MXLearnedRounding(OffsetRounding):
    def __init__(self, w: torch.Tensor, scheme: MXScheme):
        scheme.check_weight(w, "weight")
        w = w.detach().float()
        exponents = block_exponents(w)
        scale = element_scales(exponents)
        super().__init__(w / scale, scale, "e2m1", E2M1_MAX)
        self.scheme = scheme
        self.register_buffer("exponents", exponents)

    def nearest(self, shifted: torch.Tensor) -> torch.Tensor:
        return e2m1_values(e2m1_codes(shifted))

    @torch.no_grad()
    def weight(self) -> MXWeight:
        return MXWeight(e2m1_codes(self.shifted()), self.exponents)
