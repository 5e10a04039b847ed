"""compressed-tensors `float-quantized`: FP8 (E4M3) weights, with dynamic per-token or static
per-tensor FP8 activations or none, as lowbit's FP8Linear (quantize/fp8_linear.py).

Tensors: `weight` float8_e4m3fn (out, in); `weight_scale` (1,) tensor, (out, 1) channel or
(ceil(out / b), ceil(in / b)) block; `input_scale` (1,) for static activations. Dequantization:
weight * scale (per element of its tensor / row / block).
"""
from __future__ import annotations

import torch

from .shape_checks import input_scale_problems, shape_problem

FORMAT = "float-quantized"
STORED = ("weight", "F8_E4M3", "float8_e4m3fn values (float-quantized)")  # tensor suffix, safetensors dtype, what
READS = "float 8 bits"  # the weights this codec reads, as the agreement check lists them
WEIGHT_STRATEGIES = ("tensor", "channel", "block")


def handles(module) -> bool:
    return type(module).__name__ == "FP8Linear"  # by name: the FP8 runtime is optional here


def reads(group: dict) -> bool:
    weights = group.get("weights") or {}
    return weights.get("type") == "float" and weights.get("num_bits") == 8


def scheme_entry(name: str, module) -> dict:
    if module.fmt != "e4m3":
        raise ValueError(f"layer {name}: compressed-tensors stores FP8 as E4M3 only, not {module.fmt}")
    block = module.weight_strategy == "block"
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": module.weight_strategy,
               "group_size": None, "dynamic": False, "block_structure": [module.block_size] * 2 if block else None}
    inputs = None
    if module.activations != "none":
        dynamic = module.activations == "dynamic"
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                  "strategy": "token" if dynamic else "tensor", "dynamic": dynamic}
    return {"weights": weights, "input_activations": inputs, "output_activations": None, "format": FORMAT}


def module_tensors(prefix: str, module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    scale = module.weight_scale.reshape(1) if module.weight_strategy == "tensor" else module.weight_scale
    out = {f"{prefix}.weight": module.weight.contiguous(), f"{prefix}.weight_scale": scale.to(dtype).contiguous()}
    if module.input_scale is not None:
        out[f"{prefix}.input_scale"] = module.input_scale.reshape(1).to(dtype)
    if module.bias is not None:
        out[f"{prefix}.bias"] = module.bias.to(dtype)
    return out


def config_problems(prefix: str, table, group: dict, where: str) -> list[str]:
    """How one module's tensors in `table` (a TensorTable) disagree with its config `group` at `where`."""
    weights = group["weights"]
    out_f, in_f = table.shape(f"{prefix}.weight")
    strategy = weights.get("strategy")
    block = (weights.get("block_structure") or [128])[0]
    need = {"tensor": (1,), "channel": (out_f, 1), "block": (-(-out_f // block), -(-in_f // block))}.get(strategy)
    if need is None:
        return [f"{prefix}.weight_scale: {where}.weights.strategy is {strategy!r}; "
                f"supported: {', '.join(WEIGHT_STRATEGIES)}"]
    said = f"{where}.weights.strategy {strategy}" + (f", block {block}" if strategy == "block" else "")
    problems = shape_problem(f"{prefix}.weight_scale", table, need, f"{said} needs {need}",
                             numel_only=strategy == "tensor")
    return problems + input_scale_problems(prefix, table, group, where)


def build_module(prefix: str, tensors: dict[str, torch.Tensor], group: dict):
    from lowbit.quantize.runtime.fp8_linear import FP8Linear  # present where the FP8 scheme is

    weights, inputs = group["weights"], group.get("input_activations")
    strategy = weights.get("strategy")
    if strategy not in WEIGHT_STRATEGIES:
        raise ValueError(f"layer {prefix}: FP8 weight strategy {strategy!r}; supported: {WEIGHT_STRATEGIES}")
    activations = "none" if not inputs else ("dynamic" if inputs.get("dynamic") else "static")
    weight, scale = tensors.pop(f"{prefix}.weight"), tensors.pop(f"{prefix}.weight_scale").float()
    bias, input_scale = tensors.pop(f"{prefix}.bias", None), tensors.pop(f"{prefix}.input_scale", None)
    scale = scale.reshape(1, 1) if strategy == "tensor" else scale
    block = (weights.get("block_structure") or [128])[0]
    module = FP8Linear(weight.shape[1], weight.shape[0], "e4m3", strategy, activations, bias is not None,
                       tuple(scale.shape), block)
    module.weight.copy_(weight.to(torch.float8_e4m3fn))
    module.weight_scale.copy_(scale)
    if input_scale is not None:
        module.input_scale.copy_(input_scale.float().reshape(()))
    if bias is not None:
        module.bias = bias.float()
    return module
