"""Round-to-nearest weight quantization: no data, min/max scales per tensor, channel or group."""
from __future__ import annotations

from lowbit.calibrate.progress import Progress

from .primitives import IntScheme, check_group_size
from .qlinear import QuantLinear, linear_weight
from .step import StepContext
from .targets import replace_module, select_targets
from .weight import quantize_rtn

RTNConfig = IntScheme  # RTN needs nothing beyond the grid itself


def apply(ctx: StepContext, cfg: RTNConfig) -> dict:
    targets = select_targets(ctx.model, ctx.arch, ctx.ignore)
    for name, module in targets.linears.items():
        check_group_size(cfg, linear_weight(module).shape[1], name)
    progress = Progress("rtn", len(targets.linears), "linears")
    for name, module in targets.linears.items():
        qw = quantize_rtn(linear_weight(module), cfg)
        replace_module(ctx.model, name, QuantLinear.from_quantized(qw, module.bias))
        progress.step()
    return {"quantized": list(targets.linears), "ignored": targets.ignored}
