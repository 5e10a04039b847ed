"""Which GGML type each tensor of a GGUF file gets: llama.cpp's file types as a recipe grid.

A recipe names a llama.cpp file type (`scheme: {gguf: q4_k_m}`), and this module decides the
block type of every tensor the way llama.cpp's quantizer (llama-quant.cpp) does for it, so that
lowbit's calibrated file and llama.cpp's own round-to-nearest file compare tensor for tensor:

- q4_k_m: Q4_K everywhere, Q6_K for attn_v and ffn_down in the layers where llama.cpp spends
  more bits (the first and last eighth of the layers and every third one between);
- iq4_nl, iq4_xs: the type everywhere, Q5_K for ffn_down in the first eighth of the layers and for
  attn_v where 4 or more query heads share a KV head (llama.cpp's rules without an imatrix);
- every quantized file type puts the output matrix (and a tied token embedding, which doubles as
  it) in Q6_K, or Q8_0 for q8_0 files and where rows do not split into 256;
- a row length the type's block does not divide falls back (Q4_K -> Q5_0, Q6_K -> Q8_0), and a
  row length 32 does not divide stays 16-bit (None here).
`pure: true` skips the mixture rules (llama-quantize --pure): the base type everywhere.
`types` sets chosen tensors' types outright (as llama-quantize's --tensor-type does), which is
how a `lowbit fit` plan reaches a run: each linear's type, or f16 to keep it 16-bit, or mxfp4
(the MXFP4 grid, which GGUF stores as GGML's MXFP4: gpt-oss's experts as released).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lowbit.calibrate.arch import matches_name
from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids.gguf import LAYOUTS, GGUFScheme, fallback_type
from lowbit.quantize.grids.mxfp4 import BLOCK as MX_BLOCK
from lowbit.quantize.grids.mxfp4 import MXScheme
from lowbit.quantize.grids.plan import Assignment, Slot

BASE_TYPE = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_1": "q4_1", "q5_0": "q5_0", "q5_1": "q5_1",
             "q4_k_m": "q4_k", "q6_k": "q6_k", "iq4_nl": "iq4_nl", "iq4_xs": "iq4_xs"}
SIXTEEN_BIT = "rows not a multiple of 32 long: no GGML block fits, kept 16-bit (as llama.cpp does)"
F16 = "f16"  # in `types`: the tensor stays 16-bit
MXFP4 = "mxfp4"  # in `types`: the MXFP4 grid (GGML's MXFP4 block in the file)
PLANNED_SIXTEEN_BIT = "kept 16-bit by the recipe's scheme.types (f16)"
MORE_BITS_ROLES = ("attn_v", "ffn_down")  # the tensors q4_k_m gives Q6_K in some layers
# a linear's last name part -> llama.cpp's tensor category (what its mixture rules key on)
ROLES = {"v_proj": "attn_v", "down_proj": "ffn_down", "w2": "ffn_down", "fc2": "ffn_down",
         "c_attn": "attn_qkv", "qkv_proj": "attn_qkv", "query_key_value": "attn_qkv"}


@dataclass(frozen=True)
class GGUFTypes:
    """The grid of a recipe that writes a GGUF file: a llama.cpp file type."""

    gguf: str = "q4_k_m"
    pure: bool = False  # the base type on every tensor (no Q6_K mixture, no output rule)
    # module name, trailing path or re:REGEX -> a GGML type or f16; the first entry that matches
    # a linear decides its type (before the file type's rules; rows a block does not divide fall
    # back as llama.cpp's do)
    types: dict[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if self.gguf not in BASE_TYPE:
            raise ValueError(f"gguf file type must be one of {sorted(BASE_TYPE)}, got {short_repr(self.gguf)}")
        for pattern, kind in self.types.items():
            if kind not in LAYOUTS and kind not in (F16, MXFP4):
                raise ValueError(f"types[{short_repr(pattern)}]: {short_repr(kind)} is not a GGML type; valid: "
                                 f"{', '.join(sorted(LAYOUTS))}, {MXFP4}, {F16}")

    @property
    def base(self) -> str:
        return BASE_TYPE[self.gguf]

    def scales_per_row(self) -> bool:
        return True

    def searchable(self) -> bool:
        return True

    def orders_groups(self) -> bool:
        return False  # GGML blocks follow the stored column order

    def assign(self, slots: list[Slot]) -> Assignment:
        """Each slot's GGML type by llama.cpp's rules: decoder-layer linears by their role and layer,
        others (lm_head) as the output matrix; rows no block divides stay 16-bit."""
        grids, kept = {}, {}
        for slot in slots:
            if slot.layer is None:
                kind = output_type(self, slot.cols)
            else:
                kind = linear_type(self, slot.name, slot.layer, slot.layers, slot.cols, slot.gqa)
            if kind is None:
                kept[slot.name] = sixteen_bit_reason(self, slot.name)
            else:
                grids[slot.name] = MXScheme() if kind == MXFP4 else GGUFScheme(kind)
        return grids, kept

    def embedding_grid(self, cols: int, tied: bool) -> Optional[GGUFScheme]:
        """The token embedding's GGML type by llama.cpp's rule (None: rows no block divides)."""
        kind = embedding_type(self, cols, tied)
        return None if kind is None else GGUFScheme(kind)

    def record(self, grids: dict) -> dict:
        return {"types": {name: grid.type if grid.FAMILY == "gguf" else grid.FAMILY for name, grid in grids.items()}}

    def takes_inputs(self, inputs) -> bool:
        return inputs is None  # a plan of weight formats; no input quantization joins it

    def describe(self, inputs=None) -> str:
        return f"gguf {self.gguf}{' pure' if self.pure else ''}"


def planned_type(types: GGUFTypes, name: str) -> Optional[str]:
    """The type `types.types` sets for linear `name` (a GGML type or f16), or None when no entry
    matches it."""
    for pattern, kind in types.types.items():
        if matches_name(name, (pattern,)):
            return kind
    return None


def sixteen_bit_reason(types: GGUFTypes, name: str) -> str:
    """Why a linear with no GGML type stays 16-bit."""
    return PLANNED_SIXTEEN_BIT if planned_type(types, name) == F16 else SIXTEEN_BIT


def use_more_bits(index: int, count: int) -> bool:
    """llama.cpp's layers that get more bits: first and last eighth, and every third between."""
    return index < count // 8 or index >= 7 * count // 8 or (index - count // 8) % 3 == 2


def role_of(name: str) -> str:
    return ROLES.get(name.rpartition(".")[2], "other")


def linear_type(types: GGUFTypes, name: str, layer: int, layers: int, cols: int, gqa: int = 1) -> Optional[str]:
    """The type of the decoder-layer linear `name` (in layer `layer` of `layers`, rows of `cols`; `gqa`
    query heads per KV head)."""
    planned = planned_type(types, name)
    if planned == MXFP4:
        return None if cols % MX_BLOCK else MXFP4
    if planned is not None:
        return None if planned == F16 else fallback_type(planned, cols)
    kind = types.base if types.pure else mixture_type(types.gguf, role_of(name), layer, layers, gqa) or types.base
    return fallback_type(kind, cols)


def mixture_type(file_type: str, role: str, layer: int, layers: int, gqa: int) -> Optional[str]:
    """The type llama.cpp's file-type rules give a decoder-layer tensor in place of the base type, or
    None (as llama_tensor_get_type decides without an imatrix)."""
    if file_type == "q4_k_m" and role in MORE_BITS_ROLES and use_more_bits(layer, layers):
        return "q6_k"
    if file_type in ("iq4_nl", "iq4_xs") and ((role == "attn_v" and gqa >= 4) or
                                              (role == "ffn_down" and layer < layers // 8)):
        return "q5_k"
    return None


def output_type(types: GGUFTypes, cols: int) -> Optional[str]:
    """The output matrix's type (a tied token embedding's too): Q6_K, or Q8_0 (q8_0 files, or rows
    that 256 does not divide), unless pure."""
    if types.pure:
        return fallback_type(types.base, cols)
    return "q8_0" if types.base == "q8_0" or cols % LAYOUTS["q6_k"].block else "q6_k"


def embedding_type(types: GGUFTypes, cols: int, tied: bool) -> Optional[str]:
    """The token embedding's type: the output's when tied (it is the output), else the base type."""
    return output_type(types, cols) if tied else fallback_type(types.base, cols)
