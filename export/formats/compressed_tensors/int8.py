"""compressed-tensors `int-quantized`: W8A8 — int8 weights with int8 input activations, as a
QuantLinear whose `input_quant` is set (quantize/activation.py).

Tensors: `weight` int8 (out, in) holding the signed codes; `weight_scale` (out, 1) channel or
(1,) tensor; `weight_zero_point` int8 like the scale when asymmetric; `input_scale` (1,) for
static per-tensor activations (dynamic per-token ones carry none). Dequantization:
(weight - zero) * scale.
"""
from __future__ import annotations

import torch

from lowbit.quantize.grids.inputs import InputQuant
from lowbit.quantize.runtime.qlinear import QuantLinear

from .packed import READS as PACKED_READS, group_scheme, scheme_from_args
from .shape_checks import input_scale_problems, scale_problem, zero_problems

FORMAT = "int-quantized"
STORED = ("weight", "I8", "int8 codes (int-quantized)")  # tensor suffix, safetensors dtype, what
READS = PACKED_READS  # packed's weights with int8 inputs: the agreement check lists them once


def handles(module) -> bool:
    return isinstance(module, QuantLinear) and module.input_quant is not None


def reads(group: dict) -> bool:
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
    return weights.get("type") == "int" and inputs.get("type") == "int"


def scheme_entry(name: str, module: QuantLinear) -> dict:
    s, iq = module.scheme, module.input_quant
    if s.bits != 8 or s.strategy == "group" or module.weight_g_idx is not None:
        raise ValueError(f"layer {name}: int-quantized (W8A8) export needs 8-bit per-channel or "
                         f"per-tensor weights without act-order, got {s}")
    weights = {"num_bits": 8, "type": "int", "symmetric": s.symmetric, "strategy": s.strategy,
               "group_size": None, "dynamic": False, "actorder": None}
    inputs = {"num_bits": iq.bits, "type": "int", "symmetric": True, "group_size": None,
              "strategy": "token" if iq.dynamic else "tensor", "dynamic": iq.dynamic}
    return {"weights": weights, "input_activations": inputs, "output_activations": None, "format": FORMAT}


def module_tensors(prefix: str, module: QuantLinear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    scale = module.weight_scale.reshape(1) if module.scheme.strategy == "tensor" else module.weight_scale
    out = {f"{prefix}.weight": module.weight_codes.contiguous(),
           f"{prefix}.weight_scale": scale.to(dtype).contiguous()}
    if module.weight_zero is not None:
        out[f"{prefix}.weight_zero_point"] = module.weight_zero.reshape(scale.shape).round().to(torch.int8)
    if module.input_scale is not None:
        out[f"{prefix}.input_scale"] = module.input_scale.reshape(1).to(dtype)
    if module.bias is not None:
        out[f"{prefix}.bias"] = module.bias.to(dtype)
    return out


def config_problems(prefix: str, table, group: dict, where: str) -> list[str]:
    """How one module's tensors in `table` (a TensorTable) disagree with its config `group` at `where`."""
    scheme, problems = group_scheme(prefix, group, where)
    if scheme is None:
        return problems
    out_f, in_f = table.shape(f"{prefix}.weight")
    problems = scale_problem(prefix, table, scheme, out_f, in_f, where)
    problems += zero_problems(prefix, table, scheme, (1,) if scheme.strategy == "tensor" else (out_f, 1), where)
    return problems + input_scale_problems(prefix, table, group, where)


def build_module(prefix: str, tensors: dict[str, torch.Tensor], group: dict) -> QuantLinear:
    scheme = scheme_from_args(group["weights"], prefix)
    inputs = group["input_activations"]
    if not inputs.get("symmetric", True) or inputs.get("strategy") not in ("token", "tensor"):
        raise ValueError(f"layer {prefix}: input_activations {inputs} not supported; supported: "
                         "symmetric int8, dynamic per-token or static per-tensor")
    iq = InputQuant(bits=inputs["num_bits"], dynamic=bool(inputs.get("dynamic")))
    take = lambda key: tensors.pop(f"{prefix}.{key}", None)  # noqa: E731
    codes, scale, zp, bias, input_scale = (take(k) for k in
                                           ("weight", "weight_scale", "weight_zero_point", "bias", "input_scale"))
    out_f, in_f = codes.shape
    scale = scale.float().reshape(1, 1) if scheme.strategy == "tensor" else scale.float().reshape(out_f, 1)
    module = QuantLinear(in_f, out_f, scheme, bias is not None, 1, False, iq)
    module.weight_codes.copy_(codes.to(torch.int8))
    module.weight_scale = scale
    if zp is not None:
        module.weight_zero = zp.float().reshape(scale.shape)
    if not iq.dynamic:
        if input_scale is None:
            raise ValueError(f"layer {prefix}: static input_activations but no {prefix}.input_scale tensor")
        module.input_scale = input_scale.float().reshape(1)
    if bias is not None:
        module.bias = bias.float()
    return module
