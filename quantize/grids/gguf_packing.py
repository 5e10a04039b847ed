"""GGUFWeight <-> GGML block bytes, the layout a .gguf tensor stores (ggml-common.h's block_q*):

  Q8_0  d:f16, 32 × int8
  Q4_0  d:f16, 16 bytes: weight j in byte j's low nibble, weight j + 16 in its high one (level + 8)
  Q4_1  d:f16, m:f16, 16 bytes as Q4_0 (level 0..15)
  Q5_0  d:f16, qh: 32 bits (bit j: the 5th bit of weight j), 16 bytes of low nibbles as Q4_0
        (level + 16)
  Q4_K  d:f16, dmin:f16, 12 bytes of eight 6-bit scales and mins, 128 bytes: in each 64-weight
        chunk, weight l in byte l's low nibble and weight 32 + l in its high one
  Q6_K  ql 128 bytes (low 4 bits), qh 64 bytes (high 2 bits), 16 × int8 scales, d:f16;
        level + 32 in 0..63; each 128-weight half interleaves its four 32-weight quarters

Multi-byte fields are little-endian (GGUF's byte order; torch views use the host's, and every
platform lowbit runs on is little-endian). Rows pack independently: (rows, cols) weights give
(rows, cols / block · type_size) bytes, the shape `gguf.quants.quantize` returns.
"""
from __future__ import annotations

import torch

from lowbit.quantize.grids.gguf import GGUFScheme, GGUFWeight


def pack(weight: GGUFWeight) -> torch.Tensor:
    """(rows, bytes per row) uint8 in GGML's block layout."""
    rows = weight.levels.shape[0]
    layout = weight.scheme.layout
    blocks = weight.levels.reshape(-1, layout.block).to(torch.int32)
    parts = _PACK[weight.scheme.type](weight, blocks)
    out = torch.cat([p.reshape(blocks.shape[0], -1) for p in parts], dim=1)
    return out.reshape(rows, -1)


def unpack(data: torch.Tensor, scheme: GGUFScheme, name: str = "tensor") -> GGUFWeight:
    """The GGUFWeight whose pack() is data (rows, bytes per row) uint8."""
    layout = scheme.layout
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % layout.type_size:
        raise ValueError(f"{name}: GGUF {scheme.type} data must be 2-D uint8 with rows a multiple of "
                         f"{layout.type_size} bytes, got {data.dtype} {tuple(data.shape)}")
    rows = data.shape[0]
    blocks = data.reshape(-1, layout.type_size)
    levels, fields = _UNPACK[scheme.type](blocks)
    shaped = {k: v.reshape(rows, -1) for k, v in fields.items()}
    return GGUFWeight(scheme, levels.reshape(rows, -1).to(torch.int16), **shaped)


def _half_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, 1).to(torch.float16).contiguous().view(torch.uint8)


def _half(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16)


def _nibbles(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    return (low | (high << 4)).to(torch.uint8)


def _split_nibbles(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = b.to(torch.int32)
    return b & 0xF, b >> 4


def _pack_q8_0(w, q):
    return _half_bytes(w.d), q.to(torch.int8).view(torch.uint8)


def _unpack_q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8), {"d": _half(b[:, :2])}


def _pack_q4_0(w, q):
    q = q + 8
    return _half_bytes(w.d), _nibbles(q[:, :16], q[:, 16:])


def _unpack_q4_0(b):
    low, high = _split_nibbles(b[:, 2:])
    return torch.cat([low, high], dim=1) - 8, {"d": _half(b[:, :2])}


def _pack_q4_1(w, q):
    return _half_bytes(w.d), _half_bytes(w.dmin), _nibbles(q[:, :16], q[:, 16:])


def _unpack_q4_1(b):
    low, high = _split_nibbles(b[:, 4:])
    return torch.cat([low, high], dim=1), {"d": _half(b[:, :2]), "dmin": _half(b[:, 2:4])}


def _pack_q5_0(w, q):
    q = q + 16
    bits = (q >> 4) << torch.arange(32, dtype=torch.int64, device=q.device)  # weight j's 5th bit at bit j
    qh = bits.to(torch.int64).sum(dim=1, keepdim=True).to(torch.int32)  # < 2**32: no overflow
    low = q & 0xF
    return _half_bytes(w.d), qh.contiguous().view(torch.uint8), _nibbles(low[:, :16], low[:, 16:])


def _unpack_q5_0(b):
    low, high = _split_nibbles(b[:, 6:])
    qh = b[:, 2:6].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    fifth = (qh >> torch.arange(32, dtype=torch.int64, device=qh.device)) & 1
    return torch.cat([low, high], dim=1) + (fifth << 4) - 16, {"d": _half(b[:, :2])}


def _pack_q4_k(w, q):
    ls = w.sub_scale.reshape(-1, 8).to(torch.int32)
    lm = w.sub_min.reshape(-1, 8).to(torch.int32)
    scales = torch.cat([
        ls[:, :4] | ((ls[:, 4:] >> 4) << 6),  # bytes 0-3: scale j, top bits of scale j + 4
        lm[:, :4] | ((lm[:, 4:] >> 4) << 6),  # bytes 4-7: min j, top bits of min j + 4
        (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4),  # bytes 8-11: low bits of scale and min j + 4
    ], dim=1).to(torch.uint8)
    chunks = q.reshape(-1, 4, 2, 32)  # 64-weight chunks: first 32 low nibbles, next 32 high
    return _half_bytes(w.d), _half_bytes(w.dmin), scales, _nibbles(chunks[:, :, 0], chunks[:, :, 1])


def _unpack_q4_k(b):
    s = b[:, 4:16].to(torch.int32)
    ls = torch.cat([s[:, :4] & 63, (s[:, 8:] & 0xF) | ((s[:, :4] >> 6) << 4)], dim=1)
    lm = torch.cat([s[:, 4:8] & 63, (s[:, 8:] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    low, high = _split_nibbles(b[:, 16:].reshape(-1, 4, 32))
    levels = torch.stack([low, high], dim=2).reshape(-1, 256)
    fields = {"d": _half(b[:, :2]), "dmin": _half(b[:, 2:4]),
              "sub_scale": ls.to(torch.int16), "sub_min": lm.to(torch.int16)}
    return levels, fields


def _pack_q6_k(w, q):
    quarters = (q + 32).reshape(-1, 2, 4, 32)  # (block, half, quarter, 32)
    low, high = quarters & 0xF, quarters >> 4
    ql = torch.stack([_nibbles(low[:, :, 0], low[:, :, 2]), _nibbles(low[:, :, 1], low[:, :, 3])], dim=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    scales = w.sub_scale.reshape(-1, 16).to(torch.int8).view(torch.uint8)
    return ql, qh.to(torch.uint8), scales, _half_bytes(w.d)


def _unpack_q6_k(b):
    ql = b[:, :128].reshape(-1, 2, 2, 32).to(torch.int32)  # (block, half, byte group, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32).to(torch.int32)
    low = torch.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2)
    high = (qh >> torch.tensor([0, 2, 4, 6], device=qh.device).reshape(1, 1, 4, 1)) & 3
    levels = (low | (high << 4)).reshape(-1, 256) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.int16)
    return levels, {"d": _half(b[:, 208:210]), "sub_scale": scales}


_PACK = {"q8_0": _pack_q8_0, "q4_0": _pack_q4_0, "q4_1": _pack_q4_1, "q5_0": _pack_q5_0,
         "q4_k": _pack_q4_k, "q6_k": _pack_q6_k}
_UNPACK = {"q8_0": _unpack_q8_0, "q4_0": _unpack_q4_0, "q4_1": _unpack_q4_1, "q5_0": _unpack_q5_0,
           "q4_k": _unpack_q4_k, "q6_k": _unpack_q6_k}
