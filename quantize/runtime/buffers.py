"""The runtime modules' buffers: made on their data's device, kept in their number formats.

A quantized module's codes and scales are its format. torch casts every floating buffer on
`.to(dtype)`, `.half()`, `.bfloat16()`, `.float()` or `model.to(dtype)`, float8 weights included:
an FP8 weight cast to bfloat16 is no longer FP8, a scale rounded to bfloat16 no longer the
calibrated one. RuntimeModule lets a cast reach only the buffers a module names in
FLOAT_CAST_BUFFERS (the compute-dtype ones, such as a bias); every other buffer moves to the new
device (`.to(device)`, `.cuda()`, `.to("meta")`) in its own dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, TypeVar

import torch
from torch import nn


class RuntimeModule(nn.Module):
    """Base of the runtime's quantized modules: casts change only FLOAT_CAST_BUFFERS' dtypes."""

    FLOAT_CAST_BUFFERS: tuple[str, ...] = ()  # buffers that follow a float dtype cast

    def _apply(self, fn: Callable, recurse: bool = True):
        fixed = {id(t) for name, t in self._buffers.items()
                 if t is not None and name not in self.FLOAT_CAST_BUFFERS}
        return super()._apply(lambda t: moved_only(fn, t) if id(t) in fixed else fn(t), recurse)


def moved_only(fn: Callable, t: torch.Tensor) -> torch.Tensor:
    """fn(t) where fn keeps t's dtype (a move, to_empty); else t moved where fn would put it."""
    target = fn(t.new_empty(0))  # what fn does to a tensor like t, at the price of an empty one
    if target.dtype == t.dtype:
        return fn(t)
    return t.to(target.device)


def one_device(owner: str, **tensors: Optional[torch.Tensor]) -> torch.device:
    """The one device all given tensors (None skipped) are on; a module is never split."""
    where = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(where.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in where.items())
        raise ValueError(f"{owner}: its tensors are on different devices ({listed}); "
                         "move them to one device first")
    return next(iter(where.values()))


W = TypeVar("W")


def on_device(weight: W, device: torch.device) -> W:
    """A quantized weight (a grid's dataclass: QuantizedWeight, FP8Weight, GGUFWeight) with every
    tensor on device; a result another rank sent arrives on the CPU, the layer may be elsewhere."""
    moved = {f.name: getattr(weight, f.name).to(device) for f in dataclasses.fields(weight)
             if isinstance(getattr(weight, f.name), torch.Tensor)}
    return dataclasses.replace(weight, **moved)


def fill_buffers(module: nn.Module, **tensors: Optional[torch.Tensor]) -> nn.Module:
    """Set every buffer module declares (made on the meta device: shapes and dtypes only) to a
    copy of the tensor of that name, in the declared dtype, on the tensor's device."""
    owner = type(module).__name__
    declared = {name for name, t in module._buffers.items() if t is not None}
    given = {name for name, t in tensors.items() if t is not None}
    if given != declared:
        raise ValueError(f"{owner}: given tensors {sorted(given)}, but its format holds {sorted(declared)}")
    for name in sorted(declared):
        t, want = tensors[name], module._buffers[name]
        if t.shape != want.shape:
            raise ValueError(f"{owner}.{name}: shape {tuple(t.shape)}, expected {tuple(want.shape)}")
        module._buffers[name] = t.detach().to(dtype=want.dtype, memory_format=torch.contiguous_format,
                                              copy=True)
    return module
