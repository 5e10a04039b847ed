"""Integer grids, scales and bit packing: small pure functions on tensors.

Weights are (out_features, in_features); groups run along in_features. A scale of shape
(out, G) covers G equal groups of each row: G == 1 is per-channel, (1, 1) is per-tensor.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids.inputs import InputQuant
from lowbit.quantize.grids.plan import Assignment, Slot

Strategy = Literal["tensor", "channel", "group"]
STORED_SCALE_BYTES = 2  # a scale in the export dtype (bf16/fp16)
STORED_SHAPE_BYTES = 16  # compressed-tensors' weight_shape (two int64)
NAME = re.compile(r"^int([2-8])(?:_g(\d+))?$")  # a format name: int<bits>, int<bits>_g<group>


@dataclass(frozen=True)
class IntScheme:
    """How a weight maps onto an integer grid."""

    FAMILY = "int"  # the key of this format in the registries (runtime module, GPTQ solver)

    bits: int = 4
    symmetric: bool = True  # symmetric: zero point fixed at 0; asymmetric: a zero point per group
    strategy: Strategy = "channel"
    group_size: Optional[int] = None  # only with strategy="group"; a divisor of in_features

    def __post_init__(self):
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be between 2 and 8, got {self.bits}")
        if self.strategy not in ("tensor", "channel", "group"):
            raise ValueError(f"strategy must be one of tensor, channel, group; got {short_repr(self.strategy)}")
        if (self.strategy == "group") != (self.group_size is not None):
            raise ValueError("group_size is required with strategy 'group' and only with it")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"group_size must be positive, got {self.group_size}")

    # Codes are signed for both symmetric and asymmetric grids (asymmetric ones shift by a
    # signed zero point), the convention of compressed-tensors, so export is a plain copy.
    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def num_groups(self, in_features: int) -> int:
        return in_features // self.group_size if self.strategy == "group" else 1

    def takes_inputs(self, inputs) -> bool:
        """Inputs an integer grid pairs with: 16-bit (None) or integer (an InputQuant)."""
        return inputs is None or isinstance(inputs, InputQuant)

    def scales_per_row(self) -> bool:
        """Whether each row has scales of its own (GPTQ and AWQ solve and search per row)."""
        return self.strategy != "tensor"

    def searchable(self) -> bool:
        return self.scales_per_row()

    def orders_groups(self) -> bool:
        return True  # groups formed in the Hessian's order are carried by g_idx

    def assign(self, slots: list[Slot]) -> Assignment:
        """This grid on every slot, once each group size is checked against its rows."""
        for slot in slots:
            check_group_size(self, slot.cols, slot.name)
        return {slot.name: self for slot in slots}, {}

    def embedding_grid(self, cols: int, tied: bool) -> None:
        return None  # no rule of its own for the token embedding

    def record(self, grids: dict) -> dict:
        return {}

    def stacks_rows(self) -> bool:
        return True  # every scale lies within one row: linears sharing an input may be solved stacked

    def largest_stored(self) -> None:
        """No limit of its own: its scales are float32 (an export in fp16 limits them as it limits any tensor)."""
        return None

    NAME_FORMS = "int<bits> (per channel, bits 2-8), int<bits>_g<group> (e.g. int4_g128)"

    def stored_bytes(self, rows: int, cols: int) -> int:
        """As compressed-tensors stores it: codes packed densely into int32 words per row, a 16-bit
        scale per row and group (one per tensor), zero points packed along the rows (asymmetric;
        one int8 per tensor), the [out, in] shape."""
        codes = rows * ((cols * self.bits + 31) // 32) * 4
        if self.strategy == "tensor":
            return codes + STORED_SCALE_BYTES + (0 if self.symmetric else 1) + STORED_SHAPE_BYTES
        groups = self.num_groups(cols)
        zeros = 0 if self.symmetric else ((rows * self.bits + 31) // 32) * groups * 4
        return codes + rows * groups * STORED_SCALE_BYTES + zeros + STORED_SHAPE_BYTES

    @classmethod
    def named(cls, name: str) -> Optional["IntScheme"]:
        """The symmetric grid a format name stands for (int4_g128, int8), or None: not an integer name."""
        match = NAME.match(name)
        if not match:
            return None
        bits, group = int(match.group(1)), match.group(2)
        return cls(bits, True, "channel") if group is None else cls(bits, True, "group", int(group))

    def round(self, w: torch.Tensor, name: str = "weight") -> "QuantizedWeight":
        return quantize_rtn(w, self)

    def search_groups(self, w: torch.Tensor) -> torch.Tensor:
        """w (rows, in) as (rows, G, group): the slices a search (AWQ's) judges together."""
        return grouped(w, self)

    def fake_round(self, w: torch.Tensor, name: str = "weight") -> torch.Tensor:
        """w rounded to nearest on min/max scales and back, float32: what a search judges."""
        scale, zero = compute_scale_zero(w, self)
        return dequantize_codes(quantize_codes(w, scale, zero, self), scale, zero, self)

    def describe(self, inputs: Optional[InputQuant] = None) -> str:
        group = f" {self.group_size}" if self.group_size else ""
        act = "" if inputs is None else f" + int{inputs.bits} {'per-token' if inputs.dynamic else 'static'} inputs"
        return f"int{self.bits} {'sym' if self.symmetric else 'asym'} {self.strategy}{group}{act}"


@dataclass
class QuantizedWeight:
    """A weight on an integer grid: codes plus the scales and zero points that give them meaning."""

    FAMILY = "int"  # its format's key in the registries (runtime module, GPTQ solver)

    codes: torch.Tensor  # (out, in) int8 in [-2^(bits-1), 2^(bits-1))
    scale: torch.Tensor  # (out, G) float32, or (1, 1) per-tensor
    zero: Optional[torch.Tensor]  # (out, G) like scale, integer-valued, signed; None when symmetric
    scheme: IntScheme
    g_idx: Optional[torch.Tensor] = None  # (in,) group of each input column, for act-order

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def row_slice(self, rows: slice) -> "QuantizedWeight":
        zero = None if self.zero is None else self.zero[rows]
        return QuantizedWeight(self.codes[rows], self.scale[rows], zero, self.scheme, self.g_idx)

    def dequantize(self) -> torch.Tensor:
        if self.g_idx is None:
            return dequantize_codes(self.codes, self.scale, self.zero, self.scheme)
        # act-order with permuted groups: column j uses group g_idx[j]
        s = self.scale[:, self.g_idx]
        q = self.codes.float()
        if self.zero is not None:
            q = q - self.zero.float()[:, self.g_idx]
        return q * s


def quantize_rtn(w: torch.Tensor, scheme: IntScheme) -> QuantizedWeight:
    """Round-to-nearest on min/max scales: the baseline every other algorithm must beat."""
    scale, zero = compute_scale_zero(w, scheme)
    codes = quantize_codes(w, scale, zero, scheme)
    return QuantizedWeight(codes, scale.float(), zero, scheme)


def valid_group_sizes(in_features: int) -> list[int]:
    """Group sizes that divide in_features, among those kernels commonly support."""
    return [g for g in (16, 32, 64, 128, 256, 512, 1024) if in_features % g == 0]


def check_group_size(scheme: IntScheme, in_features: int, layer: str) -> None:
    if scheme.strategy == "group" and in_features % scheme.group_size:
        valid = valid_group_sizes(in_features)
        sizes = f"valid group sizes: {valid}" if valid else "no common group size (16..1024) divides it"
        raise ValueError(
            f"layer {layer}: group_size {scheme.group_size} does not divide in_features "
            f"{in_features}; {sizes} (or strategy: channel)"
        )


def grouped(w: torch.Tensor, scheme: IntScheme) -> torch.Tensor:
    """View w (out, in) as (rows, G, group) with the groups that share one scale."""
    out, inp = w.shape
    if scheme.strategy == "tensor":
        return w.reshape(1, 1, out * inp)
    return w.reshape(out, scheme.num_groups(inp), -1)


def scale_zero_from_range(
    lo: torch.Tensor, hi: torch.Tensor, scheme: IntScheme
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Scale (and integer zero point) that map [lo, hi] onto the scheme's grid."""
    if scheme.symmetric:
        absmax = torch.maximum(lo.abs(), hi.abs())
        # use the whole signed range: absmax lands at +-(qmax - qmin) / 2, e.g. 7.5 for INT4
        scale = absmax / ((scheme.qmax - scheme.qmin) / 2)
        return torch.where(scale > 0, scale, torch.ones_like(scale)), None
    lo = lo.clamp(max=0)  # keep 0.0 exactly representable (padding, ReLU zeros)
    hi = hi.clamp(min=0)
    scale = (hi - lo) / (scheme.qmax - scheme.qmin)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(scheme.qmin - lo / scale).clamp(scheme.qmin, scheme.qmax)
    return scale, zero


def compute_scale_zero(w: torch.Tensor, scheme: IntScheme):
    """Min/max scales for w (out, in): scale (rows, G) and zero (rows, G) or None."""
    g = grouped(w.float(), scheme)
    return scale_zero_from_range(g.amin(dim=-1), g.amax(dim=-1), scheme)


def quantize_codes(w, scale, zero, scheme: IntScheme, rows: int = 1024) -> torch.Tensor:
    """Integer codes (int8, same shape as w) of w on the grid given by scale/zero (rows, G); a block
    of rows at a time, so the float temporaries are a block's, not the weight's (a 14336-row
    Llama-3-8B gate_proj: 16 MB instead of 235 MB)."""
    g = grouped(w.float(), scheme)
    codes = torch.empty(g.shape, dtype=torch.int8, device=w.device)
    for start in range(0, g.shape[0], rows):
        block = slice(start, start + rows)
        q = torch.div(g[block], scale[block].unsqueeze(-1)).round_()
        if zero is not None:
            q.add_(zero[block].unsqueeze(-1))
        codes[block] = q.clamp_(scheme.qmin, scheme.qmax)
    return codes.reshape(w.shape)


def dequantize_codes(codes, scale, zero, scheme: IntScheme) -> torch.Tensor:
    """Float weight (out, in) from int codes and scale/zero (rows, G)."""
    g = grouped(codes.float(), scheme)
    if zero is not None:
        g = g - zero.float().unsqueeze(-1)
    return (g * scale.float().unsqueeze(-1)).reshape(codes.shape)


def fake_quantize(w, scale, zero, qmin: int, qmax: int) -> torch.Tensor:
    """Round w onto the grid and back; scale/zero broadcast against w (used column-wise by GPTQ)."""
    return fake_quantize_with_codes(w, scale, zero, qmin, qmax)[0]


def fake_quantize_with_codes(w, scale, zero, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fake_quantize's values and the codes it rounded w to (float, in [qmin, qmax])."""
    code = torch.round(w / scale)
    if zero is not None:
        code = code + zero
    code = code.clamp(qmin, qmax)
    q = code - zero if zero is not None else code
    return q * scale, code


def pack_codes(codes_unsigned: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (..., n) densely into int32 (..., ceil(n * bits / 32)).

    Code i occupies bits [i * bits, (i + 1) * bits) of the little-endian bit stream, so a code
    may straddle two words when bits does not divide 32 (3, 5, 6, 7); for 2, 4 and 8 bits this
    is the usual `32 // bits` codes per word, lowest first. Every 32 codes fill `bits` words.
    """
    _check_pack_bits(bits)
    n = codes_unsigned.shape[-1]
    blocks = _pad_last(codes_unsigned.to(torch.int32), 32).unflatten(-1, (-1, 32))  # (..., B, 32)
    words = torch.zeros(*blocks.shape[:-1], bits, dtype=torch.int32, device=blocks.device)  # (..., B, bits)
    for i in range(32):
        word, offset = divmod(i * bits, 32)
        words[..., word] |= blocks[..., i] << offset  # int32 wraps: only the bit pattern matters
        if offset + bits > 32:  # the code's high bits continue in the next word
            words[..., word + 1] |= blocks[..., i] >> (32 - offset)
    return words.flatten(-2)[..., : (n * bits + 31) // 32].contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, n: int, rows: int = 1024) -> torch.Tensor:
    """Inverse of pack_codes: unsigned codes (..., n) as uint8. A block of rows at a time: the
    int32 working copy is a block's (a Llama-3-8B down_proj: 16 MB instead of 235 MB)."""
    _check_pack_bits(bits)
    if packed.shape[-1] * 32 < n * bits:
        raise ValueError(f"packed tensor of {packed.shape[-1]} words holds fewer than {n} codes of {bits} bits")
    flat = packed.reshape(-1, packed.shape[-1])
    out = torch.empty(flat.shape[0], n, dtype=torch.uint8, device=packed.device)
    for start in range(0, flat.shape[0], rows):
        out[start : start + rows] = _unpack_block(flat[start : start + rows], bits, n)
    return out.reshape(*packed.shape[:-1], n)


def _unpack_block(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    words = _pad_last(packed.to(torch.int32), bits).unflatten(-1, (-1, bits))  # (..., B, bits)
    codes = torch.empty(*words.shape[:-1], 32, dtype=torch.int32, device=words.device)
    for i in range(32):
        word, offset = divmod(i * bits, 32)
        low = min(bits, 32 - offset)  # bits of the code held by this word
        codes[..., i] = (words[..., word] >> offset) & ((1 << low) - 1)  # mask drops sign extension
        if low < bits:
            codes[..., i] |= (words[..., word + 1] & ((1 << (bits - low)) - 1)) << low
    return codes.flatten(-2)[..., :n].to(torch.uint8)


def _check_pack_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"packing supports 1 to 8 bits, got {bits}")


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last dimension up to a multiple of `multiple`."""
    pad = -t.shape[-1] % multiple
    return torch.nn.functional.pad(t, (0, pad)) if pad else t
