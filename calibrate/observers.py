"""Activation statistics: observers that return plain tensors (artifacts to save and reuse)."""
from __future__ import annotations

import torch
from torch import nn


class ChannelAbsMax:
    """Running per-channel absmax of 2-d activations (tokens, channels)."""

    def __init__(self):
        self.value: torch.Tensor | None = None

    def update(self, x2d: torch.Tensor) -> None:
        m = x2d.detach().abs().amax(dim=0).float().cpu()
        self.value = m if self.value is None else torch.maximum(self.value, m)


@torch.no_grad()
def linear_input_absmax(model: nn.Module, names: list[str], batches: torch.Tensor,
                        micro_batch: int = 8) -> dict[str, torch.Tensor]:
    """name -> (in_features,) absmax of that module's input over every calibration token."""
    observers = {name: ChannelAbsMax() for name in names}
    hooks = [model.get_submodule(name).register_forward_pre_hook(_observe(observers[name]))
             for name in names]
    try:
        device = next(model.parameters()).device
        for start in range(0, len(batches), micro_batch):
            model(batches[start:start + micro_batch].to(device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    missing = [n for n, o in observers.items() if o.value is None]
    if missing:
        raise RuntimeError(f"no input reached {missing[:3]} during calibration")
    return {name: o.value for name, o in observers.items()}


def _observe(observer: ChannelAbsMax):
    def hook(module, args):
        x = args[0]
        observer.update(x.reshape(-1, x.shape[-1]))
    return hook
