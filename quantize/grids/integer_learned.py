"""The integer grid's learned-rounding view (SignRound, Cheng et al. 2023): per weight an offset
v in [-0.5, 0.5] added before rounding, and per group a factor in [0, 1] on each end of its range
(its clipping), trained through a straight-through round so that a block's quantized output
matches its float output. At v = 0 and factors 1 it is round-to-nearest on min/max scales.
Started from GPTQ (from_gptq), v moves around the weights GPTQ rounded and one factor per group
scales GPTQ's scale (its zero point stays): at v = 0 and factor 1 it is GPTQ's result."""
from __future__ import annotations

import torch
from torch import nn

from lowbit.quantize.grids.integer import IntScheme, QuantizedWeight, grouped, scale_zero_from_range


def straight_through(value: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`value` forward (exactly: x + (value - x) need not be), x's gradient backward (the
    straight-through estimator)."""
    return value.detach() + (x - x.detach())


def round_through(x: torch.Tensor) -> torch.Tensor:
    return straight_through(torch.round(x), x)


class FusedFakeWeight(torch.autograd.Function):
    """fake_weight's round, clamp and rescale, and their gradients, as one pass each of a compiled
    kernel (quantize/runtime/csrc/fake_quant.cpp): the same weight, the same gradient for the offsets,
    the scales' gradient summed in another order."""

    @staticmethod
    def forward(ctx, groups, offset, scale, zero, scheme: IntScheme, kernel):
        ctx.save_for_backward(groups, offset, scale, zero)
        ctx.scheme, ctx.kernel = scheme, kernel
        return kernel.fake_quant_int(groups, offset, scale, zero, scheme.qmin, scheme.qmax)

    @staticmethod
    def backward(ctx, grad):
        groups, offset, scale, zero = ctx.saved_tensors
        d_offset, d_scale = ctx.kernel.fake_quant_int_backward(grad.float().contiguous(), groups, offset, scale, zero,
                                                               ctx.scheme.qmin, ctx.scheme.qmax)
        return None, d_offset, d_scale, None, None, None


class IntLearnedRounding(nn.Module):
    def __init__(self, w: torch.Tensor, scheme: IntScheme):
        super().__init__()
        self.scheme, self.shape = scheme, w.shape
        self.kernel = None  # fuse(): the compiled module that computes fake_weight on a CPU
        g = grouped(w.detach().float(), scheme)
        self.register_buffer("groups", g)  # (rows, G, group): the float weight, never trained
        self.register_buffer("lo", g.amin(dim=-1))
        self.register_buffer("hi", g.amax(dim=-1))
        self.offset = nn.Parameter(torch.zeros_like(g))
        self.max_factor = nn.Parameter(torch.ones_like(self.hi))
        # a symmetric grid's range is one absmax: one factor scales both ends
        self.min_factor = None if scheme.symmetric else nn.Parameter(torch.ones_like(self.lo))
        self.register_buffer("start_scale", None)  # from_gptq: the scale the factor multiplies
        self.register_buffer("start_zero", None)  # and the zero point it keeps

    @classmethod
    def from_gptq(cls, pre_round: torch.Tensor, scale: torch.Tensor, zero, scheme: IntScheme) -> "IntLearnedRounding":
        """The view around GPTQ's solve: `pre_round` (out, in), the weights its sweep rounded (each with
        the errors pushed onto it), on GPTQ's scales and zero points (rows, G)."""
        view = cls(pre_round, scheme)
        view.min_factor = None
        view.start_scale = scale.detach().float().clone()
        view.start_zero = None if zero is None else zero.detach().float().clone()
        return view

    def _scale_zero(self):
        if self.start_scale is not None:
            return self.start_scale * self.max_factor, self.start_zero
        low = self.min_factor if self.min_factor is not None else self.max_factor
        return scale_zero_from_range(self.lo * low, self.hi * self.max_factor, self.scheme)

    def _codes(self, scale, zero) -> torch.Tensor:
        code = round_through(self.groups / scale.unsqueeze(-1) + self.offset)
        if zero is not None:
            code = code + zero.unsqueeze(-1)
        return code.clamp(self.scheme.qmin, self.scheme.qmax)

    def fuse(self, kernel) -> None:
        """Compute fake_weight with `kernel`'s fake_quant_int (one of quantize/runtime/cpu_kernels'
        modules) while the weight is float32 on the CPU; None: the torch operations."""
        self.kernel = kernel

    def fake_weight(self) -> torch.Tensor:
        """The weight as the grid holds it now, (out, in) float32, differentiable in the parameters."""
        scale, zero = self._scale_zero()
        if self.kernel is not None and self.groups.is_cpu:
            return FusedFakeWeight.apply(self.groups, self.offset, scale.contiguous(), zero, self.scheme,
                                         self.kernel).reshape(self.shape)
        code = self._codes(scale, zero)
        if zero is not None:
            code = code - zero.unsqueeze(-1)
        return (code * scale.unsqueeze(-1)).reshape(self.shape)

    @torch.no_grad()
    def keep_in_range(self) -> None:
        self.offset.clamp_(-0.5, 0.5)
        for factor in (self.max_factor, self.min_factor):
            if factor is not None:
                factor.clamp_(0.0, 1.0)

    @torch.no_grad()
    def weight(self) -> QuantizedWeight:
        """The learned codes, scales and zero points, as round-to-nearest would hand them over."""
        scale, zero = self._scale_zero()
        codes = self._codes(scale, zero).to(torch.int8).reshape(self.shape)
        return QuantizedWeight(codes, scale.float(), zero, self.scheme)
