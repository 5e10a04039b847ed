"""GPTQ: quantize a weight column by column, pushing each column's rounding error onto the columns
not yet quantized, weighted by the inverse Hessian of the layer's inputs (Frantar et al., 2022).

The core `gptq_solve(W, H, cfg)` is a pure function of the weight (out, in) and the Hessian
H = 2/N · XᵀX (in, in); `apply` walks the decoder layers, quantizing true-sequential groups
([q,k,v] → [o] → [gate,up] → [down]) each on inputs recorded after the groups before it.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, replace
from typing import Literal, Union

import torch
from torch import nn

from lowbit.calibrate.arch import linear_weight
from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids.gguf_plan import GGUFTypes
from lowbit.quantize.grids.int_plan import IntTypes
from lowbit.quantize.grids.integer import IntScheme, check_group_size
from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.grids.quantized_weight import QuantizedWeight, quantize_rtn
from lowbit.quantize.runtime.buffers import on_device
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.quantize.steps import gguf_rounding, int_planning
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.gptq_solver import GPTQResult, HessianAccumulator, gptq_solve
from lowbit.quantize.steps.layerwise import damping_retries, linear_stats, walk_solving
from lowbit.quantize.steps.spec import WALK, StepSpec
from lowbit.quantize.targets import replace_module, select_targets


@dataclass(frozen=True)
class GPTQConfig:
    # channel or group, not tensor; or a llama.cpp file type (GGUFTypes): GPTQ onto its block grids;
    # or a format per linear (IntTypes): linears sharing an input solved once per format
    scheme: Union[IntScheme, GGUFTypes, IntTypes] = IntScheme(4, True, "group", 128)
    batch_columns: int = 128  # columns per lazy batch update; rounded to a multiple of group_size
    dampening_frac: float = 0.01  # added to H's diagonal, as a fraction of its mean diagonal
    # none: columns in order; static: columns by decreasing Hessian diagonal, groups fixed
    # beforehand (no runtime permutation); group: groups formed in that order (needs g_idx)
    actorder: Literal["none", "static", "group"] = "static"
    # minmax: a group's range is its min/max; mse: shrink the range to minimise the group's
    # rounding error weighted by the Hessian diagonal (clipping a few outliers costs less)
    scale_search: Literal["minmax", "mse"] = "minmax"
    # re-record inputs after each group of a layer ([q,k,v] -> [o] -> [gate,up] -> [down]) is
    # quantized: ~3 forwards per layer instead of 1 (on smollm2-135m W4 no better: 19.03 vs 18.99)
    true_sequential: bool = True
    micro_batch: int = 8  # calibration samples per forward pass
    # dtype of the calibration forwards (autocast; Hessians and the solve stay float32). auto:
    # bfloat16 where the device has fast bf16 matmuls (CUDA, CPUs where cpu_info().bf16_native),
    # else float32 (torch emulates bf16 on other CPUs: a 4096x576x1536 matmul 9x slower on AVX2)
    forward_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # GGUF Q8_0/Q4_0/Q4_1/Q5_0 with actorder static: times the block scales are refitted by least
    # squares to the levels the sweep chose (a new sweep onto them between refits); 0: scales as searched
    scale_refits: int = 0

    def __post_init__(self):
        if isinstance(self.scheme, IntScheme) and self.scheme.strategy == "tensor":
            raise ValueError("gptq solves per-channel or per-group scales; scheme strategy tensor is not "
                             "supported (use channel or group)")
        if self.batch_columns < 1 or self.micro_batch < 1:
            raise ValueError("batch_columns and micro_batch must be positive")
        if self.scale_search not in ("minmax", "mse"):
            raise ValueError(f"scale_search must be minmax or mse, got {short_repr(self.scale_search)}")
        if not 0 <= self.dampening_frac < 10:
            raise ValueError(f"dampening_frac must be in [0, 10), got {self.dampening_frac}")
        if not 0 <= self.scale_refits <= 10:
            raise ValueError(f"scale_refits must be between 0 and 10, got {self.scale_refits}")
        if self.forward_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"forward_dtype must be auto, bfloat16 or float32, got {short_repr(self.forward_dtype)}")


def apply(ctx: StepContext, cfg: GPTQConfig) -> dict:
    """Quantize every targeted linear inside the decoder layers with GPTQ, layer by layer."""
    if isinstance(cfg.scheme, GGUFTypes):
        return _apply_gguf(ctx, cfg)
    if isinstance(cfg.scheme, IntTypes):
        return _apply_planned(ctx, cfg)
    targets = select_targets(ctx.model, ctx.arch, ctx.ignore)
    for name, module in targets.linears.items():
        check_group_size(cfg.scheme, linear_weight(module).shape[1], name)
    return _solve_all(ctx, cfg, targets, {name: cfg.scheme for name in targets.linears})


def _apply_planned(ctx: StepContext, cfg: GPTQConfig) -> dict:
    targets, schemes = int_planning.planned_targets(ctx, cfg.scheme)
    return _solve_all(ctx, cfg, targets, schemes)


def _solve_all(ctx: StepContext, cfg: GPTQConfig, targets, schemes: dict[str, IntScheme]) -> dict:
    """GPTQ on every target in the decoder layers, each onto its own scheme; targets outside them
    (lm_head) round to nearest."""
    outside = {n: m for n, m in targets.linears.items() if not n.startswith(ctx.arch.layers + ".")}

    def install(prefix, layer, members, parts, stats) -> dict:
        solved = {}
        for names, result in parts:
            for name, qw in _install_shared(layer, names, result, stats).items():
                old = layer.get_submodule(name)
                device = qw.codes.device if old.weight.is_meta else old.weight.device  # meta: let go by the solve
                solved[name] = QuantLinear.from_quantized(on_device(qw, device), old.bias)
        return solved

    def solve(prefix, layer, members, hessian):
        groups = list(int_planning.by_scheme(prefix, members, schemes).items())
        if len(groups) == 1:  # the usual case: the accumulator is handed over, freed once factored
            (scheme, names), = groups
            return [(names, _solve_shared(layer, names, hessian, replace(cfg, scheme=scheme)))]
        H = hessian.take()  # one solve per format, rows stacked within each
        return [(names, _solve_shared(layer, names, H if k == len(groups) - 1 else H.clone(), replace(cfg, scheme=scheme)))
                for k, (scheme, names) in enumerate(groups)]

    quantized = list(targets.linears)
    layers, forward_dtype = walk_solving(ctx, cfg, targets, solve, install)
    for name, module in outside.items():  # lm_head etc. see no decoder-layer inputs: RTN
        warnings.warn(f"{name} is outside the decoder layers; quantized round-to-nearest, not GPTQ")
        replace_module(ctx.model, name, QuantLinear.from_quantized(quantize_rtn(linear_weight(module), schemes[name]),
                                                                   module.bias))
    return {"quantized": quantized, "ignored": targets.ignored,
            "forward_dtype": forward_dtype, "round_to_nearest": list(outside),
            "damping_retries": damping_retries(layers), "layers": layers}


def _apply_gguf(ctx: StepContext, cfg: GPTQConfig) -> dict:
    targets, schemes = gguf_rounding.planned_targets(ctx, cfg.scheme)
    outside = {n: m for n, m in targets.linears.items() if not n.startswith(ctx.arch.layers + ".")}

    def solve(prefix, layer, members, hessian):
        return gguf_rounding.solve_layer_group(layer, prefix, members, hessian.take(), cfg, schemes)

    def install(prefix, layer, members, result, stats) -> dict:
        return gguf_rounding.install_layer_group(layer, result, stats)

    quantized = list(targets.linears)
    layers, forward_dtype = walk_solving(ctx, cfg, targets, solve, install)
    return {"quantized": quantized, "ignored": targets.ignored, "forward_dtype": forward_dtype,
            "round_to_nearest": gguf_rounding.round_outside(ctx, outside, schemes),
            "types": {n: s.type for n, s in schemes.items()},
            "damping_retries": damping_retries(layers), "layers": layers}


def _solve_shared(layer, members, hessian: HessianAccumulator, cfg: GPTQConfig) -> tuple[GPTQResult, float]:
    """One GPTQ solve for linears sharing an input (rows stacked), which takes the Hessian's memory;
    and its seconds per linear."""
    modules = [layer.get_submodule(n) for n in members]
    start = time.perf_counter()

    def stacked() -> torch.Tensor:  # made once the Hessian is factored: not beside its two matrices
        weights = [linear_weight(m) for m in modules]
        if not cfg.true_sequential:  # nothing reads the float weights again (install replaces the
            for m in modules:  # linears): the solve's copy is the only one left (0.22 GiB, down_proj of 8B)
                m.weight = nn.Parameter(torch.empty_like(m.weight, device="meta"), requires_grad=False)
        return weights[0].float() if len(weights) == 1 else torch.cat([w.float() for w in weights])

    result = gptq_solve(stacked, hessian, cfg)
    return result, (time.perf_counter() - start) / len(members)


def _install_shared(layer, members, solved: tuple[GPTQResult, float], stats: dict) -> dict[str, QuantizedWeight]:
    """The stacked solve split back per linear, each one's rounded values written into it."""
    result, seconds = solved
    out = {}
    row = 0
    for name in members:
        w = linear_weight(layer.get_submodule(name))
        rows = slice(row, row + w.shape[0])
        row += w.shape[0]
        qw = _row_slice(result.weight, rows)
        if not w.is_meta:  # with true_sequential later groups see the quantized layer
            w.copy_(qw.dequantize())
        out[name] = qw
        stats[name] = linear_stats(result.row_loss[rows], result.dampening_frac, result.retries, seconds)
    return out


def _row_slice(qw: QuantizedWeight, rows: slice) -> QuantizedWeight:
    zero = None if qw.zero is None else qw.zero[rows]
    return QuantizedWeight(qw.codes[rows], qw.scale[rows], zero, qw.scheme, qw.g_idx)


SPEC = StepSpec("gptq", GPTQConfig, apply, "GPTQ: error-compensating weight quantization, layer by layer",
                writes=lambda cfg: LinearScheme(cfg.scheme), streamed=lambda cfg: WALK)
