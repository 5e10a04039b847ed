"""Range search for integer grids: shrink a group's min/max range to the least weighted rounding
error (clipping a few outliers can cost less than coarse steps for every other weight)."""
from __future__ import annotations

import torch

from lowbit.quantize.grids.integer import IntScheme, fake_quantize, scale_zero_from_range


def search_scale_zero(groups: torch.Tensor, weight: torch.Tensor, scheme: IntScheme,
                      steps: int = 20, max_shrink: float = 0.5):
    """Per group of groups (rows, G, size), the min/max range shrunk by the factor in
    [1 - max_shrink, 1] whose rounding error, weighted per column by weight (G, size), is least.
    Returns scale (rows, G) and zero (rows, G) or None."""
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    best_err = torch.full_like(lo, float("inf"))
    best_scale, best_zero = torch.ones_like(lo), None if scheme.symmetric else torch.zeros_like(lo)
    for i in range(steps + 1):
        shrink = 1 - max_shrink * i / steps
        scale, zero = scale_zero_from_range(lo * shrink, hi * shrink, scheme)
        q = fake_quantize(groups, scale[..., None], None if zero is None else zero[..., None],
                          scheme.qmin, scheme.qmax)
        err = ((q - groups).square() * weight).sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        if zero is not None:
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero
