"""What the audit checks in any quantized module's tensors: scales usable (finite, positive, still so
in the storage dtype), codes and zero points inside their grid. Each runtime module's `audit` uses these
on its own buffers."""
from __future__ import annotations

from typing import Optional

import torch


def static_input_problems(name: str, input_scale, storage_dtype) -> list[str]:
    if input_scale is None:
        return [f"{name}: static input quantization but no input_scale"]
    return scale_problems(f"{name}.input_scale", input_scale, storage_dtype)


def scale_problems(label: str, scale: torch.Tensor, storage_dtype: Optional[torch.dtype] = None) -> list[str]:
    """NaN, inf, zero or negative entries of a scale, also after a cast to its storage dtype."""
    t = scale.detach().float()
    n = t.numel()
    bad = {"NaN": torch.isnan(t), "inf": torch.isinf(t), "zero": t == 0, "negative": t < 0}
    found = [f"{int(mask.sum())} {kind}" for kind, mask in bad.items() if mask.any()]
    if found:
        return [f"{label}: {', '.join(found)} of {n} values"]
    if storage_dtype is not None and storage_dtype != torch.float32:
        stored = t.to(storage_dtype).float()
        lost = int(((stored == 0) | torch.isinf(stored)).sum())
        if lost:
            return [f"{label}: {lost} of {n} values become 0 or inf in {str(storage_dtype).replace('torch.', '')} "
                    f"(range {t.min().item():.3g} .. {t.max().item():.3g})"]
    return []


def range_problems(label: str, values: torch.Tensor, lo: int, hi: int) -> list[str]:
    vmin, vmax = torch.aminmax(values)  # one pass; counting only when something is outside
    if vmin >= lo and vmax <= hi:
        return []
    outside = int(((values < lo) | (values > hi)).sum())
    return [f"{label}: {outside} values outside [{lo}, {hi}]"]


def zero_problems(label: str, zero: torch.Tensor, qmin: int, qmax: int) -> list[str]:
    z = zero.detach().float()
    if not torch.isfinite(z).all():
        return [f"{label}: {int((~torch.isfinite(z)).sum())} NaN or inf zero points"]
    if not torch.equal(z, z.round()):
        return [f"{label}: zero points are not integers"]
    return range_problems(label, z, qmin, qmax)
