"""What one quantized linear holds: its weight grid and how its inputs are quantized.

The steps say which LinearScheme they leave on each linear they target; the runtime modules say
which one they hold; the audit compares the two.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from lowbit.calibrate.messages import short_repr
from lowbit.quantize.grids.formats import LinearFormats
from lowbit.quantize.grids.fp8 import ActivationMode, FP8Scheme
from lowbit.quantize.grids.gguf import GGUFScheme
from lowbit.quantize.grids.gguf_plan import GGUFTypes
from lowbit.quantize.grids.inputs import InputQuant
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.grids.mxfp4 import MXScheme

# What a weight step's `scheme:` may name: a grid, or a plan of grids (a llama.cpp file type, a format
# per linear). A recipe's keys pick the first class whose fields hold them all: order matters.
PLANS = (IntScheme, FP8Scheme, MXScheme, GGUFTypes, LinearFormats)
Plan = Union[PLANS]
WeightGrid = Union[IntScheme, FP8Scheme, MXScheme, GGUFScheme]  # what one linear holds


@dataclass(frozen=True)
class LinearScheme:
    weights: WeightGrid
    # IntScheme weights: an InputQuant, or None (16-bit inputs); FP8Scheme weights: the FP8
    # activation mode (dynamic, static; none is None); GGUFScheme weights: None (llama.cpp decides)
    inputs: Union[InputQuant, ActivationMode, None] = None

    def __post_init__(self):
        if self.inputs == "none":  # FP8's word for 16-bit inputs: one spelling, so schemes compare equal
            object.__setattr__(self, "inputs", None)
        if not self.weights.takes_inputs(self.inputs):
            raise ValueError(f"{type(self.weights).__name__} weights cannot take inputs {short_repr(self.inputs)}")

    def describe(self) -> str:
        return self.weights.describe(self.inputs)
