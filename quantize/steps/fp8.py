"""The `fp8` step: FP8 weights, and FP8 activations scaled per token (dynamic) or by a calibrated
per-tensor scale (static), each target linear replaced by an FP8Linear. Linears a weight step has
already rounded onto an fp8 scheme (`rtn`, `gptq`) keep their weights: only their inputs change."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from lowbit.calibrate.arch import linear_weight
from lowbit.calibrate.messages import short_repr
from lowbit.calibrate.progress import Progress
from lowbit.quantize.grids.fp8 import ActivationMode, FP8Scheme, quantize_weight_fp8, scale_from_absmax
from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.runtime.buffers import on_device
from lowbit.quantize.runtime.fp8_linear import FP8Linear
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.gptq import GPTQConfig
from lowbit.quantize.steps.gptq_solver import gptq_solve_fp8
from lowbit.quantize.steps.layerwise import damping_retries, linear_stats, walk_solving
from lowbit.quantize.steps.spec import LAYERS, WALK, StepSpec
from lowbit.quantize.targets import replace_module, select_targets


@dataclass(frozen=True)
class FP8Config:
    scheme: FP8Scheme = FP8Scheme()  # the weight grid: format and what one scale covers
    # activations in the weight's format: dynamic per-token | static per-tensor (calibrated) | none
    activations: ActivationMode = "dynamic"
    # nearest: each weight rounded on its own (no data needed); gptq: rounded column by column
    # against calibration inputs, each rounding error pushed onto the columns still to come
    rounding: Literal["nearest", "gptq"] = "nearest"
    dampening_frac: float = 0.1  # with rounding gptq, as in the gptq step

    def __post_init__(self):
        if self.rounding not in ("nearest", "gptq"):
            raise ValueError(f"rounding must be nearest or gptq, got {short_repr(self.rounding)}")
        if self.rounding == "gptq":
            self.gptq_config  # validates dampening_frac

    @property
    def gptq_config(self) -> GPTQConfig:
        # the walk and solve options of the gptq step; its integer grid fields go unused
        return GPTQConfig(dampening_frac=self.dampening_frac, actorder="static", true_sequential=False)


def apply(ctx: StepContext, cfg: FP8Config) -> dict:
    targets = select_targets(ctx.model, ctx.arch, ctx.ignore)
    rounded = _weight_only(ctx, targets)
    input_scales = {}
    if cfg.activations == "static":
        # observed on the model as it stands (the float model unless a weight step ran before):
        # all linears' inputs in one pass over the calibration data
        absmax = ctx.linear_input_absmax(list(targets.linears) + list(rounded))
        input_scales = {name: scale_from_absmax(a.amax(), cfg.scheme.format) for name, a in absmax.items()}
    for name, module in rounded.items():
        module.quantize_inputs(cfg.activations, input_scales.get(name))
    result = {"quantized": list(targets.linears), "ignored": targets.ignored,
              "input_scales": {n: float(s) for n, s in input_scales.items()}}
    if rounded:
        result["inputs_quantized"] = list(rounded)
    rounded_nearest = targets.linears
    if cfg.rounding == "gptq":
        result.update(_apply_gptq(ctx, cfg, targets, input_scales))
        rounded_nearest = {n: m for n, m in targets.linears.items() if n in result["round_to_nearest"]}
    progress = Progress("fp8", len(rounded_nearest), "linears")
    for name, module in rounded_nearest.items():
        ctx.resident(name, module)
        fw = quantize_weight_fp8(linear_weight(module), cfg.scheme.strategy, cfg.scheme.format, cfg.scheme.block_size)
        new = FP8Linear.from_weight(fw, module.bias, cfg.activations, input_scales.get(name))
        replace_module(ctx.model, name, new)
        progress.step()
    return result


def _weight_only(ctx: StepContext, targets) -> dict:
    """The FP8 linears an earlier weight step (rtn, gptq onto an fp8 scheme) left with 16-bit
    inputs: this step quantizes only their inputs; they leave `targets.ignored`."""
    rounded = {n: m for n, m in ((n, _module_at(ctx.model, n)) for n in targets.ignored)
               if isinstance(m, FP8Linear) and m.activations == "none"}
    for name in rounded:
        del targets.ignored[name]
    return rounded


def _module_at(model, name: str):
    """The module at `name`, or None where the name is no module (an expert slice of a fused tensor)."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _apply_gptq(ctx: StepContext, cfg: FP8Config, targets, input_scales: dict) -> dict:
    """FP8 weights by GPTQ inside the decoder layers; later layers calibrate on the FP8 layers'
    outputs (FP8 activations included). Linears outside them (none unless lm_head is targeted)
    are left for round-to-nearest."""
    gcfg = cfg.gptq_config

    def solve(prefix, layer, members, hessian) -> list:
        solved, H = [], hessian.take()
        for name in members:  # one solve each: per-tensor and block scales belong to one linear
            start = time.perf_counter()
            W = linear_weight(layer.get_submodule(name)).float()
            fw, row_loss, frac, retries = gptq_solve_fp8(W, H, gcfg, cfg.scheme.strategy, cfg.scheme.format,
                                                         cfg.scheme.block_size)
            solved.append((fw, row_loss, frac, retries, time.perf_counter() - start))
        return solved

    def install(prefix, layer, members, result, stats) -> dict:
        modules = {}
        for name, (fw, row_loss, frac, retries, seconds) in zip(members, result):
            module = layer.get_submodule(name)
            modules[name] = FP8Linear.from_weight(on_device(fw, module.weight.device), module.bias, cfg.activations,
                                                  input_scales.get(f"{prefix}.{name}"))
            stats[name] = linear_stats(row_loss, frac, retries, seconds)
        return modules

    layers, forward_dtype = walk_solving(ctx, gcfg, targets, solve, install)
    inside = {n for layer in layers for n in layer["linears"]}
    return {"rounding": "gptq", "forward_dtype": forward_dtype, "layers": layers,
            "round_to_nearest": [n for n in targets.linears if n not in inside],
            "damping_retries": damping_retries(layers)}


def _streamed(cfg: FP8Config) -> str:
    return WALK if cfg.rounding == "gptq" else LAYERS


SPEC = StepSpec("fp8", FP8Config, apply, "FP8 weights and activations (dynamic or static)",
                writes=lambda cfg: LinearScheme(cfg.scheme, cfg.activations), adds_inputs=lambda cfg: cfg.activations,
                streamed=_streamed,
                observes=lambda cfg: "linear_inputs" if cfg.activations == "static" else None)
