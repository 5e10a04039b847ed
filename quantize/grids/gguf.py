"""GGML's block formats Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS as pure
torch functions.

A weight (rows, in_features) is cut into blocks along each row (32 weights; 256 for the
K-quants and IQ4_XS, whose super-blocks hold 8 sub-blocks of 32 (Q4_K, Q5_K, IQ4_XS) or 16 of 16
(Q6_K)). Every format here reads as one grid per sub-block: value = S · level + M, with S and M
built from the block's fp16 scale(s) exactly as llama.cpp's and the `gguf` package's dequantizers
build them, so that `GGUFWeight.dequantize()` equals `gguf.quants.dequantize(packed, type)` bit for
bit. The I-quants' levels are indices into a codebook (IQ4: 16 non-uniform int8 values), so their
value is S · codebook[level]. Byte packing lives in gguf_packing.py, the K-quants' scale search in
gguf_kquants.py, the I-quants' in gguf_iquants.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids import gguf_iquants, gguf_kquants


@dataclass(frozen=True)
class _Layout:
    block: int  # weights per block (super-block for the K-quants)
    sub: int  # weights sharing one S and M
    type_size: int  # bytes per block in a .gguf tensor
    qmin: int  # stored levels, offsets removed (Q4_0 stores level + 8)
    qmax: int
    has_min: bool  # M present (Q4_1's min, Q4_K's dmin · sub-block min)
    codebook: Optional[tuple[int, ...]] = None  # a level's value before scaling, where not the level itself

    def level_values(self, levels: torch.Tensor) -> torch.Tensor:
        """What each level (index) stands for, float32, before S and M."""
        if self.codebook is None:
            return levels.float()
        return torch.tensor(self.codebook, dtype=torch.float32, device=levels.device)[levels.long()]


SEARCH_BLOCK = 32  # the weights a search (AWQ's) judges together on any GGML grid

LAYOUTS = {
    "q8_0": _Layout(32, 32, 34, -128, 127, False),
    "q4_0": _Layout(32, 32, 18, -8, 7, False),
    "q4_1": _Layout(32, 32, 20, 0, 15, True),
    "q5_0": _Layout(32, 32, 22, -16, 15, False),
    "q5_1": _Layout(32, 32, 24, 0, 31, True),
    "q4_k": _Layout(256, 32, 144, 0, 15, True),
    "q5_k": _Layout(256, 32, 176, 0, 31, True),
    "q6_k": _Layout(256, 16, 210, -32, 31, False),
    "iq4_nl": _Layout(32, 32, 18, 0, 15, False, gguf_iquants.VALUES),
    "iq4_xs": _Layout(256, 32, 136, 0, 15, False, gguf_iquants.VALUES),
}

FP16_MAX = 65504.0  # the largest finite float16: every GGML block scale (d, dmin) is one
# The largest magnitude any block of a type stores, as a multiple of FP16_MAX: its scale is the block's
# largest magnitude over this (Q4_0: d = max / -8; Q8_0: amax / 127). Q4_1 and Q5_1 store the block's
# min itself in fp16, the K-quants' dmin is the largest sub-block min / 63, Q6_K's and IQ4_XS's super-block
# scale divides the sub-block scales (max / ~32, / ~113) again by 128 and 32, IQ4_NL's least-squares
# scale reaches max / 113: rounded down, so a weight within it is stored (tests/test_weak_messages.py)
REACH = {"q8_0": 127, "q4_0": 8, "q5_0": 16, "q4_1": 1, "q5_1": 1, "q4_k": 63, "q5_k": 63, "q6_k": 31 * 128,
         "iq4_nl": 112, "iq4_xs": 112 * 32}


# llama.cpp's substitute for a type whose block does not divide a row (tensor_type_fallback in
# llama-quant.cpp): a 32-block type of at least the same precision.
_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "iq4_xs": "iq4_nl"}


def fallback_type(type: str, cols: int) -> Optional[str]:
    """The GGUF type llama.cpp writes for rows `cols` long when `type` was asked: `type` itself when
    its block divides the rows, else Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL;
    None (keep the tensor float) when not even a 32-block divides them."""
    if type not in LAYOUTS:
        raise ValueError(f"GGUF type must be one of {sorted(LAYOUTS)}, got {short_repr(type)}")
    for candidate in (type, _FALLBACK.get(type)):
        if candidate is not None and cols % LAYOUTS[candidate].block == 0:
            return candidate
    return None


@dataclass(frozen=True)
class GGUFScheme:
    """One GGML block type; bits_per_weight counts the scales too (Q4_K: 4.5)."""

    FAMILY = "gguf"  # the key of this format in the registries (runtime module, GPTQ solver)

    type: str = "q4_k"

    def __post_init__(self):
        if self.type not in LAYOUTS:
            raise ValueError(f"GGUF type must be one of {sorted(LAYOUTS)}, got {short_repr(self.type)}")

    @property
    def layout(self) -> _Layout:
        return LAYOUTS[self.type]

    def takes_inputs(self, inputs) -> bool:
        return inputs is None  # llama.cpp decides how a GGUF tensor's inputs are multiplied

    def describe(self, inputs=None) -> str:
        return f"gguf {self.type}"

    def stacks_rows(self) -> bool:
        return True  # every scale lies within one row: linears sharing an input may be solved stacked

    def round(self, w: torch.Tensor, name: str = "weight") -> "GGUFWeight":
        return quantize_gguf(w, self, name)

    def largest_stored(self) -> float:
        """The largest weight magnitude any block stores: past it the fp16 block scale is inf."""
        return FP16_MAX * REACH[self.type]

    def search_groups(self, w: torch.Tensor) -> torch.Tensor:
        """w (rows, in) as (rows, in / 32, 32): searches judge 32 weights together, the smallest GGML
        block (Q4_K's sub-blocks too), whatever the type."""
        return w.reshape(w.shape[0], -1, SEARCH_BLOCK)

    def fake_round(self, w: torch.Tensor, name: str = "weight") -> torch.Tensor:
        """w rounded as llama.cpp's reference quantizer rounds it, and back, in w's dtype."""
        return quantize_gguf(w.float(), self, name).dequantize().to(w.dtype)

    @property
    def block_size(self) -> int:
        return self.layout.block

    @property
    def bits_per_weight(self) -> float:
        return self.layout.type_size * 8 / self.layout.block

    @property
    def ggml_type(self):
        """The gguf package's GGMLQuantizationType for this format."""
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType[self.type.upper()]

    def check_weight(self, W: torch.Tensor, name: str = "weight") -> None:
        if W.dim() != 2 or W.shape[1] % self.block_size:
            raise ValueError(f"{name}: GGUF {self.type} needs a 2-D weight whose rows are a multiple of "
                             f"{self.block_size} long, got shape {tuple(W.shape)}")
        if not torch.isfinite(W).all():
            raise ValueError(f"{name}: GGUF {self.type} needs finite weights (found inf or NaN)")


@dataclass
class GGUFWeight:
    """A weight on a GGML grid: levels plus the block fields a .gguf tensor stores."""

    FAMILY = "gguf"  # its format's key in the registries (runtime module, GPTQ solver)

    scheme: GGUFScheme
    levels: torch.Tensor  # (rows, cols) int16, offsets removed: value = S·level + M (IQ4: a codebook index)
    d: torch.Tensor  # (rows, blocks) float16: the block scale (super-block scale for K-quants, IQ4_XS)
    dmin: Optional[torch.Tensor] = None  # (rows, blocks) float16: Q4_1's and Q5_1's min m, Q4_K's and Q5_K's dmin
    sub_scale: Optional[torch.Tensor] = None  # (rows, subs) int16: Q4_K, Q5_K 0..63, Q6_K -128..127, IQ4_XS -32..31
    sub_min: Optional[torch.Tensor] = None  # (rows, subs) int16: Q4_K, Q5_K 0..63

    def sub_scale_offset(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """S and M per sub-block (rows, cols / sub), float32, multiplied in the dequantizers' order."""
        d = self.d.float()
        if self.sub_scale is None:
            return d, None if self.dmin is None else self.dmin.float()
        per_block = self.scheme.block_size // self.scheme.layout.sub
        S = d.repeat_interleave(per_block, dim=1) * self.sub_scale.float()  # exact: 11 × 8 bits
        if self.sub_min is None:
            return S, None
        return S, -(self.dmin.float().repeat_interleave(per_block, dim=1) * self.sub_min.float())

    def row_slice(self, rows: slice) -> "GGUFWeight":
        def cut(t):
            return None if t is None else t[rows]
        return GGUFWeight(self.scheme, self.levels[rows], self.d[rows], cut(self.dmin), cut(self.sub_scale),
                          cut(self.sub_min))

    def dequantize(self) -> torch.Tensor:
        S, M = self.sub_scale_offset()
        sub = self.scheme.layout.sub
        return grid_values(self.levels, _spread(S, sub), None if M is None else _spread(M, sub), self.scheme)


def grid_values(levels: torch.Tensor, S: torch.Tensor, M: Optional[torch.Tensor], scheme: GGUFScheme) -> torch.Tensor:
    """S·value(level) (+ M) per element: one product and one sum, as the dequantizers do (no fused
    multiply-add, and no + 0 that would turn a -0.0 into 0.0)."""
    values = S * scheme.layout.level_values(levels)
    return values if M is None else values + M


def round_to_grid(W: torch.Tensor, S: torch.Tensor, M: Optional[torch.Tensor], scheme: GGUFScheme) -> torch.Tensor:
    """Nearest levels of W (..., cols) on fixed sub-block grids S, M (..., cols / sub)."""
    sub = scheme.layout.sub
    return nearest_levels(W, _spread(S, sub), None if M is None else _spread(M, sub), scheme)


def nearest_levels(W: torch.Tensor, S: torch.Tensor, M: Optional[torch.Tensor], scheme: GGUFScheme) -> torch.Tensor:
    """Nearest levels of W on per-element grids S, M; where S is 0 every level gives the same value,
    and the level stored is the one whose value is nearest 0."""
    x = W.float() if M is None else W.float() - M
    scaled = x / torch.where(S == 0, 1.0, S)
    codebook = scheme.layout.codebook
    if codebook is not None:
        values = torch.tensor(codebook, dtype=torch.float32, device=W.device)
        return gguf_iquants.nearest_index(torch.where(S == 0, 0.0, scaled), values)
    q = torch.round(scaled).clamp(scheme.layout.qmin, scheme.layout.qmax)
    return torch.where(S == 0, 0.0, q).to(torch.int16)


def _spread(t: torch.Tensor, sub: int) -> torch.Tensor:
    return t.repeat_interleave(sub, dim=-1)


def quantize_gguf(W: torch.Tensor, scheme: GGUFScheme, name: str = "weight") -> GGUFWeight:
    """Round to nearest the way llama.cpp's reference quantizer (no importance matrix) does:
    Q8_0, Q4_0, Q4_1 and Q5_0 byte for byte as `gguf.quants.quantize`; the K-quants by llama.cpp's
    scale searches (gguf_kquants.py). With an importance per column: gguf_weighted.quantize_weighted."""
    scheme.check_weight(W, name)
    rows = W.shape[0]
    blocks = W.detach().float().reshape(-1, scheme.block_size)
    fields = _REFERENCE[scheme.type](blocks)
    levels = fields.pop("levels").reshape(rows, -1).to(torch.int16)
    shaped = {k: v.reshape(rows, -1) for k, v in fields.items()}
    return GGUFWeight(scheme, levels, **shaped)


def _q8_0(x: torch.Tensor) -> dict:
    d = x.abs().amax(dim=1, keepdim=True) / 127
    return {"levels": _round_half_away(x * _inverse(d)), "d": d.half()}


def _q4_0(x: torch.Tensor) -> dict:
    signed_max = x.gather(1, x.abs().argmax(dim=1, keepdim=True))  # first of equal magnitudes
    d = signed_max / -8
    q = torch.trunc(x * _inverse(d) + 8.5).clamp(0, 15)
    return {"levels": q - 8, "d": d.half()}


def _q5_0(x: torch.Tensor) -> dict:
    signed_max = x.gather(1, x.abs().argmax(dim=1, keepdim=True))
    d = signed_max / -16
    q = torch.trunc(x * _inverse(d) + 16.5).clamp(0, 31)
    return {"levels": q - 16, "d": d.half()}


def _q4_1(x: torch.Tensor) -> dict:
    return _with_min(x, 15)


def _q5_1(x: torch.Tensor) -> dict:
    return _with_min(x, 31)


def _with_min(x: torch.Tensor, top: int) -> dict:
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    d = (hi - lo) / top
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp(0, top)
    return {"levels": q, "d": d.half(), "dmin": lo.half()}


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1/d in float32 from the unrounded d (the reference quantizers round with it, not the fp16 d)."""
    return torch.where(d == 0, 0.0, 1.0 / torch.where(d == 0, 1.0, d))


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf, written as the gguf package writes it (floor of the doubled fraction), so that
    values a hair under .5 do not round up through v + 0.5."""
    a = v.abs()
    whole = torch.floor(a)
    return torch.sign(v) * (whole + torch.floor(2 * (a - whole)))


_REFERENCE = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1,
              "q4_k": gguf_kquants.q4_k_reference, "q5_k": gguf_kquants.q5_k_reference,
              "q6_k": gguf_kquants.q6_k_reference, "iq4_nl": gguf_iquants.iq4_nl_reference,
              "iq4_xs": gguf_iquants.iq4_xs_reference}
