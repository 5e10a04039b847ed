"""Round-to-nearest on searched ranges: each group's (or channel's) min/max range is shrunk to the
factor in [1 - max_shrink, 1] with the least squared rounding error of its own weights. No data:
as fast as RTN, and clipping a few outliers buys finer steps for every other weight (the idea behind
llama.cpp's and HQQ's data-free range searches)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.quantize.grids.integer import IntScheme, QuantizedWeight, grouped, quantize_codes
from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.grids.scale_search import search_scale_zero
from lowbit.quantize.steps.rtn import round_each
from lowbit.quantize.steps.spec import StepSpec


@dataclass(frozen=True)
class RTNMSEConfig:
    scheme: IntScheme = IntScheme()
    steps: int = 20  # shrink factors tried: 1, 1 - max_shrink / steps, ..., 1 - max_shrink
    max_shrink: float = 0.5

    def __post_init__(self):
        if self.steps < 1 or not 0.0 <= self.max_shrink < 1.0:
            raise ValueError(f"steps must be >= 1 and max_shrink in [0, 1), got {self.steps}, {self.max_shrink}")


def quantize_mse(w: torch.Tensor, cfg: RTNMSEConfig) -> QuantizedWeight:
    """w (out, in) on cfg.scheme's grid, each scale's range chosen for the least squared error."""
    groups = grouped(w.float(), cfg.scheme)  # (rows, G, size)
    scale, zero = search_scale_zero(groups, torch.ones_like(groups[0]), cfg.scheme, cfg.steps, cfg.max_shrink)
    return QuantizedWeight(quantize_codes(w, scale, zero, cfg.scheme), scale.float(), zero, cfg.scheme)


def apply(ctx, cfg: RTNMSEConfig) -> dict:
    return round_each(ctx, cfg.scheme, "rtn_mse", lambda w, name: quantize_mse(w, cfg))


SPEC = StepSpec("rtn_mse", RTNMSEConfig, apply,
                "round-to-nearest on ranges searched for the least squared rounding error (no data)",
                writes=lambda cfg: LinearScheme(cfg.scheme))
