"""A memory-lean CPU runtime: a model holding what a checkpoint stores, not what is fastest to run.

`compact(model)` after loading a quantized checkpoint:
- weight-only integer linears (symmetric, no act-order index) keep their codes packed densely in
  int32 words, as compressed-tensors stores them (4 bits a weight, not the int8 byte a QuantLinear
  keeps), and their scales in the 16-bit dtype they were stored in; each forward unpacks and
  dequantizes its weight (a weight's float copy lives only during its matmul);
- linears a plan keeps 16-bit hold their weight in the stored 16-bit dtype, widened per forward;
- the token embedding (and the output head tied to it) stays in its stored 16-bit dtype; lookups
  are cast to float32, and the head multiplies in 16 bits (the last position only, in generation).
So the model holds the bytes the fit's memory model counts (evaluate/memory.py). Slower than the
QuantLinear path; it exists to run where memory, not time, is what runs out.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.quantize.grids.integer import dequantize_codes, pack_codes, unpack_codes
from lowbit.quantize.runtime.qlinear import QuantLinear


class PackedLinear(nn.Module):
    """Integer codes packed as stored, 16-bit scales; dequantized per forward."""

    def __init__(self, module: QuantLinear):
        super().__init__()
        self.in_features, self.out_features, self.scheme = module.in_features, module.out_features, module.scheme
        unsigned = (module.weight_codes.to(torch.int32) - module.scheme.qmin)
        self.register_buffer("weight_packed", pack_codes(unsigned, module.scheme.bits))
        self.register_buffer("weight_scale", _narrowest_exact(module.weight_scale))
        self.register_buffer("bias", None if module.bias is None else _narrowest_exact(module.bias))

    def dequantized_weight(self) -> torch.Tensor:
        codes = unpack_codes(self.weight_packed, self.scheme.bits, self.in_features).to(torch.int16) + self.scheme.qmin
        return dequantize_codes(codes, self.weight_scale, None, self.scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), b)


class HalfLinear(nn.Module):
    """A float linear whose weight stays in its stored 16-bit dtype, widened for each matmul."""

    def __init__(self, module: nn.Linear, weight: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = module.in_features, module.out_features
        self.register_buffer("weight", weight)
        self.register_buffer("bias", None if module.bias is None else module.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), b)


class HalfHead(nn.Module):
    """An output head whose weight stays 16-bit (shared with the embedding when tied)."""

    def __init__(self, weight: nn.Parameter, bias):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(self.weight.dtype)
        return F.linear(x.to(self.weight.dtype), self.weight, b).to(x.dtype)


def _narrowest_exact(t: torch.Tensor) -> torch.Tensor:
    """t in bfloat16 or float16 where that holds every value exactly (it was stored so), else as is."""
    for dtype in (torch.bfloat16, torch.float16):
        narrow = t.to(dtype)
        if torch.equal(narrow.to(t.dtype), t):
            return narrow
    return t


def _packable(module: nn.Module) -> bool:
    return (isinstance(module, QuantLinear) and module.input_quant is None and module.scheme.symmetric
            and module.scheme.strategy != "tensor" and module.weight_g_idx is None)


def _to_float32(module, args, output):
    return output.float()


def compact(model: nn.Module) -> dict:
    """Make a loaded model memory-lean in place (see the module docstring); returns what changed."""
    packed = [name for name, m in model.named_modules() if _packable(m)]
    for name in packed:
        _replace(model, name, PackedLinear(model.get_submodule(name)))
    head = model.get_output_embeddings()
    narrowed = 0
    for name, m in list(model.named_modules()):
        if type(m) is nn.Linear and m is not head:
            weight = _narrowest_exact(m.weight.detach())
            if weight.dtype != m.weight.dtype:
                _replace(model, name, HalfLinear(m, weight))
                narrowed += 1
    embedding = model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    table = _narrowest_exact(embedding.weight.data)
    if table.dtype != embedding.weight.dtype:
        embedding.weight = nn.Parameter(table, requires_grad=False)
        embedding.register_forward_hook(_to_float32)
        if tied:
            model.set_output_embeddings(HalfHead(embedding.weight, head.bias))
    if type(head) is nn.Linear and not tied:  # its own 16-bit copy
        weight = _narrowest_exact(head.weight.detach())
        if weight.dtype != head.weight.dtype:
            model.set_output_embeddings(HalfHead(nn.Parameter(weight, requires_grad=False), head.bias))
    return {"packed_linears": len(packed), "half_linears": narrowed,
            "embedding_dtype": str(embedding.weight.dtype).removeprefix("torch.")}


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
