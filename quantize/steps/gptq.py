"""GPTQ: quantize a weight column by column, pushing each column's rounding error onto the columns
not yet quantized, weighted by the inverse Hessian of the layer's inputs (Frantar et al., 2022).

The core `gptq_solve(W, H, cfg)` is a pure function of the weight (out, in) and the Hessian
H = 2/N · XᵀX (in, in); `apply` walks the decoder layers, quantizing true-sequential groups
([q,k,v] → [o] → [gate,up] → [down]) each on inputs recorded after the groups before it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lowbit.calibrate.arch import linear_weight
from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.grids.linear import LinearScheme, Plan
from lowbit.quantize.runtime.buffers import on_device
from lowbit.quantize.runtime.modules import module_for
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.gptq_solver import GPTQResult, HessianAccumulator, solve_onto
from lowbit.quantize.steps.layerwise import damping_retries, linear_stats, outside_layers, round_outside, walk_solving
from lowbit.quantize.steps.spec import WALK, StepSpec
from lowbit.quantize.targets import planned_targets


@dataclass(frozen=True)
class GPTQConfig:
    # channel or group, not tensor; or FP8 (channel or block: scales fixed from the weight's ranges,
    # each linear solved alone unless per channel); or a llama.cpp file type (GGUFTypes): GPTQ onto
    # its block grids; or a format per linear (LinearFormats): linears sharing an input solved once per format
    scheme: Plan = IntScheme(4, True, "group", 128)
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
        if not self.scheme.scales_per_row():
            raise ValueError("gptq solves per-channel, per-group or per-block scales; scheme strategy tensor is "
                             "not supported (use channel, group, or block for fp8)")
        if self.actorder == "group" and not self.scheme.orders_groups():
            raise ValueError(f"actorder group forms integer groups in the Hessian's order; {self.scheme.describe()} "
                             "fixes its scales whatever the order: use actorder static or none")
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
    """Quantize every targeted linear inside the decoder layers with GPTQ, layer by layer, each onto
    the grid the plan gives it; targets outside the layers (lm_head) round to nearest."""
    targets, grids = planned_targets(ctx.model, ctx.arch, ctx.ignore, cfg.scheme)
    outside = outside_layers(ctx, targets)

    def solve(prefix, layer, members, hessian):
        groups = by_grid(prefix, members, grids)
        if len(groups) == 1:  # the usual case: the accumulator is handed over, freed once factored
            (grid, names), = groups
            return [(names, _solve_shared(layer, names, hessian, grid, cfg))]
        H = hessian.take()  # one solve per grid, rows stacked within each
        return [(names, _solve_shared(layer, names, H if k == len(groups) - 1 else H.clone(), grid, cfg))
                for k, (grid, names) in enumerate(groups)]

    def install(prefix, layer, members, parts, stats) -> dict:
        return {name: module for names, result in parts
                for name, module in _install_shared(layer, names, result, stats).items()}

    quantized = list(targets.linears)
    layers, forward_dtype = walk_solving(ctx, cfg, targets, solve, install)
    round_outside(ctx, outside, grids, "GPTQ")  # lm_head etc. see no decoder-layer inputs
    return {"quantized": quantized, "ignored": targets.ignored,
            "forward_dtype": forward_dtype, "round_to_nearest": list(outside), **cfg.scheme.record(grids),
            "damping_retries": damping_retries(layers), "layers": layers}


def by_grid(prefix: str, members: list[str], grids: dict) -> list[tuple]:
    """A layer group's members (names relative to the layer at `prefix`) split by their grid, as
    (grid, names) solves; a grid whose scales would span stacked linears solves each alone."""
    out: dict = {}
    for name in members:
        grid = grids[f"{prefix}.{name}"]
        out.setdefault(grid if grid.stacks_rows() else (grid, name), (grid, []))[1].append(name)
    return list(out.values())


def _solve_shared(layer, members, hessian: HessianAccumulator, grid, cfg: GPTQConfig) -> tuple[GPTQResult, float]:
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

    result = solve_onto(grid, stacked, hessian, cfg)
    return result, (time.perf_counter() - start) / len(members)


def _install_shared(layer, members, solved: tuple[GPTQResult, float], stats: dict) -> dict[str, nn.Module]:
    """The stacked solve split back per linear into runtime modules, each one's rounded values
    written into its float weight (with true_sequential later groups see the quantized layer)."""
    result, seconds = solved
    out = {}
    row = 0
    for name in members:
        old = layer.get_submodule(name)
        w = linear_weight(old)
        rows = slice(row, row + w.shape[0])
        row += w.shape[0]
        part = result.weight.row_slice(rows)
        if not w.is_meta:  # meta: let go by the solve, and the part stays where it was solved
            w.copy_(part.dequantize())
            part = on_device(part, w.device)
        out[name] = module_for(part, old.bias)
        stats[name] = linear_stats(result.row_loss[rows], result.dampening_frac, result.retries, seconds)
    return out


SPEC = StepSpec("gptq", GPTQConfig, apply, "GPTQ: error-compensating weight quantization, layer by layer",
                writes=lambda cfg: LinearScheme(cfg.scheme), streamed=lambda cfg: WALK)
