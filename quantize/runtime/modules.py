"""The runtime's quantized linear modules, named once for everything that asks "is this one?"."""
from __future__ import annotations

from torch import nn

from lowbit.quantize.runtime.fp8_linear import FP8Linear
from lowbit.quantize.runtime.gguf_linear import GGUFLinear
from lowbit.quantize.runtime.mxfp4_linear import MXFP4Linear
from lowbit.quantize.runtime.qlinear import QuantLinear

QUANTIZED_LINEARS = (QuantLinear, FP8Linear, MXFP4Linear, GGUFLinear)
# a rounded weight's FAMILY -> the module that holds it in place of its linear
BUILDERS = {"int": QuantLinear.from_quantized, "fp8": FP8Linear.weight_only, "mxfp4": MXFP4Linear.from_weight,
            "gguf": GGUFLinear.from_weight}


def is_quantized_linear(module: nn.Module) -> bool:
    """A lowbit runtime module (integer, FP8 or GGUF-block weights) where the float model had a linear."""
    return isinstance(module, QUANTIZED_LINEARS)


def module_for(weight, bias) -> nn.Module:
    """The runtime module holding a rounded weight (and the linear's bias)."""
    return BUILDERS[weight.FAMILY](weight, bias)
