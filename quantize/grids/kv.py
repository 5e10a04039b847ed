"""KV-cache quantization core: pure functions on (batch, kv_heads, tokens, head_dim) states.

Schemes: int8 (symmetric, codes int8) and fp8 (E4M3, saturating) with a static scale per tensor
or per head (calibrated on the cached keys after RoPE and on the values) or a dynamic scale per
token and head; int4 (asymmetric, groups along head_dim, per token; two codes per uint8).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Optional

import torch

from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids.fp8 import fp8_max, saturating_cast

KVFormat = Literal["int8", "fp8", "int4"]
KVStrategy = Literal["tensor", "head", "token"]

INT8_MAX = 127  # symmetric: -128 left unused so that +-absmax both land on the grid
INT4_LEVELS = 15


@dataclass(frozen=True)
class KVCacheConfig:
    format: KVFormat = "fp8"
    strategy: KVStrategy = "tensor"  # tensor / head: calibrated static scales; token: dynamic per token
    group_size: int = 32  # int4 only: head_dim is split into groups with their own scale and minimum

    def __post_init__(self):
        if self.format == "int4" and self.strategy != "token":
            raise ValueError(f"format int4 needs strategy: token (per-token groups of group_size "
                             f"along head_dim), got strategy {short_repr(self.strategy)}")
        if self.group_size <= 0 or self.group_size % 2:
            raise ValueError(f"group_size must be a positive even number, got {self.group_size}")

    @property
    def static(self) -> bool:
        return self.strategy != "token"

    def fits(self, head_dim: int) -> bool:
        """Whether a cache of this format can hold heads of head_dim (int4's groups must divide it)."""
        return self.format != "int4" or head_dim % self.group_size == 0

    @property
    def qmax(self) -> float:
        return fp8_max("e4m3") if self.format == "fp8" else INT8_MAX

    @property
    def bytes_per_element(self) -> float:
        """Code bytes per cached K/V element (int4's per-token scales and minima not counted)."""
        return 0.5 if self.format == "int4" else 1.0

    def stored_bytes_per_element(self, head_dim: int) -> float:
        """Bytes per cached K/V element, scales included: per token, a float16 scale per head
        (int8/fp8) or a float16 scale and minimum per group (int4); static scales are negligible."""
        if self.format == "int4":
            return 0.5 + 4 / self.group_size
        return 1.0 + (2 / head_dim if not self.static else 0.0)

    def to_file(self) -> dict:
        """The config as checkpoints store it (config.json's lowbit_kv_cache; the number format
        under its original key, `scheme`, so files stay readable both ways)."""
        return {"scheme": self.format, "strategy": self.strategy, "group_size": self.group_size}

    @classmethod
    def from_file(cls, saved: dict) -> "KVCacheConfig":
        saved = dict(saved)
        return cls(format=saved.pop("scheme", saved.pop("format", "fp8")), **saved)


@dataclass
class QuantizedKV:
    """Quantized states of one cache tensor (keys or values) of one layer."""

    codes: torch.Tensor  # (b, h, t, d) int8 or float8_e4m3fn; int4: (b, h, t, d / 2) uint8
    scale: torch.Tensor  # static: (1, 1, 1, 1) or (1, h, 1, 1) float32; per token: (b, h, t, G) float16
    minimum: Optional[torch.Tensor] = None  # int4: (b, h, t, G) float16 group minima

    def _token_fields(self, static: bool) -> list[str]:
        """The tensors that grow with tokens: codes always; scales (and minima) when per token."""
        return ["codes"] if static else ["codes", "scale"] + (["minimum"] if self.minimum is not None else [])

    def append(self, new: "QuantizedKV", static: bool) -> "QuantizedKV":
        """Concatenate along tokens; a static scale is shared, not repeated."""
        return replace(self, **{n: torch.cat([getattr(self, n), getattr(new, n)], dim=-2)
                                for n in self._token_fields(static)})

    def map_batch(self, fn, static: bool) -> "QuantizedKV":
        """Apply fn (a reordering or selection along the batch) to every per-sequence tensor."""
        return replace(self, **{n: fn(getattr(self, n)) for n in self._token_fields(static)})

    def nbytes(self) -> int:
        tensors = [self.codes, self.scale] + ([self.minimum] if self.minimum is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def static_scale(absmax: torch.Tensor, cfg: KVCacheConfig) -> torch.Tensor:
    """Stored scale from per-head maxima (kv_heads,): a scalar (tensor) or (kv_heads,) (head)."""
    if not cfg.static:
        raise ValueError("strategy token has no static scale")
    a = absmax.float().amax() if cfg.strategy == "tensor" else absmax.float()
    scale = a / cfg.qmax
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def broadcast_scale(scale: torch.Tensor) -> torch.Tensor:
    """A stored scale (scalar or (kv_heads,)) as (1, h, 1, 1) against (b, h, t, d) states."""
    return scale.float().reshape(1, -1, 1, 1)


def _token_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """Per (b, h, t) scale, rounded to float16 first so quantize and dequantize agree."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / qmax).clamp(min=1e-7, max=60000.0)
    return scale.half()


def quantize_kv(x: torch.Tensor, cfg: KVCacheConfig, scale: Optional[torch.Tensor] = None) -> QuantizedKV:
    """Quantize states x (b, h, t, d); static strategies need the stored scale."""
    if cfg.format == "int4":
        return _quantize_int4(x, cfg.group_size)
    if cfg.static:
        if scale is None:
            raise ValueError(f"KV strategy {short_repr(cfg.strategy)} needs a calibrated scale (run the kv_cache step)")
        s = broadcast_scale(scale).to(x.device)
    else:
        s = _token_scale(x, cfg.qmax)
    y = x.float() / s.float()
    if cfg.format == "fp8":
        return QuantizedKV(saturating_cast(y, "e4m3"), s)
    return QuantizedKV(torch.round(y).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), s)


def dequantize_kv(q: QuantizedKV, cfg: KVCacheConfig, dtype: torch.dtype) -> torch.Tensor:
    if cfg.format == "int4":
        return _dequantize_int4(q, cfg.group_size).to(dtype)
    return (q.codes.float() * q.scale.float()).to(dtype)


def fake_quantize_kv(x: torch.Tensor, cfg: KVCacheConfig, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return dequantize_kv(quantize_kv(x, cfg, scale), cfg, x.dtype)


def _quantize_int4(x: torch.Tensor, group_size: int) -> QuantizedKV:
    b, h, t, d = x.shape
    if d % group_size:
        raise ValueError(f"int4 KV group_size {group_size} does not divide head_dim {d}")
    g = x.float().reshape(b, h, t, d // group_size, group_size)
    lo = g.amin(dim=-1).half()
    scale = ((g.amax(dim=-1) - lo.float()) / INT4_LEVELS).clamp(min=1e-7).half()
    q = torch.round((g - lo.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp(0, INT4_LEVELS)
    q = q.to(torch.uint8).reshape(b, h, t, d)
    return QuantizedKV(q[..., 0::2] | (q[..., 1::2] << 4), scale, lo)  # (b, h, t, d / 2) packed


def _dequantize_int4(q: QuantizedKV, group_size: int) -> torch.Tensor:
    b, h, t, half = q.codes.shape
    codes = torch.stack([q.codes & 0xF, q.codes >> 4], dim=-1).reshape(b, h, t, -1, group_size)
    x = codes.float() * q.scale.float().unsqueeze(-1) + q.minimum.float().unsqueeze(-1)
    return x.reshape(b, h, t, 2 * half)
