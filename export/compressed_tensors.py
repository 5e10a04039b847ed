"""The compressed-tensors checkpoint format: what vLLM and transformers load natively.

Integer weights are written `pack-quantized`: signed codes shifted by 2^(bits-1) and packed
into int32 along in_features (`weight_packed`), with `weight_scale`, `weight_zero_point`
(asymmetric only, packed along out_features) and `weight_shape`.
"""
from __future__ import annotations

from typing import Iterable

import torch

from lowbit.quantize.primitives import IntScheme, pack_codes, unpack_codes
from lowbit.quantize.qlinear import QuantLinear

FORMAT = "pack-quantized"
QUANT_METHOD = "compressed-tensors"


def weight_args(scheme: IntScheme, act_order: bool) -> dict:
    return {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "strategy": scheme.strategy,
        "group_size": scheme.group_size,
        "block_structure": None,
        "dynamic": False,
        "actorder": "group" if act_order else None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def quantization_config(modules: dict[str, QuantLinear], ignore: Iterable[str]) -> dict:
    """One config group per distinct weight scheme, targeting its modules by name."""
    groups: dict[str, dict] = {}
    by_args: dict[str, str] = {}
    for name, module in modules.items():
        args = weight_args(module.scheme, module.weight_g_idx is not None)
        key = repr(sorted(args.items()))
        if key not in by_args:
            by_args[key] = f"group_{len(by_args)}"
            groups[by_args[key]] = {"targets": [], "weights": args, "input_activations": None,
                                    "output_activations": None, "format": FORMAT}
        groups[by_args[key]]["targets"].append(name)
    if len(groups) == 1:  # the common case: one scheme for every Linear that is not ignored
        next(iter(groups.values()))["targets"] = ["Linear"]
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
    }


def module_tensors(prefix: str, module: QuantLinear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    s = module.scheme
    offset = 2 ** (s.bits - 1)
    out = {
        f"{prefix}.weight_packed": pack_codes(module.weight_codes.to(torch.int16) + offset, s.bits),
        f"{prefix}.weight_scale": _scale_for_file(module.weight_scale, s).to(dtype),
        f"{prefix}.weight_shape": torch.tensor([module.out_features, module.in_features]),
    }
    if module.weight_zero is not None:
        zero = module.weight_zero.round().to(torch.int16) + offset  # (out, G)
        out[f"{prefix}.weight_zero_point"] = pack_codes(zero.t().contiguous(), s.bits).t().contiguous()
    if module.weight_g_idx is not None:
        out[f"{prefix}.weight_g_idx"] = module.weight_g_idx.to(torch.int32)
    if module.bias is not None:
        out[f"{prefix}.bias"] = module.bias.to(dtype)
    return out


def _scale_for_file(scale: torch.Tensor, scheme: IntScheme) -> torch.Tensor:
    return scale.reshape(1) if scheme.strategy == "tensor" else scale


def scheme_from_args(args: dict, where: str) -> IntScheme:
    if args.get("type") != "int":
        raise ValueError(f"{where}: weights of type {args.get('type')!r} are not supported yet; supported: int")
    return IntScheme(bits=args["num_bits"], symmetric=args["symmetric"], strategy=args["strategy"],
                     group_size=args.get("group_size") if args["strategy"] == "group" else None)


def build_module(prefix: str, tensors: dict[str, torch.Tensor], args: dict) -> QuantLinear:
    scheme = scheme_from_args(args, prefix)
    out_f, in_f = (int(v) for v in tensors[f"{prefix}.weight_shape"].tolist())
    offset = 2 ** (scheme.bits - 1)
    codes = unpack_codes(tensors[f"{prefix}.weight_packed"], scheme.bits, in_f).to(torch.int16) - offset
    scale = tensors[f"{prefix}.weight_scale"].float()
    scale = scale.reshape(1, 1) if scheme.strategy == "tensor" else scale
    g_idx = tensors.get(f"{prefix}.weight_g_idx")
    bias = tensors.get(f"{prefix}.bias")
    module = QuantLinear(in_f, out_f, scheme, bias is not None, scale.shape[1], g_idx is not None)
    module.weight_codes.copy_(codes.to(torch.int8))
    module.weight_scale = scale
    zp = tensors.get(f"{prefix}.weight_zero_point")
    if zp is not None:
        rows = scale.shape[0]
        module.weight_zero = unpack_codes(zp.t().contiguous(), scheme.bits, rows).t().float() - offset
    if g_idx is not None:
        module.weight_g_idx = g_idx.to(torch.int32)
    if bias is not None:
        module.bias = bias.float()
    return module


def args_for_module(name: str, qconfig: dict) -> dict:
    """The weight args of the config group that targets `name` (by name or by class Linear)."""
    fallback = None
    for group in qconfig["config_groups"].values():
        if name in group["targets"]:
            return group["weights"]
        if "Linear" in group["targets"]:
            fallback = group["weights"]
    if fallback is None:
        raise ValueError(f"no config group in quantization_config targets {name}")
    return fallback
