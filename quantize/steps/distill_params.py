"""What distill trains: each weight-only integer linear's scales (as a learned factor on the scales the
weight step left) and every norm's weight; nothing else takes a gradient. Both are seen through the
dtype the checkpoint stores them in (a straight-through round), so the file holds what was trained."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from lowbit.quantize.grids.integer import QuantizedWeight
from lowbit.quantize.grids.integer_learned import straight_through
from lowbit.quantize.runtime.buffers import RuntimeModule
from lowbit.quantize.runtime.qlinear import QuantLinear


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the checkpoint will hold it (rounded to `dtype`), x's gradient backward."""
    return straight_through(x.to(dtype).to(x.dtype), x)


class LearnedScales:
    """Each weight-only QuantLinear's scales as scale * exp(t), t learned from 0 (so a scale stays
    positive and every group moves by the same relative step). Linears whose inputs are quantized too,
    or on other grids, keep their scales: `fixed` names them."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.linears: dict[str, QuantLinear] = {}
        self.fixed: list[str] = []
        for name, module in model.named_modules():
            if isinstance(module, QuantLinear) and module.input_quant is None:
                self.linears[name] = module
            elif isinstance(module, RuntimeModule):
                self.fixed.append(name)
        if not self.linears:
            raise ValueError("distill: no linear holds integer weight-only scales to learn; list distill after "
                             "the weight step (rtn, gptq, awq, signround) of an integer grid")
        self.log_factors = {name: nn.Parameter(torch.zeros_like(m.weight_scale)) for name, m in self.linears.items()}

    def __len__(self) -> int:
        return len(self.linears)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.log_factors.values())

    def scale(self, name: str) -> torch.Tensor:
        module = self.linears[name]
        return stored(module.weight_scale * self.log_factors[name].exp(), self.dtype)

    @contextmanager
    def learning(self):
        """Within it each linear computes with its learned scales; on leaving normally they are its
        own (float32, on the stored dtype's grid), and on an error its scales are left as they were."""
        for name, module in self.linears.items():
            module.forward = lambda x, name=name: self.linear(name, x)
        ok = False
        try:
            yield self
            ok = True
        finally:
            learned = {name: self.scale(name).detach() for name in self.linears} if ok else {}
            for name, module in self.linears.items():
                del module.forward  # back to the class's forward
                if ok:
                    module.weight_scale = learned[name]

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        module = self.linears[name]
        qw = module.quantized_weight()
        w = QuantizedWeight(qw.codes, self.scale(name), qw.zero, qw.scheme, qw.g_idx).dequantize()
        return F.linear(x, w.to(x.dtype), None if module.bias is None else module.bias.to(x.dtype))


class Stored(nn.Module):
    """A parametrization: the weight as the checkpoint will hold it."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stored(x, self.dtype)


class LearnedNorms:
    """The weight of every normalization module (RMSNorm, LayerNorm, q/k norms), seen through the
    stored dtype; on leaving normally each holds the rounded value it was trained as, on an error
    the value it had."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.modules = [m for m in model.modules() if type(m).__name__.endswith("Norm")
                        and isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.is_floating_point()]

    def __len__(self) -> int:
        return len(self.modules)

    def parameters(self) -> list[nn.Parameter]:
        return [m.parametrizations.weight.original for m in self.modules]

    @contextmanager
    def learning(self):
        before = [m.weight.detach().clone() for m in self.modules]
        for module in self.modules:
            parametrize.register_parametrization(module, "weight", Stored(self.dtype))
        ok = False
        try:
            yield self
            ok = True
        finally:
            for module, value in zip(self.modules, before):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=ok)
                if not ok:
                    module.weight.data.copy_(value)
