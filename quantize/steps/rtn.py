"""Round-to-nearest weight quantization: no data, min/max scales per tensor, channel or group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lowbit.calibrate.arch import linear_weight
from lowbit.calibrate.progress import Progress
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.grids.linear import LinearScheme, Plan
from lowbit.quantize.runtime.modules import module_for
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.spec import StepSpec
from lowbit.quantize.targets import planned_targets, replace_module


@dataclass(frozen=True)
class RTNConfig:
    # RTN needs nothing beyond the grid itself (integer, or FP8: 16-bit inputs until an fp8 step);
    # a llama.cpp file type (GGUFTypes) rounds as llama.cpp's reference quantizer does; a format
    # per linear (LinearFormats) rounds each to its own
    scheme: Plan = IntScheme()


def apply(ctx: StepContext, cfg: RTNConfig) -> dict:
    return round_each(ctx, cfg.scheme, "rtn")


def round_each(ctx: StepContext, plan, label: str,
               rounding: Optional[Callable[[torch.Tensor, str], object]] = None) -> dict:
    """Replace every targeted linear by the runtime module of its weight rounded onto its grid (by the
    grid's own round-to-nearest, or `rounding`): the loop of every data-free weight step. Each grid
    is checked against its linear before any is changed."""
    targets, grids = planned_targets(ctx.model, ctx.arch, ctx.ignore, plan)
    progress = Progress(label, len(targets.linears), "linears")
    names = list(targets.linears)
    for name in names:  # popped: each float weight is freed once its replacement is in place
        module = targets.linears.pop(name)
        ctx.resident(name, module)
        weight = (rounding or grids[name].round)(linear_weight(module), name)
        replace_module(ctx.model, name, module_for(weight, module.bias))
        del module
        progress.step()
    return {"quantized": names, "ignored": targets.ignored, **plan.record(grids)}


SPEC = StepSpec("rtn", RTNConfig, apply, "round-to-nearest weight quantization",
                writes=lambda cfg: LinearScheme(cfg.scheme))
