"""llama.cpp's reference (no importance matrix) scale searches for Q4_K, Q5_K and Q6_K, vectorised
over blocks: quantize_row_q4_K_ref and quantize_row_q5_K_ref with make_qkx2_quants,
quantize_row_q6_K_ref with make_qx_quants (ggml-quants.c). Same candidates, same float32
formulas, same tie rules, and every sum taken left to right as the C loops take it (a torch .sum()
adds in another order, and the searches compare near-equal sums: 2 of 24 test blocks chose
differently). A C build that fuses a·b + c
into one FMA rounds differently again; the oracle in tests/ggml_scalar_reference.py is unfused.
The `gguf` package has no K-quant quantizer to compare bytes with.

Each function takes super-blocks (N, 256) float32 and returns the GGUFWeight fields as tensors
(levels with offsets removed), so this file needs nothing from gguf.py.
"""
from __future__ import annotations

import torch

GROUP_MAX_EPS = 1e-15  # ggml-quants.c: a group below this magnitude is all zero


# Q4_K and Q5_K differ only in their levels (0..15, 0..31) and make_qkx2_quants' trial ranges
# (rmin, rdelta, nstep) without an importance matrix; with one both search llama.cpp's finer ranges
_KX2_RANGES = {15: (-1.0, 0.1, 20), 31: (-0.5, 0.1, 15)}
_WEIGHTED_RANGES = (-0.9, 0.05, 36)


def q4_k_reference(x: torch.Tensor, weights: torch.Tensor | None = None) -> dict:
    """weights (as x): importance of each weight's error; None: llama.cpp's own (no imatrix)."""
    return _k_with_min(x, weights, nmax=15)


def q5_k_reference(x: torch.Tensor, weights: torch.Tensor | None = None) -> dict:
    return _k_with_min(x, weights, nmax=31)


def _k_with_min(x: torch.Tensor, weights: torch.Tensor | None, nmax: int) -> dict:
    """Super-blocks of 8 affine sub-blocks of 32, 6-bit scales and mins on fp16 d and dmin."""
    subs = x.reshape(-1, 32)
    if weights is None:
        av_x = exact_sqrt(ordered_sum(subs * subs)[:, None] / 32)
        rmin, rdelta, nstep = _KX2_RANGES[nmax]
        scales, mins, search_levels = _qkx2(subs, av_x + subs.abs(), nmax, rmin, rdelta, nstep)
    else:
        scales, mins, search_levels = _qkx2(subs, weights.reshape(-1, 32), nmax, *_WEIGHTED_RANGES, ordered=False)
    scales, mins = scales.reshape(-1, 8), mins.reshape(-1, 8)
    max_scale = _largest_positive(scales)  # scales are >= 0 as the min is deducted
    max_min = _largest_positive(mins)
    ls = torch.round(_safe_ratio(63.0, max_scale) * scales).clamp(0, 63)
    lm = torch.round(_safe_ratio(63.0, max_min) * mins).clamp(0, 63)
    d, dmin = (max_scale / 63).half(), (max_min / 63).half()
    S = (d.float() * ls).reshape(-1, 1)  # per sub-block of 32
    dm = (dmin.float() * lm).reshape(-1, 1)
    q = torch.round((subs + dm) / torch.where(S == 0, 1.0, S)).clamp(0, nmax)
    levels = torch.where(S == 0, search_levels, q)  # llama.cpp keeps the search's levels there
    return {"levels": levels.reshape(x.shape), "d": d, "dmin": dmin,
            "sub_scale": ls.to(torch.int16), "sub_min": lm.to(torch.int16)}


def q6_k_reference(x: torch.Tensor, weights: torch.Tensor | None = None) -> dict:
    subs = x.reshape(-1, 16)
    scales, search_levels = _qx(subs, nmax=32, w=None if weights is None else weights.reshape(-1, 16),
                                ordered=weights is None)
    scales = scales.reshape(-1, 16)
    max_scale = scales.gather(1, scales.abs().argmax(dim=1, keepdim=True))  # signed, first of equals
    zero = max_scale.abs() < GROUP_MAX_EPS  # llama.cpp writes an all-zero block
    iscale = -128.0 / torch.where(zero, 1.0, max_scale)
    d = torch.where(zero, 0.0, 1 / iscale).half()
    sc = torch.where(zero, 0.0, torch.round(iscale * scales).clamp(max=127))
    S = (d.float() * sc).reshape(-1, 1)
    q = torch.round(subs / torch.where(S == 0, 1.0, S)).clamp(-32, 31)
    levels = torch.where(S == 0, search_levels, q).reshape(x.shape)
    levels = torch.where(zero, -32.0, levels)  # stored 0 in every 6-bit field
    return {"levels": levels, "d": d, "sub_scale": sc.to(torch.int16)}


def _qkx2(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, ordered: bool = True):
    """make_qkx2_quants on rows of x (n, 32) with weights w: scale, min (>= 0, to subtract) and
    levels 0..nmax of the weighted least-squares affine fit over nstep + 1 trial ranges.
    ordered: sums left to right as C does (bit-exact reference); False: torch's faster sums."""
    _sum = ordered_sum if ordered else fast_sum
    lo = x.amin(dim=1).clamp(max=0)
    hi = x.amax(dim=1)
    flat = hi == lo
    sum_w, sum_x = _sum(w), _sum(w * x)
    iscale = nmax / torch.where(flat, 1.0, hi - lo)
    scale = 1 / iscale
    levels = _affine_levels(x, lo, iscale, nmax)
    best = _weighted_error(x, w, levels, scale, lo, _sum)
    for step in range(nstep + 1):
        span = hi - lo  # lo moves to each improvement's min, as in llama.cpp
        numerator = torch.tensor(rmin, dtype=torch.float32) + torch.tensor(rdelta, dtype=torch.float32) * step + nmax
        trial_iscale = numerator / torch.where(span > 0, span, 1.0)
        trial = _affine_levels(x, lo, trial_iscale, nmax)
        wl = w * trial
        sum_l, sum_l2, sum_xl = _sum(wl), _sum(wl * trial), _sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        fit = D > 0
        D = torch.where(fit, D, 1.0)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        positive = this_min > 0  # the min must stay <= 0: refit the scale alone
        this_scale = torch.where(positive, sum_xl / torch.where(fit, sum_l2, 1.0), this_scale)
        this_min = torch.where(positive, 0.0, this_min)
        error = _weighted_error(x, w, trial, this_scale, this_min, _sum)
        better = fit & (span > 0) & (error < best)
        levels = torch.where(better[:, None], trial, levels)
        best = torch.where(better, error, best)
        scale = torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
    return torch.where(flat, 0.0, scale), -lo, torch.where(flat[:, None], 0.0, levels)


def _largest_positive(t: torch.Tensor) -> torch.Tensor:
    """Each row's largest value, or +0.0 where none is positive (C's running maximum from 0: an
    all-zero block's mins are -0.0, and its dmin is stored as +0.0)."""
    top = t.amax(dim=1, keepdim=True)
    return torch.where(top > 0, top, 0.0)


def _affine_levels(x, lo, iscale, nmax):
    return torch.round(iscale[:, None] * (x - lo[:, None])).nan_to_num(0.0).clamp(0, nmax)


def _weighted_error(x, w, levels, scale, lo, _sum):
    diff = scale[:, None] * levels + lo[:, None] - x
    return _sum(w * (diff * diff))


def _qx(x: torch.Tensor, nmax: int, w: torch.Tensor | None = None, ordered: bool = True):
    """make_qx_quants(rmse_type=1) on rows of x (n, k): the signed scale and levels -nmax..nmax-1
    that maximise the w-weighted fit (w = x² unless given) over 19 trial scales around -nmax / max."""
    signed_max = x.gather(1, x.abs().argmax(dim=1, keepdim=True))[:, 0]
    zero = signed_max.abs() < GROUP_MAX_EPS
    signed_max = torch.where(zero, 1.0, signed_max)
    w = x * x if w is None else w
    _sum = ordered_sum if ordered else fast_sum
    levels, sum_lx, sum_l2 = _qx_trial(x, w, -nmax / signed_max, nmax, _sum)
    scale = torch.where(sum_l2 != 0, sum_lx / torch.where(sum_l2 != 0, sum_l2, 1.0), 0.0)
    best = scale * sum_lx
    for step in [s for s in range(-9, 10) if s != 0]:
        offset = torch.tensor(0.1, dtype=torch.float32) * step + nmax
        trial, trial_lx, trial_l2 = _qx_trial(x, w, -offset / signed_max, nmax, _sum)
        better = (trial_l2 > 0) & (trial_lx * trial_lx > best * trial_l2)
        levels = torch.where(better[:, None], trial, levels)
        scale = torch.where(better, trial_lx / torch.where(better, trial_l2, 1.0), scale)
        best = torch.where(better, scale * trial_lx, best)
    return torch.where(zero, 0.0, scale), torch.where(zero[:, None], -nmax, levels)


def _qx_trial(x, w, iscale, nmax, _sum):
    levels = torch.round(iscale[:, None] * x).clamp(-nmax, nmax - 1)
    return levels, _sum(w * x * levels), _sum(w * levels * levels)


def exact_sqrt(t: torch.Tensor) -> torch.Tensor:
    """sqrtf, correctly rounded: torch's float32 sqrt on CPU is off by an ulp for about one value in
    seven with AVX-512 kernels, which moved some of llama.cpp's searches; float64's sqrt rounded back is exact."""
    return torch.sqrt(t.double()).float()


def fast_sum(t: torch.Tensor) -> torch.Tensor:
    return t.sum(dim=1)


def ordered_sum(t: torch.Tensor) -> torch.Tensor:
    """Row sums of t (n, k) in float32, left to right: k small ops over all n rows at once."""
    columns = t.t().contiguous()  # each column one contiguous run: the loop streams memory
    total = columns[0].clone()
    for column in columns[1:]:
        total += column
    return total


def _safe_ratio(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    return torch.where(denominator > 0, numerator / torch.where(denominator > 0, denominator, 1.0), 0.0)
