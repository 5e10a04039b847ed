"""llama.cpp's 4-bit non-linear quants, IQ4_NL and IQ4_XS, as `llama-quantize` writes them
(quantize_iq4_nl and quantize_iq4_xs in ggml-quants.c, which both run quantize_row_iq4_nl_impl
with 7 trial scales either side of the first guess), vectorised over blocks.

Both store, per 32 weights, 4-bit indices into 16 int8 values spaced more closely near 0
(kvalues_iq4nl): IQ4_NL with one fp16 scale per 32; IQ4_XS with one fp16 scale per 256 and a
6-bit signed multiplier per 32 (4.25 bits per weight). Each 32-weight block's scale is the
weighted least-squares fit over 16 candidate index assignments (weight x² without an importance
matrix); IQ4_XS then rounds each block's scale to a multiple of the super-block's, and both
re-pick every index against the final, unrounded scale. Sums run left to right as the C loops
take them: the fits compare near-equal sums.

Each function takes blocks (N, 32) or super-blocks (N, 256) float32 and returns GGUFWeight fields
(levels are indices into VALUES, 0..15), so this file needs nothing from gguf.py.
"""
from __future__ import annotations

import torch

from lowbit.quantize.grids.gguf_kquants import GROUP_MAX_EPS, fast_sum, ordered_sum

VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl
TRIES = 7  # quantize_iq4_nl / quantize_iq4_xs: trial scales at (itry + values[0]) / max, itry in -7..7
XS_SUB_RANGE = (-32, 31)  # IQ4_XS's 6-bit block multipliers, stored + 32


def iq4_nl_reference(x: torch.Tensor, weights: torch.Tensor | None = None) -> dict:
    """weights (as x): importance of each weight's error; None: llama.cpp's own (x², no imatrix)."""
    values = codebook(x.device)
    scales = block_scales(x, weights, values)  # (N,) the fitted scale, unrounded
    inverse = reciprocal(scales)
    levels = nearest_index(inverse[:, None] * x, values)
    return {"levels": levels, "d": scales[:, None].half()}


def iq4_xs_reference(x: torch.Tensor, weights: torch.Tensor | None = None) -> dict:
    values = codebook(x.device)
    blocks = x.reshape(-1, 32)
    scales = block_scales(blocks, None if weights is None else weights.reshape(-1, 32), values).reshape(-1, 8)
    largest = scales.gather(1, scales.abs().argmax(dim=1, keepdim=True))  # signed, first of equal magnitudes
    largest = torch.where(largest.abs() > 0, largest, 0.0)
    d = -largest / 32  # -0.0 for an all-zero super-block, as C writes it
    inverse = reciprocal(d)
    multiplier = torch.round(inverse * scales).clamp(*XS_SUB_RANGE)  # nearest_int: ties to even
    block_scale = (d * multiplier).reshape(-1, 1)  # the unrounded d, as the C rounds against it
    block_inverse = reciprocal(block_scale)
    levels = nearest_index(block_inverse * blocks, values).reshape(x.shape)
    return {"levels": levels, "d": d.half(), "sub_scale": multiplier.to(torch.int16)}


def block_scales(x: torch.Tensor, weights: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """(N,) each 32-weight block's scale: the best weighted fit over the first guess (the block's
    largest magnitude on the codebook's end) and 15 trial scales; 0 for an all-zero block."""
    ordered = weights is None  # llama.cpp's own path, bit for bit; with weights, torch's faster sums
    w = x * x if weights is None else weights
    signed_max = x.gather(1, x.abs().argmax(dim=1, keepdim=True))[:, 0]  # first of equal magnitudes
    zero = signed_max.abs() < GROUP_MAX_EPS
    signed_max = torch.where(zero, 1.0, signed_max)
    first = -signed_max / values[0]
    sum_qx, sum_q2 = _fit_sums(x, w, 1 / first, values, ordered)
    scale = torch.where(sum_q2 > 0, sum_qx / torch.where(sum_q2 > 0, sum_q2, 1.0), 0.0)
    best = scale * sum_qx
    for step in range(-TRIES, TRIES + 1):
        trial_qx, trial_q2 = _fit_sums(x, w, (step + values[0]) / signed_max, values, ordered)
        better = (trial_q2 > 0) & (trial_qx * trial_qx > best * trial_q2)
        scale = torch.where(better, trial_qx / torch.where(better, trial_q2, 1.0), scale)
        best = torch.where(better, scale * trial_qx, best)
    return torch.where(zero, 0.0, scale)


def _fit_sums(x, w, inverse, values, ordered):
    """Σ w·q·x and Σ w·q² for the codebook values q nearest inverse · x, each product in C's order."""
    q = values[nearest_index(inverse[:, None] * x, values).long()]
    wq = w * q
    _sum = ordered_sum if ordered else fast_sum
    return _sum(wq * x), _sum(wq * q)


def nearest_index(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(int16) index of the value nearest each x, as best_index_int8 picks it: the upper of two at a
    tie, each distance taken in float32."""
    upper = _values_at_or_below(x, values).clamp(1, len(values) - 1)  # values[upper-1] <= x, for x >= values[0]
    below, above = values[upper - 1], values[upper]
    return torch.where(x - below < above - x, upper - 1, upper).to(torch.int16)


def _values_at_or_below(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """How many codebook values are <= each x (searchsorted right=True), by table: the values are
    integers, so v <= x exactly when v <= floor(x). A search per element is ~100x slower, and AWQ's
    and GPTQ's scale searches round whole matrices hundreds of times."""
    low, high = int(values[0]), int(values[-1])
    table = torch.searchsorted(values, torch.arange(low - 1, high + 1, dtype=values.dtype, device=values.device),
                               right=True)
    at = torch.floor(x.nan_to_num(nan=high)).clamp(low - 1, high) - (low - 1)
    return table[at.long()]
def reciprocal(t: torch.Tensor) -> torch.Tensor:
    """1 / t, and 0 where t is 0 (the C's `d ? 1/d : 0.f`)."""
    return torch.where(t != 0, 1 / torch.where(t != 0, t, 1.0), 0.0)


def codebook(device) -> torch.Tensor:
    return torch.tensor(VALUES, dtype=torch.float32, device=device)
