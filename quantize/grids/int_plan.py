"""A weight format per linear on integer grids: how a `lowbit fit` plan reaches a run.

A format is named `int<bits>` (per output channel) or `int<bits>_g<group>` (groups of `group`
input columns), symmetric; `f16` keeps a linear 16-bit. A recipe writes
`scheme: {formats: {NAME_OR_re:REGEX: FORMAT, ...}, default: FORMAT}`: the first pattern that
matches a linear decides its format, else `default`. compressed-tensors stores such a mixture as
one config group per format; the GPTQ format cannot (one bit-width per model) and says so.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from lowbit.calibrate.arch import matches_name
from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids.integer import IntScheme, check_group_size
from lowbit.quantize.grids.plan import Assignment, Slot

F16 = "f16"  # stays 16-bit
FORMAT = re.compile(r"^int([2-8])(?:_g(\d+))?$")
SCALE_BYTES = 2  # per group, in the export dtype (bf16/fp16)
SHAPE_BYTES = 16  # compressed-tensors' weight_shape (two int64)
PLANNED_SIXTEEN_BIT = "kept 16-bit by the recipe's scheme.formats (f16)"


def int_format(name: str) -> Optional[IntScheme]:
    """The IntScheme a format name stands for; None for f16."""
    if name == F16:
        return None
    match = FORMAT.match(name)
    if not match:
        raise ValueError(f"{short_repr(name)} is not a weight format; valid: int<bits> (per channel, bits 2-8), "
                         f"int<bits>_g<group> (e.g. int4_g128), or {F16}")
    bits, group = int(match.group(1)), match.group(2)
    if group is None:
        return IntScheme(bits, True, "channel")
    return IntScheme(bits, True, "group", int(group))


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


@dataclass(frozen=True)
class IntTypes:
    """The grid of a recipe whose linears take different integer formats."""

    # module name, trailing path or re:REGEX -> format name; the first entry that matches decides
    formats: dict[str, str] = field(default_factory=dict, hash=False)
    default: str = "int4_g128"  # the format of a linear no entry matches

    def __post_init__(self):
        for pattern, kind in (*self.formats.items(), ("default", self.default)):
            try:
                int_format(kind)
            except ValueError as err:
                raise ValueError(f"formats[{short_repr(pattern)}]: {err}") from None

    def format_of(self, name: str) -> str:
        for pattern, kind in self.formats.items():
            if matches_name(name, (pattern,)):
                return kind
        return self.default

    def scales_per_row(self) -> bool:
        return True

    def assign(self, slots: list[Slot]) -> Assignment:
        """Each slot's format; f16 ones stay 16-bit. Every group size is checked first."""
        grids, kept = {}, {}
        for slot in slots:
            scheme = self.scheme_of(slot.name)
            if scheme is None:
                kept[slot.name] = PLANNED_SIXTEEN_BIT
                continue
            check_group_size(scheme, slot.cols, slot.name)
            grids[slot.name] = scheme
        return grids, kept

    def embedding_grid(self, cols: int, tied: bool) -> None:
        return None  # no rule of its own for the token embedding

    def record(self, grids: dict) -> dict:
        return {}

    def scheme_of(self, name: str) -> Optional[IntScheme]:
        """The linear's IntScheme, or None where the plan keeps it 16-bit."""
        return int_format(self.format_of(name))

    def takes_inputs(self, inputs) -> bool:
        return inputs is None  # a plan of weight formats; no input quantization joins it

    def describe(self, inputs=None) -> str:
        kinds = sorted(set(self.formats.values()) | {self.default})
        return "int formats per linear: " + ", ".join(kinds)
