"""The compressed-tensors checkpoint format: what vLLM and transformers load natively.

Integer weights are written `pack-quantized`: signed codes shifted by 2^(bits-1) and packed
into int32 along in_features (`weight_packed`), with `weight_scale`, `weight_zero_point`
(asymmetric only, packed along out_features) and `weight_shape`.
"""
from __future__ import annotations

from typing import Iterable

import torch

from lowbit.quantize.activation import InputQuant
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


def input_args(module: QuantLinear) -> dict | None:
    """compressed-tensors input_activations args of a QuantLinear, None when inputs stay float."""
    iq = module.input_quant
    if iq is None:
        return None
    return {"num_bits": iq.bits, "type": "int", "symmetric": True,
            "strategy": "token" if iq.dynamic else "tensor", "group_size": None,
            "block_structure": None, "dynamic": iq.dynamic, "actorder": None,
            "observer": None if iq.dynamic else "minmax", "observer_kwargs": {}}


def quantization_config(modules: dict[str, QuantLinear], ignore: Iterable[str]) -> dict:
    """One config group per distinct weight scheme, targeting its modules by name."""
    groups: dict[str, dict] = {}
    by_args: dict[str, str] = {}
    for name, module in modules.items():
        args = weight_args(module.scheme, module.weight_g_idx is not None)
        inputs = input_args(module)
        key = repr((sorted(args.items()), sorted((inputs or {}).items())))
        if key not in by_args:
            by_args[key] = f"group_{len(by_args)}"
            groups[by_args[key]] = {"targets": [], "weights": args, "input_activations": inputs,
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
    if module.input_scale is not None:  # static input quantization
        out[f"{prefix}.input_scale"] = module.input_scale.float()
    return out


def _scale_for_file(scale: torch.Tensor, scheme: IntScheme) -> torch.Tensor:
    return scale.reshape(1) if scheme.strategy == "tensor" else scale


def scheme_from_args(args: dict, where: str) -> IntScheme:
    if args.get("type") != "int":
        raise ValueError(f"{where}: weights of type {args.get('type')!r} are not supported yet; supported: int")
    return IntScheme(bits=args["num_bits"], symmetric=args["symmetric"], strategy=args["strategy"],
                     group_size=args.get("group_size") if args["strategy"] == "group" else None)


def input_quant_from_args(args: dict | None, where: str) -> InputQuant | None:
    if args is None:
        return None
    if args.get("type") != "int" or not args.get("symmetric", True) or \
            args.get("strategy") != ("token" if args.get("dynamic") else "tensor"):
        raise ValueError(f"{where}: input_activations {args} not supported; supported: symmetric int8, "
                         "dynamic per-token or static per-tensor")
    return InputQuant(bits=args["num_bits"], dynamic=bool(args["dynamic"]))


def build_module(prefix: str, tensors: dict[str, torch.Tensor], args: dict,
                 inputs: dict | None = None) -> QuantLinear:
    scheme = scheme_from_args(args, prefix)
    iq = input_quant_from_args(inputs, prefix)
    out_f, in_f = (int(v) for v in tensors[f"{prefix}.weight_shape"].tolist())
    offset = 2 ** (scheme.bits - 1)
    codes = unpack_codes(tensors[f"{prefix}.weight_packed"], scheme.bits, in_f).to(torch.int16) - offset
    scale = tensors[f"{prefix}.weight_scale"].float()
    scale = scale.reshape(1, 1) if scheme.strategy == "tensor" else scale
    g_idx = tensors.get(f"{prefix}.weight_g_idx")
    bias = tensors.get(f"{prefix}.bias")
    module = QuantLinear(in_f, out_f, scheme, bias is not None, scale.shape[1], g_idx is not None, iq)
    if iq is not None and not iq.dynamic:
        module.input_scale = tensors[f"{prefix}.input_scale"].float().reshape(1)
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


def args_for_module(name: str, qconfig: dict, kind: str = "weights") -> dict | None:
    """The `kind` args (weights, input_activations) of the config group that targets `name`."""
    fallback = None
    for group in qconfig["config_groups"].values():
        if name in group["targets"]:
            return group.get(kind)
        if "Linear" in group["targets"]:
            fallback = group
    if fallback is None:
        raise ValueError(f"no config group in quantization_config targets {name}")
    return fallback.get(kind)
