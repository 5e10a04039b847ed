"""Integer weight formats by name, as `lowbit fit` weighs them: `int<bits>` (per output channel) or
`int<bits>_g<group>` (groups of `group` input columns), symmetric; `f16` keeps a linear 16-bit.
What each costs in a compressed-tensors checkpoint. A plan of formats per linear is
quantize/grids/formats.py's LinearFormats.
"""
from __future__ import annotations

from typing import Optional

from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids.integer import IntScheme

F16 = "f16"  # stays 16-bit
SCALE_BYTES = 2  # per group, in the export dtype (bf16/fp16)
SHAPE_BYTES = 16  # compressed-tensors' weight_shape (two int64)


def int_format(name: str) -> Optional[IntScheme]:
    """The IntScheme a format name stands for; None for f16."""
    if name == F16:
        return None
    scheme = IntScheme.named(name) if isinstance(name, str) else None
    if scheme is None:
        raise ValueError(f"{short_repr(name)} is not a weight format; valid: {IntScheme.NAME_FORMS}, or {F16}")
    return scheme


def format_name(scheme: IntScheme) -> str:
    """The format name of a symmetric channel or group IntScheme (the inverse of int_format)."""
    if not scheme.symmetric or scheme.strategy == "tensor":
        raise ValueError(f"no format name for {scheme}: formats are symmetric, per channel or group")
    return f"int{scheme.bits}" + (f"_g{scheme.group_size}" if scheme.strategy == "group" else "")


def fits_columns(name: str, cols: int) -> bool:
    """Whether a linear with `cols` input columns can take the format (its group divides them)."""
    scheme = int_format(name)
    return scheme is None or scheme.strategy != "group" or cols % scheme.group_size == 0


def format_bytes(name: str, rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) weight in the format as compressed-tensors stores it: codes packed
    densely into int32 words per row, a 16-bit scale per row and group, the shape; f16: 2 per weight."""
    scheme = int_format(name)
    if scheme is None:
        return rows * cols * 2
    words = (cols * scheme.bits + 31) // 32
    return rows * words * 4 + rows * scheme.num_groups(cols) * SCALE_BYTES + SHAPE_BYTES
