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


class FP8LearnedRounding(nn.Module):
    def __init__(self, w: torch.Tensor, scheme: FP8Scheme):
        super().__init__()
        self.scheme = scheme
        w = w.detach().float()
        self.register_buffer("scale", weight_scale(w, scheme.strategy, scheme.format, scheme.block_size))
        self.register_buffer("per_element", element_scale(self.scale, w.shape, scheme.strategy, scheme.block_size))
        self.register_buffer("y", w / self.per_element)
        self.register_buffer("step", float_step(self.y, scheme.format))
        self.offset = nn.Parameter(torch.zeros_like(w))

    def fake_weight(self) -> torch.Tensor:
        shifted = self.y + self.offset * self.step
        top = fp8_max(self.scheme.format)
        held = saturating_cast(shifted.detach(), self.scheme.format).float()
        return straight_through(held, shifted.clamp(-top, top)) * self.per_element

    @torch.no_grad()
    def keep_in_range(self) -> None:
        self.offset.clamp_(-0.5, 0.5)

    @torch.no_grad()
    def weight(self) -> FP8Weight:
        s = self.scheme
        data = saturating_cast(self.y + self.offset * self.step, s.format)
        return FP8Weight(data, self.scale, s.format, s.strategy, s.block_size)


class MXLearnedRounding(nn.Module):
    def __init__(self, w: torch.Tensor, scheme: MXScheme):
        super().__init__()
        scheme.check_weight(w, "weight")
        self.scheme = scheme
        w = w.detach().float()
        self.register_buffer("exponents", block_exponents(w))
        self.register_buffer("scale", element_scales(self.exponents))
        self.register_buffer("y", w / self.scale)
        self.register_buffer("step", float_step(self.y, "e2m1"))
        self.offset = nn.Parameter(torch.zeros_like(w))

    def fake_weight(self) -> torch.Tensor:
        shifted = self.y + self.offset * self.step
        held = e2m1_values(e2m1_codes(shifted.detach()))
        return straight_through(held, shifted.clamp(-E2M1_MAX, E2M1_MAX)) * self.scale

    @torch.no_grad()
    def keep_in_range(self) -> None:
        self.offset.clamp_(-0.5, 0.5)

    @torch.no_grad()
    def weight(self) -> MXWeight:
        return MXWeight(e2m1_codes(self.y + self.offset * self.step), self.exponents)
