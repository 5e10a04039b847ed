"""The steps a recipe may list: name -> (frozen config class, apply(ctx, cfg) -> results dict).

Each quantization algorithm registers here; the recipe loader validates a step's options
against its config class.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from lowbit.quantize import gptq, rtn


class StepSpec(NamedTuple):
    config: type
    apply: Callable
    summary: str


STEPS: dict[str, StepSpec] = {
    "gptq": StepSpec(gptq.GPTQConfig, gptq.apply, "GPTQ: error-compensating weight quantization, layer by layer"),
    "rtn": StepSpec(rtn.RTNConfig, rtn.apply, "round-to-nearest weight quantization"),
}
