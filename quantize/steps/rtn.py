"""Round-to-nearest weight quantization: no data, min/max scales per tensor, channel or group."""
from __future__ import annotations

from dataclasses import dataclass

from lowbit.calibrate.arch import linear_weight
from lowbit.calibrate.progress import Progress

from lowbit.quantize.grids.integer import IntScheme, check_group_size
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.spec import StepSpec
from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.targets import replace_module, select_targets
from lowbit.quantize.grids.quantized_weight import quantize_rtn

@dataclass(frozen=True)
class RTNConfig:
    scheme: IntScheme = IntScheme()  # RTN needs nothing beyond the grid itself


def apply(ctx: StepContext, cfg: RTNConfig) -> dict:
    targets = select_targets(ctx.model, ctx.arch, ctx.ignore)
    for name, module in targets.linears.items():
        check_group_size(cfg.scheme, linear_weight(module).shape[1], name)
    progress = Progress("rtn", len(targets.linears), "linears")
    for name, module in targets.linears.items():
        qw = quantize_rtn(linear_weight(module), cfg.scheme)
        replace_module(ctx.model, name, QuantLinear.from_quantized(qw, module.bias))
        progress.step()
    return {"quantized": list(targets.linears), "ignored": targets.ignored}


SPEC = StepSpec("rtn", RTNConfig, apply, "round-to-nearest weight quantization",
                writes=lambda cfg: LinearScheme(cfg.scheme))
