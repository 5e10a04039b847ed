"""The `quantize_inputs` step: INT8 input quantization of every already-quantized linear.

Runs after a weight step (rtn, gptq): W8A8 is `rtn: {bits: 8}` then `quantize_inputs`.
Dynamic per-token scales need no data; a static per-tensor scale is calibrated here from the
absmax of each linear's input over the calibration batches (stored in QuantLinear.input_scale).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from lowbit.quantize.grids.inputs import InputQuant, static_scale_from_absmax
from lowbit.quantize.runtime.int8_inputs import product_path
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.spec import StepSpec
from lowbit.quantize.targets import is_ignored


@dataclass(frozen=True)
class InputQuantConfig:
    bits: int = 8  # INT8 only
    dynamic: bool = True  # per-token scales at run time; false: one calibrated scale per tensor

    def __post_init__(self):
        InputQuant(self.bits, self.dynamic)  # raises on unsupported bit widths


def enable_input_quant(module: QuantLinear, iq: InputQuant, absmax=None) -> None:
    """Switch a QuantLinear to quantized inputs; static quantization needs the input absmax."""
    module.input_quant = iq
    if iq.dynamic:
        module.input_scale = None
    else:
        if absmax is None:
            raise ValueError("static input quantization needs the calibrated input absmax")
        # the observers keep their statistics on the CPU; the scale joins the module's codes
        module.input_scale = static_scale_from_absmax(absmax.amax(), iq.qmax).to(module.weight_codes.device)


def apply(ctx: StepContext, cfg: InputQuantConfig) -> dict:
    iq = InputQuant(cfg.bits, cfg.dynamic)
    modules = {n: m for n, m in ctx.model.named_modules()
               if isinstance(m, QuantLinear) and not is_ignored(n, ctx.ignore)}
    if not modules:
        raise ValueError("quantize_inputs: no quantized linears; put a weight step (rtn, gptq) before it")
    absmax = {} if cfg.dynamic else ctx.linear_input_absmax(list(modules))
    for name, module in modules.items():
        enable_input_quant(module, iq, absmax.get(name))
    path = product_path(ctx.device)
    print(f"[quantize_inputs] W8A8 products: {path}", file=sys.stderr)
    return {"inputs_quantized": list(modules), "input_scheme": "per-token dynamic" if cfg.dynamic
            else "per-tensor static", "matmul": path}


SPEC = StepSpec("quantize_inputs", InputQuantConfig, apply,
                "INT8 input quantization of the quantized linears (W8A8 after an int8 weight step)",
                adds_inputs=lambda cfg: InputQuant(cfg.bits, cfg.dynamic),
                observes=lambda cfg: None if cfg.dynamic else "linear_inputs")
