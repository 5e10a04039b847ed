"""FP8 (E4M3, E5M2) primitives: saturating casts, weight and activation scales.

Pure functions on tensors. A scale maps a tensor onto the format's range: x ≈ fp8(x / scale) * scale.
Weights are (out, in); a weight scale is (1, 1) per tensor, (out, 1) per channel, or
(ceil(out / b), ceil(in / b)) for b×b blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids.plan import Assignment, Slot

FP8Format = Literal["e4m3", "e5m2"]  # e4m3: more precision (weights, activations); e5m2: more range
WeightStrategy = Literal["tensor", "channel", "block"]

ActivationMode = Literal["dynamic", "static", "none"]  # per token at run time | calibrated per tensor | 16-bit

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class FP8Scheme:
    """How a weight maps onto an FP8 grid: the format and what one scale covers."""

    FAMILY = "fp8"  # the key of this format in the registries (runtime module, GPTQ solver, AWQ clip)

    format: FP8Format = "e4m3"  # e4m3 for weights and activations; e5m2 trades precision for range
    strategy: WeightStrategy = "channel"  # tensor | channel | block
    block_size: int = 128  # strategy block: b x b tiles with one scale each (DeepSeek-V3 style)

    def __post_init__(self):
        fp8_dtype(self.format)  # raises on an unknown format
        if self.strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"strategy must be one of tensor, channel, block; got {short_repr(self.strategy)}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    def assign(self, slots: list[Slot]) -> Assignment:
        return {slot.name: self for slot in slots}, {}  # any shape: edge blocks are padded

    def record(self, grids: dict) -> dict:
        return {}

    def embedding_grid(self, cols: int, tied: bool) -> None:
        return None  # no rule of its own for the token embedding

    def scales_per_row(self) -> bool:
        return self.strategy != "tensor"

    def searchable(self) -> bool:
        return self.strategy == "channel"  # a block's scale spans rows: no search slices it

    def orders_groups(self) -> bool:
        return False  # scales fixed from the weight, whatever the column order

    NAME_FORMS = "fp8_e4m3, fp8_e5m2 (a scale per channel)"

    def stored_bytes(self, rows: int, cols: int) -> int:
        """One byte a weight, and a 16-bit scale per tensor, row or block (the export dtype)."""
        scales = {"tensor": 1, "channel": rows, "block": -(-rows // self.block_size) * -(-cols // self.block_size)}
        return rows * cols + scales[self.strategy] * 2

    @classmethod
    def named(cls, name: str) -> Optional["FP8Scheme"]:
        fmt = name.removeprefix("fp8_") if name.startswith("fp8_") else None
        return cls(fmt, "channel") if fmt in FP8_DTYPES else None

    def stacks_rows(self) -> bool:
        """Whether linears sharing an input may be solved as one matrix of stacked rows: only when no
        scale spans two of them (a tensor's scale, a block across their boundary would)."""
        return self.strategy == "channel"

    def largest_stored(self) -> None:
        """No limit of its own: its scales are float32 (an export in fp16 limits them as it limits any tensor)."""
        return None

    def round(self, w: torch.Tensor, name: str = "weight") -> "FP8Weight":
        return quantize_weight_fp8(w, self.strategy, self.format, self.block_size)

    def search_groups(self, w: torch.Tensor) -> torch.Tensor:
        """w (rows, in) as (rows, 1, in): one scale covers a whole row (channel) or more."""
        if self.strategy == "block":
            raise ValueError("a search over FP8 weights needs strategy channel or tensor; block scales span rows")
        return w.reshape(w.shape[0], 1, w.shape[1])

    def fake_round(self, w: torch.Tensor, name: str = "weight") -> torch.Tensor:
        """w rounded to nearest on its absmax scales and back, float32: what a search judges."""
        return self.round(w.float(), name).dequantize()

    def sweep_view(self, w: torch.Tensor) -> "FP8SweepView":
        return FP8SweepView(self, w)

    def takes_inputs(self, inputs) -> bool:
        """FP8 weights pair with an FP8 activation mode (dynamic, static) or 16-bit inputs (None)."""
        return inputs in (None, "dynamic", "static")

    def describe(self, activations: Optional[ActivationMode] = None) -> str:
        return f"fp8 {self.format} {self.strategy}, activations {activations or 'none'}"


def fp8_dtype(fmt: FP8Format) -> torch.dtype:
    if fmt not in FP8_DTYPES:
        raise ValueError(f"FP8 format must be one of {sorted(FP8_DTYPES)}, got {short_repr(fmt)}")
    return FP8_DTYPES[fmt]


def fp8_max(fmt: FP8Format) -> float:
    """Largest finite value: 448 for E4M3, 57344 for E5M2."""
    return float(torch.finfo(fp8_dtype(fmt)).max)


def saturating_cast(x: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Cast to FP8, clamping to the largest finite value first.

    A plain cast overflows to inf (E5M2) or NaN (E4M3 on CUDA), so values past the range
    (outliers beyond a calibrated static scale) must saturate instead.
    """
    m = fp8_max(fmt)
    return x.float().clamp(-m, m).to(fp8_dtype(fmt))


def scale_from_absmax(absmax: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """float32 scale that maps absmax onto the format's max; an all-zero slice gets scale 1."""
    scale = absmax.float() / fp8_max(fmt)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def block_absmax(w: torch.Tensor, block: int) -> torch.Tensor:
    """(ceil(out / block), ceil(in / block)) absolute maxima; edge blocks are zero-padded."""
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    padded = w.new_zeros(rows * block, cols * block)
    padded[:out, :inp] = w
    return padded.abs().reshape(rows, block, cols, block).amax(dim=(1, 3))


def expand_block_scale(scale: torch.Tensor, shape: torch.Size, block: int) -> torch.Tensor:
    """Block scales (R, C) spread to one scale per weight element (out, in)."""
    full = scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return full[: shape[0], : shape[1]]


def weight_absmax(w: torch.Tensor, strategy: WeightStrategy, block: int = 128) -> torch.Tensor:
    """The absolute maximum each weight scale covers: (1, 1), (out, 1) or (out / block, in / block)."""
    w = w.float()
    if strategy == "tensor":
        return w.abs().amax().reshape(1, 1)
    if strategy == "channel":
        return w.abs().amax(dim=1, keepdim=True)
    if strategy == "block":
        return block_absmax(w, block)
    raise ValueError(f"FP8 weight strategy must be tensor, channel or block; got {short_repr(strategy)}")


def weight_scale(w: torch.Tensor, strategy: WeightStrategy, fmt: FP8Format, block: int = 128) -> torch.Tensor:
    return scale_from_absmax(weight_absmax(w, strategy, block), fmt)


@dataclass
class FP8Weight:
    FAMILY = "fp8"  # its format's key in the registries (runtime module, GPTQ solver)

    data: torch.Tensor  # (out, in) float8
    scale: torch.Tensor  # float32: (1, 1), (out, 1) or (out / block, in / block) rounded up
    fmt: FP8Format
    strategy: WeightStrategy
    block_size: int = 128  # meaningful with strategy "block" only

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * element_scale(self.scale, self.data.shape, self.strategy, self.block_size)

    def row_slice(self, rows: slice) -> "FP8Weight":
        """The rows of one linear out of a stacked solve (channel scales; a tensor or block scale
        is only ever sliced whole, see FP8Scheme.stacks_rows)."""
        scale = self.scale[rows] if self.strategy == "channel" else self.scale
        if self.strategy != "channel" and (rows.start or 0, rows.stop) != (0, self.data.shape[0]):
            raise ValueError(f"FP8 {self.strategy} scales cannot be split between linears")
        return FP8Weight(self.data[rows], scale, self.fmt, self.strategy, self.block_size)


def element_scale(scale: torch.Tensor, shape: torch.Size, strategy: WeightStrategy, block: int) -> torch.Tensor:
    """A weight scale that broadcasts against (out, in)."""
    return expand_block_scale(scale, shape, block) if strategy == "block" else scale


def quantize_weight_fp8(w: torch.Tensor, strategy: WeightStrategy = "channel", fmt: FP8Format = "e4m3",
                        block: int = 128) -> FP8Weight:
    scale = weight_scale(w, strategy, fmt, block)
    data = saturating_cast(w.float() / element_scale(scale, w.shape, strategy, block), fmt)
    return FP8Weight(data, scale, fmt, strategy, block)


class FP8SweepView:
    """What GPTQ sweeps onto: scales fixed from the weight's ranges before the sweep, each updated
    column snapped to the grid under its scales, the swept values turned into the weight."""

    def __init__(self, scheme: FP8Scheme, w: torch.Tensor):
        self.scheme = scheme
        self.scale = weight_scale(w, scheme.strategy, scheme.format, scheme.block_size)
        # (rows, cols); a view with stride 0 along columns unless block
        self.per_element = element_scale(self.scale, w.shape, scheme.strategy, scheme.block_size).expand(w.shape)

    def snap(self, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return saturating_cast(w / scale, self.scheme.format).float() * scale

    def weight(self, swept: torch.Tensor) -> FP8Weight:
        data = saturating_cast(swept / self.per_element, self.scheme.format)  # exact: the values lie on the grid
        return FP8Weight(data, self.scale, self.scheme.format, self.scheme.strategy, self.scheme.block_size)


def dynamic_token_scale(x: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Per-token scale (..., 1): each row of activations on its own absolute maximum."""
    return scale_from_absmax(x.detach().abs().amax(dim=-1, keepdim=True), fmt)


def quantize_activation(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """FP8 codes of x / scale; scale is a per-tensor scalar or per-token (..., 1)."""
    return saturating_cast(x / scale.to(x.device), fmt)


def fake_quantize_activation(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """x rounded onto the FP8 grid and back, in x's dtype (the reference path's activation)."""
    scale = scale.to(x.device)
    return (quantize_activation(x, scale, fmt).float() * scale).to(x.dtype)
