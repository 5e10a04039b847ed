"""What distill trains: each weight-only integer linear's group scales and each GGML linear's block
scales (as a learned factor on the scales the weight step left) and every norm's weight; nothing else
takes a gradient. Each is seen through the dtype the checkpoint stores it in (a straight-through
round: export.dtype, or a GGML block's float16), so the file holds what was trained."""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from lowbit.quantize.grids.gguf import GGUFWeight
from lowbit.quantize.grids.integer import QuantizedWeight
from lowbit.quantize.grids.integer_learned import straight_through
from lowbit.quantize.runtime.buffers import RuntimeModule, on_device
from lowbit.quantize.runtime.gguf_linear import GGUFLinear
from lowbit.quantize.runtime.qlinear import QuantLinear


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the checkpoint will hold it (rounded to `dtype`), x's gradient backward."""
    return straight_through(x.to(dtype).to(x.dtype), x)


class IntegerScales:
    """A weight-only QuantLinear's group scales as scale * exp(t), t learned from 0 (a scale stays
    positive and every group moves by the same relative step), seen as the checkpoint stores them."""

    def __init__(self, module: QuantLinear, dtype: torch.dtype):
        self.module, self.dtype = module, dtype
        self.factors = [nn.Parameter(torch.zeros_like(module.weight_scale))]

    def scale(self) -> torch.Tensor:
        return stored(self.module.weight_scale * self.factors[0].exp(), self.dtype)

    def weight(self) -> torch.Tensor:
        qw = self.module.quantized_weight()
        return QuantizedWeight(qw.codes, self.scale(), qw.zero, qw.scheme, qw.g_idx).dequantize()

    def learned(self):
        return self.scale().detach()

    def keep(self, learned) -> None:
        self.module.weight_scale = learned


class BlockScales:
    """A GGUFLinear's block scales d (and Q4_1's, Q5_1's and the K-quants' mins dmin) as d * exp(t),
    seen as the float16 the GGML block stores; the levels and the K-quants' 6-bit sub-block scales
    stay as they are. A scale keeps its sign (Q4_0's d is negative where the block's extreme is)."""

    def __init__(self, module: GGUFLinear):
        self.module = module
        self.gw = on_device(module.gguf_weight(), module.weight.device)
        self.fields = ["d"] + ([] if self.gw.dmin is None else ["dmin"])
        self.factors = [nn.Parameter(torch.zeros_like(getattr(self.gw, f), dtype=torch.float32)) for f in self.fields]

    def block_fields(self) -> GGUFWeight:
        learned = {f: stored(getattr(self.gw, f).float() * t.exp(), torch.float16)
                   for f, t in zip(self.fields, self.factors)}
        return dataclasses.replace(self.gw, **learned)

    def weight(self) -> torch.Tensor:
        return self.block_fields().dequantize()

    def learned(self):
        gw = self.block_fields()
        return dataclasses.replace(gw, **{f: getattr(gw, f).detach().half() for f in self.fields})

    def keep(self, learned) -> None:
        self.module.hold(learned)


def scales_of(module: nn.Module, dtype: torch.dtype):
    """The learned view of a linear's scales, or None where they stay (activations quantized too,
    or a grid with no scales to learn here: FP8, MXFP4)."""
    if isinstance(module, QuantLinear) and module.input_quant is None:
        return IntegerScales(module, dtype)
    if isinstance(module, GGUFLinear):
        return BlockScales(module)
    return None


class LearnedScales:
    """Every weight-only integer linear's group scales and every GGML linear's block scales, learned
    as a factor exp(t) on the scales the weight step left; the other runtime modules keep theirs and
    `fixed` names them."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.views: dict = {}
        self.fixed: list[str] = []
        for name, module in model.named_modules():
            view = scales_of(module, dtype)
            if view is not None:
                self.views[name] = view
            elif isinstance(module, RuntimeModule):
                self.fixed.append(name)
        if not self.views:
            raise ValueError("distill: no linear holds weight-only scales to learn (integer groups or GGML blocks); "
                             "list distill after the weight step (rtn, gptq, awq, signround) of such a grid")

    def __len__(self) -> int:
        return len(self.views)

    def parameters(self) -> list[nn.Parameter]:
        return [t for view in self.views.values() for t in view.factors]

    @contextmanager
    def learning(self):
        """Within it each linear computes with its learned scales; on leaving normally it holds them
        as its checkpoint stores them, and on an error its scales are left as they were."""
        for view in self.views.values():
            view.module.forward = lambda x, view=view: learned_linear(view, x)
        ok = False
        try:
            yield self
            ok = True
        finally:
            learned = {name: view.learned() for name, view in self.views.items()} if ok else {}
            for name, view in self.views.items():
                del view.module.forward  # back to the class's forward
                if ok:
                    view.keep(learned[name])


def learned_linear(view, x: torch.Tensor) -> torch.Tensor:
    bias = view.module.bias
    return F.linear(x, view.weight().to(x.dtype), None if bias is None else bias.to(x.dtype))


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
