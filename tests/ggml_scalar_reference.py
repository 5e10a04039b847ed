"""A slow scalar oracle for the K-quant reference searches: one sub-block at a time, every sum
accumulated left to right in numpy float32, as ggml-quants.c's quantize_row_q4_K_ref /
quantize_row_q6_K_ref (make_qkx2_quants, make_qx_quants) run in C. Test use only: it checks that
the vectorised searches in quantize/grids/gguf_kquants.py pick the same scales and levels."""
from __future__ import annotations

import numpy as np

f32 = np.float32


def nearest(v) -> int:
    return int(np.round(f32(v)))  # half to even, as nearest_int's 1.5·2^23 trick


def qkx2(x, w, nmax, rmin, rdelta, nstep):
    lo, hi = min(f32(0), x.min()), x.max()
    sum_w, sum_x = f32(0), f32(0)
    for xi, wi in zip(x, w):
        sum_w, sum_x = f32(sum_w + wi), f32(sum_x + f32(wi * xi))
    if hi == lo:
        return f32(0), f32(-lo), [0] * len(x)

    def levels(iscale, lo):
        return [max(0, min(nmax, nearest(f32(iscale * f32(xi - lo))))) for xi in x]

    def error(levels, scale, lo):
        total = f32(0)
        for xi, wi, li in zip(x, w, levels):
            diff = f32(f32(f32(scale * f32(li)) + lo) - xi)
            total = f32(total + f32(wi * f32(diff * diff)))
        return total

    iscale = f32(f32(nmax) / f32(hi - lo))
    scale = f32(f32(1) / iscale)
    best_levels = levels(iscale, lo)
    best = error(best_levels, scale, lo)
    for step in range(nstep + 1):
        iscale = f32(f32(f32(f32(rmin) + f32(f32(rdelta) * f32(step))) + f32(nmax)) / f32(hi - lo))
        trial = levels(iscale, lo)
        sl = sl2 = sxl = f32(0)
        for xi, wi, li in zip(x, w, trial):
            wl = f32(wi * f32(li))
            sl, sl2, sxl = f32(sl + wl), f32(sl2 + f32(wl * f32(li))), f32(sxl + f32(wl * xi))
        D = f32(f32(sum_w * sl2) - f32(sl * sl))
        if D > 0:
            this_scale = f32(f32(f32(sum_w * sxl) - f32(sum_x * sl)) / D)
            this_min = f32(f32(f32(sl2 * sum_x) - f32(sl * sxl)) / D)
            if this_min > 0:
                this_min, this_scale = f32(0), f32(sxl / sl2)
            err = error(trial, this_scale, this_min)
            if err < best:
                best_levels, best, scale, lo = trial, err, this_scale, this_min
    return scale, f32(-lo), best_levels


def q4_k_block(x: np.ndarray) -> dict:
    """One 256-weight super-block: d, dmin (fp16), 6-bit scales and mins, levels 0..15."""
    scales, mins, search = [], [], []
    for j in range(8):
        sub = x[32 * j:32 * j + 32]
        sum_x2 = f32(0)
        for v in sub:
            sum_x2 = f32(sum_x2 + f32(v * v))
        av_x = np.sqrt(f32(sum_x2 / f32(32)))
        s, m, levels = qkx2(sub, [f32(av_x + abs(v)) for v in sub], 15, -1.0, 0.1, 20)
        scales.append(s), mins.append(m), search.extend(levels)
    max_scale, max_min = max([f32(0)] + scales), max([f32(0)] + mins)
    inv_scale = f32(63) / max_scale if max_scale > 0 else f32(0)
    inv_min = f32(63) / max_min if max_min > 0 else f32(0)
    ls = [min(63, nearest(f32(inv_scale * s))) for s in scales]
    lm = [min(63, nearest(f32(inv_min * m))) for m in mins]
    d, dmin = np.float16(max_scale / f32(63)), np.float16(max_min / f32(63))
    levels = list(search)
    for j in range(8):
        dj = f32(f32(d) * f32(ls[j]))
        if dj == 0:
            continue
        dm = f32(f32(dmin) * f32(lm[j]))
        for i in range(32 * j, 32 * j + 32):
            levels[i] = max(0, min(15, nearest(f32(f32(x[i] + dm) / dj))))
    return {"d": d, "dmin": dmin, "sub_scale": ls, "sub_min": lm, "levels": levels}


def qx(x, nmax):
    amax, signed_max = f32(0), f32(0)
    for v in x:
        if abs(v) > amax:
            amax, signed_max = abs(v), v
    if amax < 1e-15:
        return f32(0), [-nmax] * len(x)

    def fit(iscale):
        levels = [max(-nmax, min(nmax - 1, nearest(f32(iscale * v)))) for v in x]
        slx = sl2 = f32(0)
        for v, li in zip(x, levels):
            w = f32(v * v)
            slx, sl2 = f32(slx + f32(f32(w * v) * f32(li))), f32(sl2 + f32(f32(w * f32(li)) * f32(li)))
        return levels, slx, sl2

    best_levels, slx, sl2 = fit(f32(f32(-nmax) / signed_max))
    scale = f32(slx / sl2) if sl2 else f32(0)
    best = f32(scale * slx)
    for step in [s for s in range(-9, 10) if s != 0]:
        levels, slx, sl2 = fit(f32(-f32(f32(nmax) + f32(f32(0.1) * f32(step))) / signed_max))
        if sl2 > 0 and f32(slx * slx) > f32(best * sl2):
            best_levels, scale = levels, f32(slx / sl2)
            best = f32(scale * slx)
    return scale, best_levels


def q6_k_block(x: np.ndarray) -> dict:
    scales, search = [], []
    for j in range(16):
        s, levels = qx(x[16 * j:16 * j + 16], 32)
        scales.append(s), search.extend(levels)
    max_abs, max_scale = f32(0), f32(0)
    for s in scales:
        if abs(s) > max_abs:
            max_abs, max_scale = abs(s), s
    if max_abs < 1e-15:
        return {"d": np.float16(0), "sub_scale": [0] * 16, "levels": [-32] * 256}
    iscale = f32(f32(-128) / max_scale)
    d = np.float16(f32(1) / iscale)
    sc = [min(127, nearest(f32(iscale * s))) for s in scales]
    levels = list(search)
    for j in range(16):
        dj = f32(f32(d) * f32(sc[j]))
        if dj == 0:
            continue
        for i in range(16 * j, 16 * j + 16):
            levels[i] = max(-32, min(31, nearest(f32(x[i] / dj))))
    return {"d": d, "sub_scale": sc, "levels": levels}
