"""The steps a recipe may list: name -> (frozen config class, apply(ctx, cfg) -> results dict).

Each quantization algorithm registers here; the recipe loader validates a step's options
against its config class.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from lowbit.quantize import input_quant, rtn


class StepSpec(NamedTuple):
    config: type
    apply: Callable
    summary: str


STEPS: dict[str, StepSpec] = {
    "rtn": StepSpec(rtn.RTNConfig, rtn.apply, "round-to-nearest weight quantization"),
    "quantize_inputs": StepSpec(input_quant.InputQuantConfig, input_quant.apply,
                                "INT8 input quantization of the quantized linears (W8A8 after an int8 weight step)"),
}
