"""Weight steps onto GGUF grids: which linears get which GGML type (targets.gguf_types), round to
nearest as llama.cpp does, and GPTQ onto the same block grids (gptq_solver.gptq_solve_gguf)."""
from __future__ import annotations

import time
import warnings

import torch

from lowbit.calibrate.arch import linear_weight
from lowbit.calibrate.progress import Progress
from lowbit.quantize.grids.gguf import GGUFScheme, quantize_gguf
from lowbit.quantize.grids.gguf_plan import GGUFTypes, sixteen_bit_reason
from lowbit.quantize.runtime.buffers import on_device
from lowbit.quantize.runtime.gguf_linear import GGUFLinear
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.gptq_solver import gptq_solve_gguf
from lowbit.quantize.steps.layerwise import linear_stats
from lowbit.quantize.targets import Targets, gguf_types, replace_module, select_targets



def planned_targets(ctx: StepContext, types: GGUFTypes) -> tuple[Targets, dict[str, GGUFScheme]]:
    """The targets and each one's GGML type; linears no block fits move to targets.ignored."""
    targets = select_targets(ctx.model, ctx.arch, ctx.ignore)
    kinds = gguf_types(ctx.model, ctx.arch, targets.linears, types)
    for name, kind in kinds.items():
        if kind is None:
            targets.ignored[name] = sixteen_bit_reason(types, name)
            del targets.linears[name]
    return targets, {n: GGUFScheme(k) for n, k in kinds.items() if k is not None}


def round_each(ctx: StepContext, types: GGUFTypes, label: str = "rtn") -> dict:
    """llama.cpp's reference round-to-nearest on every targeted linear (no data)."""
    targets, schemes = planned_targets(ctx, types)
    progress = Progress(label, len(targets.linears), "linears")
    for name, module in targets.linears.items():
        gw = quantize_gguf(linear_weight(module), schemes[name], name)
        replace_module(ctx.model, name, GGUFLinear.from_weight(gw, module.bias))
        progress.step()
    return {"quantized": list(targets.linears), "ignored": targets.ignored,
            "types": {n: s.type for n, s in schemes.items()}}


def solve_layer_group(layer, prefix: str, members: list[str], H: torch.Tensor, cfg, schemes: dict) -> list:
    """GPTQ for linears sharing one input: one solve per GGML type (rows stacked, as rows are
    independent given H). Pure: [(names, GGUFWeight, row_loss, damping, retries, seconds)]."""
    by_type: dict[str, list[str]] = {}
    for name in members:
        by_type.setdefault(schemes[f"{prefix}.{name}"].type, []).append(name)
    parts = []
    for kind, names in by_type.items():
        weights = [linear_weight(layer.get_submodule(n)) for n in names]
        start = time.perf_counter()
        gw, row_loss, frac, retries = gptq_solve_gguf(torch.cat([w.float() for w in weights]), H, cfg,
                                                      GGUFScheme(kind))
        parts.append((names, gw, row_loss, frac, retries, (time.perf_counter() - start) / len(names)))
    return parts


def install_layer_group(layer, parts: list, stats: dict) -> dict:
    """solve_layer_group's weights split back per linear as GGUFLinears, the rounded weights
    written back for later groups to see."""
    solved = {}
    for names, gw, row_loss, frac, retries, seconds in parts:
        row = 0
        for name in names:
            module = layer.get_submodule(name)
            w = linear_weight(module)
            rows = slice(row, row + w.shape[0])
            row += w.shape[0]
            part = gw.row_slice(rows)
            w.copy_(part.dequantize().to(w.dtype))  # later groups see the quantized layer
            solved[name] = GGUFLinear.from_weight(on_device(part, w.device), module.bias)
            stats[name] = linear_stats(row_loss[rows], frac, retries, seconds)
    return solved


def round_outside(ctx: StepContext, outside: dict, schemes: dict) -> list[str]:
    """Targets outside the decoder layers (lm_head) see no layer inputs: round to nearest."""
    for name, module in outside.items():
        warnings.warn(f"{name} is outside the decoder layers; quantized round-to-nearest, not GPTQ")
        gw = quantize_gguf(linear_weight(module), schemes[name], name)
        replace_module(ctx.model, name, GGUFLinear.from_weight(gw, module.bias))
    return list(outside)
