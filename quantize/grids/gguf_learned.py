"""The GGML block grids' learned-rounding view: the block scales (and mins) stay those llama.cpp's
reference quantizer chooses, so every block field is stored as llama.cpp would store it, and what is
learned is an offset per weight in [-0.5, 0.5] of its grid's step, added before the nearest level is
taken (through a straight-through round). The I-quants' levels are uneven: their step is the
codebook's mean spacing. At offset 0 each weight takes its nearest level on the scales as stored: llama.cpp's own level
but where it rounded on the scale before storing it in fp16 (Q8_0: about 1 weight in 100) or broke a
tie the other way."""
from __future__ import annotations

import torch
from torch import nn

from lowbit.quantize.grids.gguf import GGUFScheme, GGUFWeight, grid_values, nearest_levels, quantize_gguf
from lowbit.quantize.grids.integer_learned import straight_through


def _per_weight(t, sub: int):
    return None if t is None else t.repeat_interleave(sub, dim=-1)


class GGUFLearnedRounding(nn.Module):
    def __init__(self, w: torch.Tensor, scheme: GGUFScheme):
        super().__init__()
        self.scheme = scheme
        w = w.detach().float()
        self.reference = quantize_gguf(w, scheme)  # its block fields are kept; its levels are not
        S, M = self.reference.sub_scale_offset()
        sub = scheme.layout.sub
        self.register_buffer("w", w)
        self.register_buffer("S", _per_weight(S, sub))
        self.register_buffer("M", _per_weight(M, sub))
        codebook = scheme.layout.codebook
        spacing = 1.0 if codebook is None else (max(codebook) - min(codebook)) / (len(codebook) - 1)
        self.register_buffer("step", self.S.abs() * spacing)
        self.offset = nn.Parameter(torch.zeros_like(w))

    def _levels(self, shifted: torch.Tensor) -> torch.Tensor:
        return nearest_levels(shifted.detach(), self.S, self.M, self.scheme)

    def fake_weight(self) -> torch.Tensor:
        shifted = self.w + self.offset * self.step
        held = grid_values(self._levels(shifted), self.S, self.M, self.scheme)
        return straight_through(held, shifted)

    @torch.no_grad()
    def keep_in_range(self) -> None:
        self.offset.clamp_(-0.5, 0.5)

    @torch.no_grad()
    def weight(self) -> GGUFWeight:
        ref = self.reference
        levels = self._levels(self.w + self.offset * self.step)
        return GGUFWeight(self.scheme, levels, ref.d, ref.dmin, ref.sub_scale, ref.sub_min)
