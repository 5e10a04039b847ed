"""The `fp8` step: FP8 weights, and FP8 activations scaled per token (dynamic) or by a calibrated
per-tensor scale (static), each target linear replaced by an FP8Linear."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from lowbit.calibrate.observers import linear_input_absmax
from lowbit.calibrate.progress import Progress

from . import gptq
from .fp8 import FP8Format, WeightStrategy, quantize_weight_fp8, scale_from_absmax
from .fp8_linear import ActivationMode, FP8Linear
from .qlinear import linear_weight
from .step import StepContext
from .targets import replace_module, select_targets


@dataclass(frozen=True)
class FP8Config:
    format: FP8Format = "e4m3"  # e4m3 for weights and activations; e5m2 trades precision for range
    weights: WeightStrategy = "channel"  # tensor | channel | block
    block_size: int = 128  # with weights: block (DeepSeek-V3 style 128x128 tiles)
    activations: ActivationMode = "dynamic"  # dynamic per-token | static per-tensor (calibrated) | none
    # nearest: each weight rounded on its own (no data needed); gptq: rounded column by column
    # against calibration inputs, each rounding error pushed onto the columns still to come
    rounding: Literal["nearest", "gptq"] = "nearest"
    dampening_frac: float = 0.1  # with rounding gptq, as in the gptq step

    def __post_init__(self):
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.rounding not in ("nearest", "gptq"):
            raise ValueError(f"rounding must be nearest or gptq, got {self.rounding!r}")
        if self.rounding == "gptq":
            self.gptq_config  # validates dampening_frac

    @property
    def gptq_config(self) -> gptq.GPTQConfig:
        # the walk and solve options of the gptq step; its integer grid fields go unused
        return gptq.GPTQConfig(dampening_frac=self.dampening_frac, actorder="static", true_sequential=False)


def apply(ctx: StepContext, cfg: FP8Config) -> dict:
    targets = select_targets(ctx.model, ctx.arch, ctx.ignore)
    input_scales = {}
    if cfg.activations == "static":
        # observed on the float model: all linears' inputs in one pass over the calibration data
        absmax = linear_input_absmax(ctx.model, list(targets.linears), ctx.batches)
        input_scales = {name: scale_from_absmax(a.amax(), cfg.format) for name, a in absmax.items()}
    result = {"quantized": list(targets.linears), "ignored": targets.ignored,
              "input_scales": {n: float(s) for n, s in input_scales.items()}}
    rounded_nearest = targets.linears
    if cfg.rounding == "gptq":
        result.update(_apply_gptq(ctx, cfg, targets, input_scales))
        rounded_nearest = {n: m for n, m in targets.linears.items() if n in result["round_to_nearest"]}
    progress = Progress("fp8", len(rounded_nearest), "linears")
    for name, module in rounded_nearest.items():
        fw = quantize_weight_fp8(linear_weight(module), cfg.weights, cfg.format, cfg.block_size)
        new = FP8Linear.from_weight(fw, module.bias, cfg.activations, input_scales.get(name))
        replace_module(ctx.model, name, new)
        progress.step()
    return result


def _apply_gptq(ctx: StepContext, cfg: FP8Config, targets, input_scales: dict) -> dict:
    """FP8 weights by GPTQ inside the decoder layers; later layers calibrate on the FP8 layers'
    outputs (FP8 activations included). Linears outside them (none unless lm_head is targeted)
    are left for round-to-nearest."""
    gcfg = cfg.gptq_config

    def solve(prefix, layer, members, H, stats) -> dict:
        solved = {}
        for name in members:  # one solve each: per-tensor and block scales belong to one linear
            module = layer.get_submodule(name)
            start = time.perf_counter()
            fw, row_loss, frac, retries = gptq.gptq_solve_fp8(linear_weight(module).float(), H, gcfg,
                                                              cfg.weights, cfg.format, cfg.block_size)
            new = FP8Linear.from_weight(fw, module.bias, cfg.activations, input_scales.get(f"{prefix}.{name}"))
            solved[name] = new.to(module.weight.device)
            stats[name] = gptq.linear_stats(row_loss, frac, retries, time.perf_counter() - start)
        return solved

    layers, forward_dtype = gptq.walk_solving(ctx, gcfg, targets, solve)
    inside = {n for layer in layers for n in layer["linears"]}
    return {"rounding": "gptq", "forward_dtype": forward_dtype, "layers": layers,
            "round_to_nearest": [n for n in targets.linears if n not in inside],
            "damping_retries": gptq.damping_retries(layers)}
