"""AWQ's clip search on any grid by its own rounding (GGUF blocks, FP8 rows): each search group
(grid.search_groups) is clipped to a fraction of its range, the grid's round-to-nearest chooses its
scales on the clipped weights (grid.fake_round), and each group's choice is judged by the output
error it causes through its input second moments. Integer grids have a search of their own
(quantize/steps/awq.py's search_clip), which shrinks the scales directly."""
from __future__ import annotations

import torch


@torch.no_grad()
def search_clip_rounded(w: torch.Tensor, gram: torch.Tensor, grid, name: str, max_shrink: float,
                        clip_grid: int) -> torch.Tensor:
    """w (out, in) with each search group clipped to the fraction of its range whose rounded values
    give the least output error dᵀ C_g d (gram: (G, group, group), C_g per group)."""
    g = grid.search_groups(w.float())  # (rows, G, group)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    best_err = torch.full(g.shape[:2], float("inf"))
    best = g
    for k in range(int(max_shrink * clip_grid) + 1):
        ratio = 1 - k / clip_grid
        clipped = torch.maximum(torch.minimum(g, hi * ratio), lo * ratio)
        rounded = grid.fake_round(clipped.reshape(w.shape), name=name)
        d = (g - grid.search_groups(rounded)).transpose(0, 1)  # (G, rows, group)
        err = (torch.bmm(d, gram) * d).sum(dim=-1).t()  # (rows, G)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better.unsqueeze(-1), clipped, best)
    return best.reshape(w.shape).to(w.dtype)
