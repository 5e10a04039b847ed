"""compressed-tensors `mxfp4-pack-quantized`: MXFP4 weights, 16-bit inputs (MXFP4A16), as lowbit's
MXFP4Linear (quantize/runtime/mxfp4_linear.py).

Tensors, as compressed-tensors 0.20 writes and reads them: `weight_packed` uint8 (out, in / 2), two
E2M1 codes per byte, the first in the low nibble; `weight_scale` uint8 (out, in / 32), E8M0
exponents (biased by 127). The config's weights: float, 4 bits, symmetric, group 32, scale_dtype
uint8. Dequantization: e2m1(code) * 2^(scale - 127).
"""
from __future__ import annotations

import torch

from .shape_checks import shape_problem

FORMAT = "mxfp4-pack-quantized"
STORED = ("weight_packed", "U8", "E2M1 codes, two per byte (mxfp4-pack-quantized)")
READS = "float 4 bits group 32 (MXFP4)"
WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
           "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"}


def handles(module) -> bool:
    return type(module).__name__ == "MXFP4Linear"


def reads(group: dict) -> bool:
    weights = group.get("weights") or {}
    return weights.get("type") == "float" and weights.get("num_bits") == 4 and weights.get("group_size") == 32


def scheme_entry(name: str, module) -> dict:
    return {"weights": dict(WEIGHTS), "input_activations": None, "output_activations": None, "format": FORMAT}


def module_tensors(prefix: str, module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {f"{prefix}.weight_packed": module.weight_packed.contiguous(),
           f"{prefix}.weight_scale": module.weight_scale.contiguous()}  # uint8 exponents: no dtype cast
    if module.bias is not None:
        out[f"{prefix}.bias"] = module.bias.to(dtype)
    return out


def config_problems(prefix: str, table, group: dict, where: str) -> list[str]:
    """uint8 exponents, one per 32 of the packed row's weights; no input quantization."""
    if group.get("input_activations"):
        return [f"{prefix}.weight_scale: {where}.input_activations is set; lowbit reads MXFP4 with 16-bit inputs"]
    rows, half = table.shape(f"{prefix}.weight_packed")
    name = f"{prefix}.weight_scale"
    if name in table and table.dtype(name) != "U8":
        return [f"{name}: {table.dtype(name)}, but MXFP4 stores E8M0 exponents as uint8 (U8)"]
    need = (rows, half * 2 // 32)
    return shape_problem(name, table, need, f"{where}.weights (group_size 32) needs {need}")


def build_module(prefix: str, tensors: dict[str, torch.Tensor], group: dict):
    from lowbit.quantize.runtime.mxfp4_linear import MXFP4Linear

    if group.get("input_activations"):
        raise ValueError(f"layer {prefix}: MXFP4 with quantized inputs is not supported; lowbit reads MXFP4A16")
    packed, scale = tensors.pop(f"{prefix}.weight_packed"), tensors.pop(f"{prefix}.weight_scale")
    bias = tensors.pop(f"{prefix}.bias", None)
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"layer {prefix}: MXFP4 weight_packed and weight_scale must be uint8, "
                         f"got {packed.dtype} and {scale.dtype}")
    rows, cols = packed.shape[0], packed.shape[1] * 2
    if cols % 32 or tuple(scale.shape) != (rows, cols // 32):
        raise ValueError(f"layer {prefix}: MXFP4 weight_scale is {tuple(scale.shape)}; weight_packed "
                         f"{tuple(packed.shape)} needs ({rows}, {cols // 32}), one per 32 weights")
    module = MXFP4Linear(cols, rows, bias is not None)
    module.weight_packed.copy_(packed)
    module.weight_scale.copy_(scale)
    if bias is not None:
        module.bias = bias.float()
    return module
