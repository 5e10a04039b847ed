"""MXFP4 (OCP Microscaling Formats v1.0): FP4 E2M1 values, one E8M0 scale (a power of two) per
32 consecutive weights of a row.

A recipe names it `scheme: {mx: fp4}`. Codes are 4 bits: sign, then the index of |value| among
E2M1's magnitudes; two codes per byte, the first in the low nibble (compressed-tensors'
`mxfp4-pack-quantized` layout). A scale is stored as its biased exponent (uint8, 127 = 2^0).
A block's exponent puts its absolute maximum at 3.5 to 7 times the scale (log2 of the maximum
rounded to the nearest power of two for a 1-bit mantissa, less E2M1's top exponent, 2), so the
maximum rounds to 4 or 6 and only values past 6.0 saturate (compressed-tensors' observer's rule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids.plan import Assignment, Slot

BLOCK = 32  # weights per shared scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes by code (the low 3 bits)
E2M1_MAX_EXPONENT = 2  # 6.0 = 1.5 * 2^2
BIAS = 127  # E8M0: 2^(stored - 127); 255 is NaN and never written
ZERO_BLOCK = BIAS  # an all-zero block's scale: 2^0 (any would do)


@dataclass(frozen=True)
class MXScheme:
    """A microscaling grid; FP4 (E2M1) is the one lowbit writes."""

    FAMILY = "mxfp4"  # the key of this format in the registries (runtime module, GPTQ solver, AWQ clip)

    mx: Literal["fp4"] = "fp4"  # the element type

    def __post_init__(self):
        if self.mx != "fp4":
            raise ValueError(f"mx must be fp4 (MXFP4: E2M1 values, an E8M0 scale per {BLOCK}), "
                             f"got {short_repr(self.mx)}")

    @property
    def bits_per_weight(self) -> float:
        return 4 + 8 / BLOCK

    def check_columns(self, cols: int, name: str) -> None:
        if cols % BLOCK:
            raise ValueError(f"{name}: rows of {cols} weights do not split into MXFP4 blocks of {BLOCK}; "
                             f"list it under ignore or pick another scheme")

    def assign(self, slots: list[Slot]) -> Assignment:
        for slot in slots:
            self.check_columns(slot.cols, slot.name)
        return {slot.name: self for slot in slots}, {}

    def record(self, grids: dict) -> dict:
        return {}

    def embedding_grid(self, cols: int, tied: bool) -> None:
        return None  # no rule of its own for the token embedding

    def scales_per_row(self) -> bool:
        return True

    def searchable(self) -> bool:
        return True

    def orders_groups(self) -> bool:
        return False  # 32-wide blocks of a row, in the stored order

    def stacks_rows(self) -> bool:
        return True  # a scale covers 32 weights of one row

    def largest_stored(self) -> None:
        """No limit of its own: its E8M0 scales reach 2^127, past float32's largest weight."""
        return None

    NAME_FORMS = "mxfp4"

    def stored_bytes(self, rows: int, cols: int) -> int:
        return rows * cols // 2 + rows * (cols // BLOCK)  # two codes a byte, a uint8 exponent per block

    @classmethod
    def named(cls, name: str) -> Optional["MXScheme"]:
        return cls() if name == "mxfp4" else None

    def takes_inputs(self, inputs) -> bool:
        return inputs is None  # 16-bit inputs (MXFP4A16)

    def describe(self, inputs=None) -> str:
        return f"mxfp4 (e2m1, e8m0 scale per {BLOCK})"

    def check_weight(self, w: torch.Tensor, name: str) -> None:
        """Columns that split into blocks, and finite values: a NaN or inf would give its block a
        meaningless scale and be written as a finite code (a weight invented)."""
        self.check_columns(w.shape[1], name)
        bad = int((~torch.isfinite(w)).sum())
        if bad:
            raise ValueError(f"{name}: {bad} NaN or inf weights; MXFP4 cannot hold them (fix or ignore the layer)")

    def round(self, w: torch.Tensor, name: str = "weight") -> "MXWeight":
        self.check_weight(w, name)
        exponents = block_exponents(w)
        return MXWeight(e2m1_codes(w.float() / element_scales(exponents)), exponents)

    def search_groups(self, w: torch.Tensor) -> torch.Tensor:
        """w (rows, in) as (rows, in / 32, 32): a scale's weights are judged together."""
        return w.reshape(w.shape[0], -1, BLOCK)

    def fake_round(self, w: torch.Tensor, name: str = "weight") -> torch.Tensor:
        return self.round(w.float(), name).dequantize()

    def sweep_view(self, w: torch.Tensor) -> "MXSweepView":
        self.check_weight(w, "weight")
        return MXSweepView(block_exponents(w))


def block_exponents(w: torch.Tensor) -> torch.Tensor:
    """(rows, in / 32) biased E8M0 exponents (uint8) of each block's scale."""
    amax = w.detach().float().abs().reshape(w.shape[0], -1, BLOCK).amax(dim=-1)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    top = exponent - 1 + (mantissa >= 0.875).int()  # log2(amax) to the nearest power, 1-bit mantissa
    stored = (top - E2M1_MAX_EXPONENT + BIAS).clamp(0, 254)
    return torch.where(amax > 0, stored, torch.full_like(stored, ZERO_BLOCK)).to(torch.uint8)


def element_scales(exponents: torch.Tensor) -> torch.Tensor:
    """(rows, in) float32 scale of every weight."""
    powers = exponents.int() - BIAS
    scales = torch.ldexp(torch.ones(powers.shape, device=powers.device), powers)  # exact, subnormals too
    return scales.repeat_interleave(BLOCK, dim=1)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) of values rounded to the nearest E2M1 value (saturating at 6; a tie goes
    to the even code, whose mantissa bit is 0, as IEEE rounding does)."""
    levels = torch.tensor(E2M1, device=values.device)
    midpoints = (levels[1:] + levels[:-1]) / 2
    magnitude = values.abs()
    lower = torch.bucketize(magnitude, midpoints, right=False)  # a tie -> the lower level
    upper = torch.bucketize(magnitude, midpoints, right=True)  # a tie -> the upper level
    index = torch.where(lower % 2 == 0, lower, upper)  # the two differ only at a tie
    sign = (values < 0) & (index > 0)  # no negative zero
    return (index | (sign.to(index.dtype) << 3)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    levels = torch.tensor(E2M1, device=codes.device)
    magnitude = levels[(codes & 7).long()]
    return torch.where(codes & 8 != 0, -magnitude, magnitude)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """(rows, in) codes -> (rows, in / 2) bytes, the first of each pair in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


@dataclass
class MXWeight:
    FAMILY = "mxfp4"  # its format's key in the registries (runtime module, GPTQ solver)

    codes: torch.Tensor  # (out, in) uint8, 4-bit E2M1 codes
    exponents: torch.Tensor  # (out, in / 32) uint8, biased E8M0

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        return e2m1_values(self.codes) * element_scales(self.exponents)

    def row_slice(self, rows: slice) -> "MXWeight":
        return MXWeight(self.codes[rows], self.exponents[rows])


class MXSweepView:
    """What GPTQ sweeps onto: block scales fixed from the weight's ranges before the sweep."""

    def __init__(self, exponents: torch.Tensor):
        self.exponents = exponents
        self.per_element = element_scales(exponents)  # (rows, cols)

    def snap(self, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return e2m1_values(e2m1_codes(w / scale)) * scale

    def weight(self, swept: torch.Tensor) -> MXWeight:
        return MXWeight(e2m1_codes(swept / self.per_element), self.exponents)  # exact: on the grid
