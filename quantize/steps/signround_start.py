"""signround's start: gptq: each layer's linears solved by GPTQ first, on the Hessians of their inputs
in the layer's float forward over the quantized stream, so that the learned offsets move around the
weights GPTQ rounded (reaching GPTQ's codes and their neighbours) instead of around the float weights."""
from __future__ import annotations

import torch

from lowbit.calibrate.arch import linear_weight
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.grids.integer_learned import IntLearnedRounding
from lowbit.quantize.steps import expert_hessians
from lowbit.quantize.steps.gptq import GPTQConfig, by_grid
from lowbit.quantize.steps.gptq_solver import gptq_solve

# w4a16-gptq's settings: act-order static (scales fixed before the sweep, as the view needs), damping
# 0.1, scales searched against the Hessian's diagonal; every linear of the layer on its float inputs
START_GPTQ = dict(actorder="static", dampening_frac=0.1, scale_search="mse", true_sequential=False)


def refuse_unstartable(grids: dict) -> None:
    for name, grid in grids.items():
        if getattr(grid, "FAMILY", None) != IntScheme.FAMILY or not grid.scales_per_row():
            raise ValueError(f"signround: start gptq starts from GPTQ's per-channel or per-group integer solve; "
                             f"{name} is planned onto {grid.describe()}: use start nearest for it")


def gptq_views(prefix: str, layer, grids: dict, hessians: dict, sharing: dict, device) -> tuple[dict, dict]:
    """Each linear's learned view, started at its GPTQ solve on collect_hessians' (hessians, sharing);
    and the routed experts too few tokens reached, solved as gptq solves them (round-to-nearest)."""
    fallbacks = expert_hessians.stand_in_starved(prefix, layer, hessians, sharing, {})
    hessians, sharing = expert_hessians.one_expert_per_solve(hessians, sharing)
    views = {}
    for lead, members in sharing.items():
        parts = by_grid(prefix, members, grids)
        H = hessians.pop(lead)
        for k, (grid, group) in enumerate(parts):
            solve_h = H if len(parts) == 1 else (H.matrix() if k < len(parts) - 1 else H.take())
            weights = [linear_weight(layer.get_submodule(n)).to(device).float() for n in group]
            result = gptq_solve(torch.cat(weights), solve_h, GPTQConfig(scheme=grid, **START_GPTQ), pre_round=True)
            row = 0
            for name, w in zip(group, weights):
                rows = slice(row, row + w.shape[0])
                row += w.shape[0]
                part = result.weight.row_slice(rows)
                views[name] = IntLearnedRounding.from_gptq(result.pre_round[rows], part.scale, part.zero, grid)
    return views, fallbacks
