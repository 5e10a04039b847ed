"""The `fp8` step: FP8 weights, and FP8 activations scaled per token (dynamic) or by a calibrated
per-tensor scale (static), each target linear replaced by an FP8Linear."""
from __future__ import annotations

from dataclasses import dataclass

from lowbit.calibrate.observers import linear_input_absmax
from lowbit.calibrate.progress import Progress

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

    def __post_init__(self):
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")


def apply(ctx: StepContext, cfg: FP8Config) -> dict:
    targets = select_targets(ctx.model, ctx.arch, ctx.ignore)
    input_scales = {}
    if cfg.activations == "static":
        # observed on the float model: all linears' inputs in one pass over the calibration data
        absmax = linear_input_absmax(ctx.model, list(targets.linears), ctx.batches)
        input_scales = {name: scale_from_absmax(a.amax(), cfg.format) for name, a in absmax.items()}
    progress = Progress("fp8", len(targets.linears), "linears")
    for name, module in targets.linears.items():
        fw = quantize_weight_fp8(linear_weight(module), cfg.weights, cfg.format, cfg.block_size)
        new = FP8Linear.from_weight(fw, module.bias, cfg.activations, input_scales.get(name))
        replace_module(ctx.model, name, new)
        progress.step()
    return {"quantized": list(targets.linears), "ignored": targets.ignored,
            "input_scales": {n: float(s) for n, s in input_scales.items()}}
