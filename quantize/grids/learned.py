"""The grids a learned-rounding step (signround) trains on, each by its family's view: one line per
grid that has one. A view holds a linear's weight, the parameters it learns, fake_weight() (the
weight as the grid would hold it now, differentiable), keep_in_range() after each update, and
weight(): the learned result, as the grid's own rounding would hand it over."""
from __future__ import annotations

import torch

from lowbit.quantize.grids.float_learned import FP8LearnedRounding, MXLearnedRounding
from lowbit.quantize.grids.fp8 import FP8Scheme
from lowbit.quantize.grids.gguf import GGUFScheme
from lowbit.quantize.grids.gguf_learned import GGUFLearnedRounding
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.grids.integer_learned import IntLearnedRounding
from lowbit.quantize.grids.mxfp4 import MXScheme

VIEWS = {IntScheme.FAMILY: IntLearnedRounding, GGUFScheme.FAMILY: GGUFLearnedRounding,
         FP8Scheme.FAMILY: FP8LearnedRounding, MXScheme.FAMILY: MXLearnedRounding}


def learnable(grid) -> bool:
    return getattr(grid, "FAMILY", None) in VIEWS


def learned_view(grid, w: torch.Tensor):
    return VIEWS[grid.FAMILY](w, grid)
