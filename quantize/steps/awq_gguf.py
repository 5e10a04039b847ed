"""AWQ's clip search on GGUF grids (its scale search needs nothing of its own: it fake-quantizes each
linear with the GGML type it will be written in, GGUFScheme.fake_round, as on any grid). Each
32-weight block is clipped and that type's quantizer chooses its block scales on the clipped weights,
judged by the block's output error through its input second moments."""
from __future__ import annotations

import torch

from lowbit.quantize.grids.gguf import SEARCH_BLOCK


def blocks(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], -1, SEARCH_BLOCK)


@torch.no_grad()
def search_clip_gguf(w: torch.Tensor, gram: torch.Tensor, quantize, max_shrink: float, clip_grid: int) -> torch.Tensor:
    """w (out, in) with each 32-block clipped to the fraction of its range whose quantized values
    (by `quantize`, the linear's GGML type) give the least output error dᵀ C_g d."""
    g = blocks(w.float())
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    best_err = torch.full(g.shape[:2], float("inf"))
    best = g
    for k in range(int(max_shrink * clip_grid) + 1):
        ratio = 1 - k / clip_grid
        clipped = torch.maximum(torch.minimum(g, hi * ratio), lo * ratio)
        d = (g - blocks(quantize(clipped.reshape(w.shape)))).transpose(0, 1)  # (G, rows, 32)
        err = (torch.bmm(d, gram) * d).sum(dim=-1).t()  # (rows, G)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better.unsqueeze(-1), clipped, best)
    return best.reshape(w.shape).to(w.dtype)
