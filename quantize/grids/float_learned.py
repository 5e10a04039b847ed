"""The float grids' learned-rounding views (FP8 E4M3/E5M2, MXFP4's E2M1): per weight an offset in
[-0.5, 0.5] of the format's spacing where the weight lies (its binade's step, or the subnormal step),
added before the cast rounds to the nearest value, through a straight-through round. FP8 learns its
clipping too, a factor in [0.5, 1] on each scale's absolute maximum; MXFP4's scales are powers of two
chosen by the block's maximum, a step no gradient crosses, so they stay as round-to-nearest sets
them. At offset 0 and factor 1 each view is its grid's round-to-nearest, bit for bit."""
from __future__ import annotations

import torch
from torch import nn

from lowbit.quantize.grids.fp8 import (FP8Scheme, FP8Weight, element_scale, fp8_max, saturating_cast,
                                       scale_from_absmax, weight_absmax)
from lowbit.quantize.grids.integer_learned import straight_through
from lowbit.quantize.grids.mxfp4 import MXScheme, MXWeight, block_exponents, e2m1_codes, e2m1_values, element_scales

# format -> (mantissa bits, exponent of the smallest normal value)
SPACING = {"e4m3": (3, -6), "e5m2": (2, -14), "e2m1": (1, 0)}
E2M1_MAX = 6.0
FACTOR_FLOOR = 0.5  # clipping at most halves a scale's range


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
        self.register_buffer("w", w)
        self.register_buffer("absmax", weight_absmax(w, scheme.strategy, scheme.block_size))
        self.offset = nn.Parameter(torch.zeros_like(w))
        self.factor = nn.Parameter(torch.ones_like(self.absmax))

    def _scale(self) -> torch.Tensor:
        return scale_from_absmax(self.absmax * self.factor, self.scheme.format)

    def _shifted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w over its scales, moved by the learned offsets; and the scales, one per weight."""
        s = self.scheme
        scale = element_scale(self._scale(), self.w.shape, s.strategy, s.block_size)
        y = self.w / scale
        return y + self.offset * float_step(y.detach(), s.format), scale

    def fake_weight(self) -> torch.Tensor:
        shifted, scale = self._shifted()
        top = fp8_max(self.scheme.format)
        held = saturating_cast(shifted.detach(), self.scheme.format).float()
        return straight_through(held, shifted.clamp(-top, top)) * scale

    @torch.no_grad()
    def keep_in_range(self) -> None:
        self.offset.clamp_(-0.5, 0.5)
        self.factor.clamp_(FACTOR_FLOOR, 1.0)

    @torch.no_grad()
    def weight(self) -> FP8Weight:
        s = self.scheme
        shifted, _ = self._shifted()
        return FP8Weight(saturating_cast(shifted, s.format), self._scale(), s.format, s.strategy, s.block_size)


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
