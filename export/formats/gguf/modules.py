"""Which runtime modules a .gguf file holds, as GGML tensors, and how each is read back.

GGUFLinear holds its GGML blocks already. MXFP4Linear (the `{mx: fp4}` grid) is GGML's MXFP4 as it
stands: per 32 weights one E8M0 byte, then 16 bytes whose low nibbles are the first 16 E2M1 codes
and high nibbles the last 16 (llama.cpp's block_mxfp4; its doubled E2M1 values on a halved scale
are the same numbers), so the repack loses nothing and reads back bit for bit."""
from __future__ import annotations

import torch

from lowbit.quantize.grids.gguf import GGUFScheme
from lowbit.quantize.grids.mxfp4 import BLOCK, MXWeight
from lowbit.quantize.runtime.gguf_linear import GGUFLinear
from lowbit.quantize.runtime.mxfp4_linear import MXFP4Linear

MXFP4_BLOCK_BYTES = 1 + BLOCK // 2


def ggml_tensor(module) -> tuple:
    """(bytes (rows, bytes per row) uint8, gguf.GGMLQuantizationType) of a module GGUF holds, or
    None for one it cannot."""
    import gguf

    if isinstance(module, GGUFLinear):
        return module.weight, module.scheme.ggml_type
    if isinstance(module, MXFP4Linear):
        return mxfp4_blocks(module.mx_weight()), gguf.GGMLQuantizationType.MXFP4
    return None


def module_from_ggml(ggml_type: int, raw: torch.Tensor, in_features: int, out_features: int, bias: bool):
    """The runtime module for a linear stored as `raw` bytes of `ggml_type` (raises ValueError with
    the grid's message for a type lowbit does not read)."""
    import gguf

    if ggml_type == int(gguf.GGMLQuantizationType.MXFP4):
        return MXFP4Linear.from_weight(mx_weight(raw, in_features), torch.zeros(out_features) if bias else None)
    scheme = GGUFScheme(gguf.GGMLQuantizationType(ggml_type).name.lower())
    module = GGUFLinear(in_features, out_features, scheme, bias)
    if tuple(raw.shape) != tuple(module.weight.shape):
        raise ValueError(f"holds {tuple(raw.shape)} bytes of {scheme.type}; the model in config.json needs "
                         f"{tuple(module.weight.shape)}")
    module.weight.copy_(raw)
    return module


def mxfp4_blocks(mw: MXWeight) -> torch.Tensor:
    """An MXFP4 weight as GGML MXFP4 blocks, (rows, in / 32 * 17) uint8."""
    rows, cols = mw.codes.shape
    codes = mw.codes.reshape(rows, cols // BLOCK, BLOCK)
    packed = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)
    return torch.cat([mw.exponents.reshape(rows, -1, 1), packed], dim=-1).reshape(rows, -1).contiguous()


def mx_weight(raw: torch.Tensor, in_features: int) -> MXWeight:
    """GGML MXFP4 blocks back as the MXFP4 weight they hold."""
    rows = raw.shape[0]
    if raw.shape[-1] * BLOCK != in_features * MXFP4_BLOCK_BYTES:
        raise ValueError(f"holds {tuple(raw.shape)} bytes of MXFP4; the model in config.json needs "
                         f"{(rows, in_features // BLOCK * MXFP4_BLOCK_BYTES)}")
    blocks = raw.reshape(rows, -1, MXFP4_BLOCK_BYTES)
    packed = blocks[..., 1:]
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, in_features)
    return MXWeight(codes.contiguous(), blocks[..., 0].contiguous())
