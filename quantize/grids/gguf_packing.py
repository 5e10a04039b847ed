"""GGUFWeight <-> GGML block bytes, the layout a .gguf tensor stores (ggml-common.h's block_q*):

  Q8_0  d:f16, 32 × int8
  Q4_0  d:f16, 16 bytes: weight j in byte j's low nibble, weight j + 16 in its high one (level + 8)
  Q4_1  d:f16, m:f16, 16 bytes as Q4_0 (level 0..15)
  Q5_0  d:f16, qh: 32 bits (bit j: the 5th bit of weight j), 16 bytes of low nibbles as Q4_0
        (level + 16)
  Q5_1  d:f16, m:f16, qh and low nibbles as Q5_0 (level 0..31)
  Q4_K  d:f16, dmin:f16, 12 bytes of eight 6-bit scales and mins, 128 bytes: in each 64-weight
        chunk, weight l in byte l's low nibble and weight 32 + l in its high one
  Q5_K  d:f16, dmin:f16, 12 bytes of scales and mins as Q4_K, qh 32 bytes (byte l, bits 2c and
        2c + 1: the 5th bits of weights l and 32 + l of 64-weight chunk c), low nibbles as Q4_K
  Q6_K  ql 128 bytes (low 4 bits), qh 64 bytes (high 2 bits), 16 × int8 scales, d:f16;
        level + 32 in 0..63; each 128-weight half interleaves its four 32-weight quarters
  IQ4_NL d:f16, 16 bytes of codebook indices as Q4_0's nibbles
  IQ4_XS d:f16, scales_h: 16 bits (2 high bits of sub-block j's multiplier + 32 at bit 2j),
        scales_l 4 bytes (its low 4 bits: byte j / 2, low nibble for even j), 128 bytes: each
        32-weight sub-block's indices as Q4_0's nibbles

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
    return (_half_bytes(w.d), *_fifth_bits_and_nibbles(q + 16))


def _unpack_q5_0(b):
    return _levels_from_fifth_bits(b[:, 2:6], b[:, 6:]) - 16, {"d": _half(b[:, :2])}


def _pack_q5_1(w, q):
    return (_half_bytes(w.d), _half_bytes(w.dmin), *_fifth_bits_and_nibbles(q))


def _unpack_q5_1(b):
    return _levels_from_fifth_bits(b[:, 4:8], b[:, 8:]), {"d": _half(b[:, :2]), "dmin": _half(b[:, 2:4])}


def _fifth_bits_and_nibbles(q):
    """Q5_0's and Q5_1's qh (weight j's 5th bit at bit j of 32) and low nibbles of levels 0..31."""
    bits = (q >> 4) << torch.arange(32, dtype=torch.int64, device=q.device)
    qh = bits.to(torch.int64).sum(dim=1, keepdim=True).to(torch.int32)  # < 2**32: no overflow
    low = q & 0xF
    return qh.contiguous().view(torch.uint8), _nibbles(low[:, :16], low[:, 16:])


def _levels_from_fifth_bits(qh_bytes, nibble_bytes):
    low, high = _split_nibbles(nibble_bytes)
    qh = qh_bytes.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    fifth = (qh >> torch.arange(32, dtype=torch.int64, device=qh.device)) & 1
    return torch.cat([low, high], dim=1) + (fifth << 4)


def _pack_q4_k(w, q):
    return _half_bytes(w.d), _half_bytes(w.dmin), _k_scales(w), _k_nibbles(q)


def _unpack_q4_k(b):
    return _k_levels(b[:, 16:]), _k_fields(b)


def _pack_q5_k(w, q):
    chunks = (q >> 4).reshape(-1, 4, 2, 32)  # 5th bits: (block, 64-weight chunk c, half h, weight l)
    qh = (chunks << _q5_k_bit(q.device)).sum(dim=(1, 2))  # byte l, bit 2c + h; bits never overlap
    return _half_bytes(w.d), _half_bytes(w.dmin), _k_scales(w), qh.to(torch.uint8), _k_nibbles(q & 0xF)


def _unpack_q5_k(b):
    qh = b[:, 16:48].to(torch.int32).reshape(-1, 1, 1, 32)
    fifth = ((qh >> _q5_k_bit(b.device)) & 1).reshape(-1, 256)
    return _k_levels(b[:, 48:]) + (fifth << 4), _k_fields(b)


def _q5_k_bit(device) -> torch.Tensor:
    """(1, 4, 2, 1): the qh bit of chunk c's half h, 2c + h."""
    return (2 * torch.arange(4, device=device)[:, None] + torch.arange(2, device=device)).reshape(1, 4, 2, 1)


def _k_scales(w):
    """Q4_K's and Q5_K's 12 bytes of eight 6-bit scales and mins."""
    ls = w.sub_scale.reshape(-1, 8).to(torch.int32)
    lm = w.sub_min.reshape(-1, 8).to(torch.int32)
    return torch.cat([
        ls[:, :4] | ((ls[:, 4:] >> 4) << 6),  # bytes 0-3: scale j, top bits of scale j + 4
        lm[:, :4] | ((lm[:, 4:] >> 4) << 6),  # bytes 4-7: min j, top bits of min j + 4
        (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4),  # bytes 8-11: low bits of scale and min j + 4
    ], dim=1).to(torch.uint8)


def _k_nibbles(q):
    chunks = q.reshape(-1, 4, 2, 32)  # 64-weight chunks: first 32 low nibbles, next 32 high
    return _nibbles(chunks[:, :, 0], chunks[:, :, 1])


def _k_levels(nibble_bytes):
    low, high = _split_nibbles(nibble_bytes.reshape(-1, 4, 32))
    return torch.stack([low, high], dim=2).reshape(-1, 256)


def _k_fields(b):
    s = b[:, 4:16].to(torch.int32)
    ls = torch.cat([s[:, :4] & 63, (s[:, 8:] & 0xF) | ((s[:, :4] >> 6) << 4)], dim=1)
    lm = torch.cat([s[:, 4:8] & 63, (s[:, 8:] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return {"d": _half(b[:, :2]), "dmin": _half(b[:, 2:4]), "sub_scale": ls.to(torch.int16),
            "sub_min": lm.to(torch.int16)}


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


def _pack_iq4_nl(w, q):
    return _half_bytes(w.d), _nibbles(q[:, :16], q[:, 16:])


def _unpack_iq4_nl(b):
    low, high = _split_nibbles(b[:, 2:])
    return torch.cat([low, high], dim=1), {"d": _half(b[:, :2])}


def _pack_iq4_xs(w, q):
    stored = w.sub_scale.reshape(-1, 8).to(torch.int32) + 32
    high_bits = ((stored >> 4) << (2 * torch.arange(8, device=q.device))).sum(dim=1, keepdim=True)  # < 2**16
    scales_h = high_bits.to(torch.int32).contiguous().view(torch.uint8)[:, :2]  # its low 16 bits, little-endian
    low = stored & 0xF
    subs = q.reshape(-1, 8, 32)
    return _half_bytes(w.d), scales_h, _nibbles(low[:, 0::2], low[:, 1::2]), _nibbles(subs[:, :, :16], subs[:, :, 16:])


def _unpack_iq4_xs(b):
    scales_h = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    high = (scales_h[:, None] >> (2 * torch.arange(8, device=b.device))) & 3
    low_even, low_odd = _split_nibbles(b[:, 4:8])
    low = torch.stack([low_even, low_odd], dim=2).reshape(-1, 8)
    low_q, high_q = _split_nibbles(b[:, 8:].reshape(-1, 8, 16))
    levels = torch.cat([low_q, high_q], dim=2).reshape(-1, 256)
    return levels, {"d": _half(b[:, :2]), "sub_scale": ((low | (high << 4)) - 32).to(torch.int16)}


_PACK = {"q8_0": _pack_q8_0, "q4_0": _pack_q4_0, "q4_1": _pack_q4_1, "q5_0": _pack_q5_0, "q5_1": _pack_q5_1,
         "q4_k": _pack_q4_k, "q5_k": _pack_q5_k, "q6_k": _pack_q6_k, "iq4_nl": _pack_iq4_nl, "iq4_xs": _pack_iq4_xs}
_UNPACK = {"q8_0": _unpack_q8_0, "q4_0": _unpack_q4_0, "q4_1": _unpack_q4_1, "q5_0": _unpack_q5_0,
           "q5_1": _unpack_q5_1, "q4_k": _unpack_q4_k, "q5_k": _unpack_q5_k, "q6_k": _unpack_q6_k,
           "iq4_nl": _unpack_iq4_nl, "iq4_xs": _unpack_iq4_xs}
