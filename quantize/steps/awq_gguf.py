"""AWQ's searches on GGUF grids: the scale search fake-quantizes each linear with the GGML type
it will be written in (llama.cpp's reference rounding, as gguf_rounding does), and the clip search
clips each 32-weight block and lets that type's quantizer choose its block scales on the clipped
weights, judged by the block's output error through its input second moments."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.quantize.grids.gguf import GGUFScheme, quantize_gguf

BLOCK = 32  # the smallest GGML block (Q4_K's sub-blocks too): magnitudes and clips per 32 weights


@dataclass(frozen=True)
class GGUFSearchGrid:
    """What AWQ's searches assume under a llama.cpp file type: each linear's own GGML type."""

    types: dict  # full linear name -> GGUFScheme
    group_size: int = BLOCK

    def quantizer(self, name: str):
        scheme: GGUFScheme = self.types[name]
        return lambda w: quantize_gguf(w.float(), scheme, name).dequantize().to(w.dtype)


def blocks(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], -1, BLOCK)


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
