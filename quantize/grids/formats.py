"""A weight format per linear: `scheme: {formats: {NAME_OR_re:REGEX: FORMAT, ...}, default: FORMAT}`.

The first pattern that matches a linear decides its format, else `default`; `f16` keeps it 16-bit.
A format is a name each grid family reads (`named`): int4_g128 and int8 (integer, symmetric),
fp8_e4m3 (FP8 per channel), mxfp4. This is how a `lowbit fit` plan reaches a run, and how a recipe
mixes formats by hand; llama.cpp's file types are the other way a plan is built (gguf_plan.py).
compressed-tensors stores a mixture as one config group per format; the GPTQ format cannot (one
bit-width per model) and says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lowbit.calibrate.arch import matches_name
from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids.fp8 import FP8Scheme
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.grids.mxfp4 import MXScheme
from lowbit.quantize.grids.plan import Assignment, Slot

F16 = "f16"  # stays 16-bit
NAMED = (IntScheme, FP8Scheme, MXScheme)  # the grid families a format name may stand for
PLANNED_SIXTEEN_BIT = "kept 16-bit by the recipe's scheme.formats (f16)"


def grid_named(name: str):
    """The grid a format name stands for; None for f16; a ValueError listing the valid names."""
    if name == F16:
        return None
    for family in NAMED:
        grid = family.named(name) if isinstance(name, str) else None
        if grid is not None:
            return grid
    forms = "; ".join(family.NAME_FORMS for family in NAMED)
    raise ValueError(f"{short_repr(name)} is not a weight format; valid: {forms}; or {F16}")


def format_bytes(name: str, rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) weight in the named format as compressed-tensors stores it (f16: 2 a weight)."""
    grid = grid_named(name)
    return rows * cols * 2 if grid is None else grid.stored_bytes(rows, cols)


def fits_columns(name: str, cols: int) -> bool:
    """Whether a linear with `cols` input columns can take the named format."""
    grid = grid_named(name)
    if grid is None:
        return True
    try:
        grid.assign([Slot("linear", cols, 0, 1)])
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class LinearFormats:
    """The plan of a recipe whose linears take different formats."""

    # module name, trailing path or re:REGEX -> format name; the first entry that matches decides
    formats: dict[str, str] = field(default_factory=dict, hash=False)
    default: str = "int4_g128"  # the format of a linear no entry matches

    def __post_init__(self):
        for pattern, kind in (*self.formats.items(), ("default", self.default)):
            try:
                grid_named(kind)
            except ValueError as err:
                raise ValueError(f"formats[{short_repr(pattern)}]: {err}") from None

    def format_of(self, name: str) -> str:
        for pattern, kind in self.formats.items():
            if matches_name(name, (pattern,)):
                return kind
        return self.default

    def grid_of(self, name: str):
        """The linear's grid, or None where the plan keeps it 16-bit."""
        return grid_named(self.format_of(name))

    def assign(self, slots: list[Slot]) -> Assignment:
        """Each slot's grid, checked against it by its own family; f16 ones stay 16-bit."""
        grids, kept = {}, {}
        for slot in slots:
            grid = self.grid_of(slot.name)
            if grid is None:
                kept[slot.name] = PLANNED_SIXTEEN_BIT
            else:
                grids.update(grid.assign([slot])[0])
        return grids, kept

    def scales_per_row(self) -> bool:
        return True  # every named format has scales per channel or per group of a row

    def searchable(self) -> bool:
        return all(grid.searchable() for grid in self.grids())

    def orders_groups(self) -> bool:
        return all(grid.orders_groups() for grid in self.grids())

    def grids(self) -> list:
        """Every grid the plan may give (an f16 entry gives none: it keeps a linear 16-bit)."""
        return [g for g in map(grid_named, (*self.formats.values(), self.default)) if g is not None]

    def embedding_grid(self, cols: int, tied: bool) -> None:
        return None  # no rule of its own for the token embedding

    def record(self, grids: dict) -> dict:
        return {}

    def takes_inputs(self, inputs) -> bool:
        return inputs is None  # a plan of weight formats; no input quantization joins it

    def describe(self, inputs=None) -> str:
        kinds = sorted(set(self.formats.values()) | {self.default})
        return "formats per linear: " + ", ".join(kinds)

