"""Round-to-nearest weight quantization: no data, min/max scales per tensor, channel or group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

from lowbit.calibrate.arch import linear_weight
from lowbit.calibrate.progress import Progress
from lowbit.quantize.grids.gguf_plan import GGUFTypes
from lowbit.quantize.grids.int_plan import IntTypes
from lowbit.quantize.grids.integer import IntScheme, check_group_size
from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.grids.quantized_weight import QuantizedWeight, quantize_rtn
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.quantize.steps import gguf_rounding, int_planning
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.spec import StepSpec
from lowbit.quantize.targets import replace_module, select_targets


@dataclass(frozen=True)
class RTNConfig:
    # RTN needs nothing beyond the grid itself; a llama.cpp file type (GGUFTypes) rounds as
    # llama.cpp's reference quantizer does; a format per linear (IntTypes) rounds each to its own
    scheme: Union[IntScheme, GGUFTypes, IntTypes] = IntScheme()


def apply(ctx: StepContext, cfg: RTNConfig) -> dict:
    if isinstance(cfg.scheme, GGUFTypes):
        return gguf_rounding.round_each(ctx, cfg.scheme)
    if isinstance(cfg.scheme, IntTypes):
        return _round_planned(ctx, cfg.scheme)
    return quantize_each(ctx, cfg.scheme, lambda w: quantize_rtn(w, cfg.scheme), "rtn")


def _round_planned(ctx: StepContext, types: IntTypes) -> dict:
    targets, schemes = int_planning.planned_targets(ctx, types)
    progress = Progress("rtn", len(targets.linears), "linears")
    names = list(targets.linears)
    for name in names:
        module = targets.linears.pop(name)
        qw = quantize_rtn(linear_weight(module), schemes[name])
        replace_module(ctx.model, name, QuantLinear.from_quantized(qw, module.bias))
        del module
        progress.step()
    return {"quantized": names, "ignored": targets.ignored}


def quantize_each(ctx: StepContext, scheme: IntScheme, quantize: Callable[[torch.Tensor], QuantizedWeight],
                  label: str) -> dict:
    """Replace every targeted linear by QuantLinear(quantize(its (out, in) weight)): the loop of
    every data-free weight step. Group sizes are checked for all linears before any is changed."""
    targets = select_targets(ctx.model, ctx.arch, ctx.ignore)
    for name, module in targets.linears.items():
        check_group_size(scheme, linear_weight(module).shape[1], name)
    progress = Progress(label, len(targets.linears), "linears")
    names = list(targets.linears)
    for name in names:  # popped: each float weight is freed once its replacement is in place
        module = targets.linears.pop(name)
        replace_module(ctx.model, name, QuantLinear.from_quantized(quantize(linear_weight(module)), module.bias))
        del module
        progress.step()
    return {"quantized": names, "ignored": targets.ignored}


SPEC = StepSpec("rtn", RTNConfig, apply, "round-to-nearest weight quantization",
                writes=lambda cfg: LinearScheme(cfg.scheme))
