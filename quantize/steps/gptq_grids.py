"""The grids GPTQ's column sweep rounds onto: scales fixed before the sweep (per channel, per group,
per element by a grid's sweep view) or group scales computed when the sweep reaches each group
(act-order groups)."""
from __future__ import annotations

from typing import Optional

import torch

from lowbit.quantize.grids.gguf import GGUFScheme, GGUFWeight, grid_values, nearest_levels, quantize_gguf
from lowbit.quantize.grids.gguf_weighted import quantize_weighted
from lowbit.quantize.grids.integer import (IntScheme, compute_scale_zero, fake_quantize_with_codes, grouped,
                                          scale_zero_from_range)
from lowbit.quantize.grids.scale_search import search_scale_zero


class FixedElementGrid:
    """Scales per element (rows, cols) in processing order, fixed before GPTQ runs; the grid's view
    snaps each column under its scales (FP8, MXFP4)."""

    def __init__(self, scale: torch.Tensor, snap):
        self.scale_t, self.snap = scale.t(), snap  # a column's scales: one row here (a view, no copy)

    def begin(self, j: int, Wt_rest: torch.Tensor) -> None:
        pass

    def quantize(self, j: int, w: torch.Tensor) -> torch.Tensor:
        return self.snap(w, self.scale_t[j])


class GGUFColumnGrid:
    """GGUF sub-block grids, S and M per element (rows, cols) in processing order, fixed before
    GPTQ runs; keeps each column's levels, which pack as they are."""

    def __init__(self, S: torch.Tensor, M: Optional[torch.Tensor], scheme: GGUFScheme):
        self.S_t, self.scheme = S.t(), scheme  # a column's grid: one row here (a view, no copy)
        self.M_t = None if M is None else M.t()
        self.levels_t = torch.empty(self.S_t.shape, dtype=torch.int16, device=S.device)

    def begin(self, j: int, Wt_rest: torch.Tensor) -> None:
        pass

    def quantize(self, j: int, w: torch.Tensor) -> torch.Tensor:
        s, m = self.S_t[j], None if self.M_t is None else self.M_t[j]
        q = self.levels_t[j] = nearest_levels(w, s, m, self.scheme)
        return grid_values(q, s, m, self.scheme)


class LazyGGUFColumnGrid(GGUFColumnGrid):
    """GGUF blocks whose scales (and mins) are searched when the sweep reaches each block, from the
    weights as GPTQ has updated them so far (columns in order): the errors pushed onto a block
    are fitted by its scale as well as by its levels."""

    def __init__(self, rows: int, cols: int, scheme: GGUFScheme, device, importance=None, sigma2=None):
        super().__init__(torch.zeros(rows, cols, device=device), None, scheme)
        self.S_t = self.S_t.contiguous()  # filled block by block
        self.M_t = torch.zeros_like(self.S_t) if scheme.layout.has_min else None
        self.importance, self.sigma2 = importance, sigma2  # (cols,), (rows, 1): of the whole rows
        self.blocks: list[GGUFWeight] = []

    def begin(self, j: int, Wt_rest: torch.Tensor) -> None:
        size = self.scheme.block_size
        if j % size:
            return
        W = Wt_rest[:size].t()  # (rows, size), current values
        if self.importance is None:
            part = quantize_gguf(W, self.scheme)
        else:
            part = quantize_weighted(W, self.scheme, self.importance[j : j + size], self.sigma2)
        S, M = part.sub_scale_offset()
        sub = self.scheme.layout.sub
        self.S_t[j : j + size] = S.repeat_interleave(sub, dim=1).t()
        if M is not None:
            self.M_t[j : j + size] = M.repeat_interleave(sub, dim=1).t()
        self.blocks.append(part)

    def weight(self) -> GGUFWeight:
        """The solved weight: every block's fields side by side, the sweep's levels."""
        def joined(field):
            parts = [getattr(b, field) for b in self.blocks]
            return None if parts[0] is None else torch.cat(parts, dim=1)
        return GGUFWeight(self.scheme, self.levels_t.t().contiguous(), joined("d"), joined("dmin"),
                          joined("sub_scale"), joined("sub_min"))


class FixedColumnGrid:
    """Scales fixed before GPTQ runs (per channel, or per group of the original column order)."""

    def __init__(self, W: torch.Tensor, perm: Optional[torch.Tensor], scheme: IntScheme,
                 importance: Optional[torch.Tensor] = None):
        self.scheme = scheme
        inverse = None if perm is None else torch.argsort(perm)
        weight = importance if importance is None or perm is None else importance[inverse]
        # a block of rows at a time (rows are independent): the weight in its original column order is
        # a block's copy, not a second weight beside the sweep's (0.22 GiB for a Llama-3-8B down_proj)
        blocks = [slice(None)] if scheme.strategy == "tensor" else [
            slice(start, start + self.ROWS) for start in range(0, W.shape[0], self.ROWS)]
        found = [self._scale_zero(W[b] if perm is None else W[b][:, inverse], weight, scheme) for b in blocks]
        self.scale = torch.cat([scale for scale, _ in found])  # (rows, G)
        self.zero = None if found[0][1] is None else torch.cat([zero for _, zero in found])
        group = torch.zeros(W.shape[1], dtype=torch.long, device=W.device)
        if scheme.strategy == "group":
            order = perm if perm is not None else torch.arange(W.shape[1], device=W.device)
            group = order // scheme.group_size
        self.column_group = group  # processing position -> group index
        self._groups = group.tolist()  # plain ints: cheap to index in the per-column loop

    ROWS = 1024  # search_scale_zero's own block: the same calls, the same bits

    @staticmethod
    def _scale_zero(original: torch.Tensor, weight: Optional[torch.Tensor], scheme: IntScheme):
        if weight is None:
            return compute_scale_zero(original, scheme)
        return search_scale_zero(grouped(original.contiguous(), scheme), grouped(weight[None], scheme)[0], scheme)

    def begin(self, j: int, Wt_rest: torch.Tensor) -> None:
        pass

    def column(self, j: int):
        g = self._groups[j]
        return self.scale[:, g], None if self.zero is None else self.zero[:, g]

    def quantize_with_codes(self, j: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fake_quantize_with_codes(w, *self.column(j), self.scheme.qmin, self.scheme.qmax)

    def result(self):
        return self.scale.float(), self.zero


class LazyColumnGrid:
    """Group scales computed when GPTQ reaches a group, from the already-updated weights."""

    def __init__(self, rows: int, cols: int, scheme: IntScheme, device, importance=None):
        self.scheme, self.size, self.importance = scheme, scheme.group_size, importance
        self.scale = torch.ones(rows, cols // self.size, device=device)
        self.zero = None if scheme.symmetric else torch.zeros(rows, cols // self.size, device=device)
        self.column_group = torch.arange(cols, device=device) // self.size

    def begin(self, j: int, Wt_rest: torch.Tensor) -> None:
        if j % self.size == 0:  # Wt_rest: (columns from j on, rows), current values
            g = Wt_rest[: self.size]
            if self.importance is None:
                scale, zero = scale_zero_from_range(g.amin(dim=0), g.amax(dim=0), self.scheme)
            else:
                weight = self.importance[j : j + self.size]
                scale, zero = search_scale_zero(g.t()[:, None], weight[None], self.scheme)
                scale, zero = scale[:, 0], None if zero is None else zero[:, 0]
            self.scale[:, j // self.size] = scale
            if zero is not None:
                self.zero[:, j // self.size] = zero

    def column(self, j: int):
        g = j // self.size
        return self.scale[:, g], None if self.zero is None else self.zero[:, g]

    def quantize_with_codes(self, j: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fake_quantize_with_codes(w, *self.column(j), self.scheme.qmin, self.scheme.qmax)

    def result(self):
        return self.scale, self.zero
