"""Range search for integer grids: shrink a group's min/max range to the least weighted rounding
error (clipping a few outliers can cost less than coarse steps for every other weight)."""
from __future__ import annotations

import torch

from lowbit.quantize.grids.integer import IntScheme, fake_quantize, scale_zero_from_range


def search_scale_zero(groups: torch.Tensor, weight: torch.Tensor, scheme: IntScheme,
                      steps: int = 20, max_shrink: float = 0.5, rows: int = 1024):
    """Per group of groups (rows, G, size), the min/max range shrunk by the factor in
    [1 - max_shrink, 1] whose rounding error, weighted per column by weight (G, size), is least.
    Returns scale (rows, G) and zero (rows, G) or None. A block of `rows` rows at a time: the
    search's five weight-sized temporaries are a block's (a GPTQ solve of Llama-3-8B's stacked
    gate/up rows: 16 MB each instead of 470 MB)."""
    found = [_search(groups[start : start + rows], weight, scheme, steps, max_shrink)
             for start in range(0, groups.shape[0], rows)]
    scale = torch.cat([s for s, _ in found])
    return scale, None if scheme.symmetric else torch.cat([z for _, z in found])


def _search(groups: torch.Tensor, weight: torch.Tensor, scheme: IntScheme, steps: int, max_shrink: float):
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
