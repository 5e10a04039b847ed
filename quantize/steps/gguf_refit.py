"""Block scales refitted to GPTQ's levels: with the levels a sweep chose held fixed, each row's
block scales (and Q4_1's mins) that minimise the layer's output error (w - ŵ)ᵀ H (w - ŵ) solve a
small linear system, one unknown per block (two for Q4_1). The scales the sweep rounded onto
were chosen before it, from the unrounded weights; these fit what it actually chose.

Only the legacy types hold one free fp16 scale per block; the K-quants' 6-bit sub-scales are
not least-squares variables, so their scales stay as searched.
"""
from __future__ import annotations

import dataclasses

import torch

from lowbit.quantize.grids.gguf import GGUFWeight

REFITTABLE = ("q8_0", "q4_0", "q4_1", "q5_0")
ROWS_PER_SOLVE = 64  # bounds the (rows, unknowns, unknowns, block) intermediate


def refit_block_scales(W: torch.Tensor, H: torch.Tensor, weight: GGUFWeight) -> GGUFWeight:
    """weight with each block's d (and Q4_1's m) re-solved for its levels against W (rows, cols)
    under H (cols, cols, already damped); fp16 as the file stores them."""
    kind, size = weight.scheme.type, weight.scheme.block_size
    if kind not in REFITTABLE:
        raise ValueError(f"block scales of GGUF {kind} cannot be refitted; only {', '.join(REFITTABLE)}")
    rows, cols = W.shape
    blocks = cols // size
    levels = weight.levels.float().reshape(rows, blocks, size)
    affine = weight.dmin is not None
    # one basis vector per unknown, nonzero on its block: levels for d, ones for Q4_1's m
    basis = torch.cat([levels, torch.ones_like(levels)], dim=1) if affine else levels  # (rows, p, size)
    block_of = torch.arange(blocks, device=W.device).repeat(2 if affine else 1)  # unknown -> block
    H_blocks = H.reshape(blocks, size, blocks, size)[block_of][:, :, block_of]  # (p, size, p, size)
    HW = (W.float() @ H).reshape(rows, blocks, size)[:, block_of]  # (rows, p, size)
    old = torch.cat([weight.d.float(), weight.dmin.float()], dim=1) if affine else weight.d.float()
    new = torch.empty_like(old)
    for r in range(0, rows, ROWS_PER_SOLVE):
        z = basis[r : r + ROWS_PER_SOLVE]
        gram = torch.einsum("rpi,piqj,rqj->rpq", z, H_blocks, z)
        rhs = (z * HW[r : r + ROWS_PER_SOLVE]).sum(dim=-1)
        new[r : r + ROWS_PER_SOLVE] = _ridge_solve(gram, rhs, old[r : r + ROWS_PER_SOLVE])
    new = new.half()
    refitted = dataclasses.replace(weight, d=new[:, :blocks], dmin=new[:, blocks:] if affine else None)
    return _better_rows(W, H, weight, refitted)


def _better_rows(W: torch.Tensor, H: torch.Tensor, old: GGUFWeight, new: GGUFWeight) -> GGUFWeight:
    """Per row, whichever of old and new has the smaller error: rounding the solved scales to fp16
    can cost a row that was already (nearly) exact more than the solve gained."""
    def row_error(weight):
        D = W.float() - weight.dequantize()
        return ((D @ H) * D).sum(dim=1)
    keep_new = (row_error(new) <= row_error(old))[:, None]
    return dataclasses.replace(new, d=torch.where(keep_new, new.d, old.d),
                               dmin=None if new.dmin is None else torch.where(keep_new, new.dmin, old.dmin))


def _ridge_solve(gram: torch.Tensor, rhs: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Solve gram·x = rhs per row, pulled very slightly towards the old values so that a block
    whose levels are all zero (a singular row of gram) keeps its scale."""
    ridge = 1e-6 * gram.diagonal(dim1=1, dim2=2).mean(dim=1).clamp(min=1e-30)[:, None]  # (rows, 1)
    eye = torch.eye(gram.shape[1], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + ridge[:, :, None] * eye, rhs + ridge * old)
