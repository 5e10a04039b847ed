"""Where a walk's and an export's decoder layers come from (LayerSource), where a walk keeps the
layers it finished (LayerStore), and the source over a model held in memory (MemoryLayers): a
resident run's model goes through the same walk, audit and export as a streamed run's layers
(app/streamed.py's StreamedLayers reads those from safetensors shards)."""
from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple, Optional, Protocol

import torch
from torch import nn

from .arch import Arch
from .streaming import outer_modules


class Portion(NamedTuple):
    """What one pass of an export holds (LayerSource.portions): decoder layers by index, modules
    outside them by name."""

    layers: list[int]
    outer: list[str]


class LayerStore(Protocol):
    """Where walk() checkpoints finished layers (implemented by the run, which can serialise
    quantized modules): save after each layer; restore returns (result, hidden) for a layer a
    previous run finished — hidden being the outputs of the last finished layer, else None —
    after loading its state into `layer`, or None when the layer still has to be done.
    outputs_lost: the saved outputs are gone, so the walk computes each restored layer's outputs."""

    outputs_lost: bool

    def save(self, index: int, prefix: str, layer: nn.Module, result,
             hidden: Optional[list[torch.Tensor]]) -> None: ...

    def restore(self, index: int, prefix: str, layer: nn.Module): ...


class LayerSource(Protocol):
    """Where a walk's layers come from: load puts layer `index` (at `prefix`) on `device` before
    the walk reaches it, unload lets it go after; outer(device, tokens=ids) is a context manager
    that keeps what runs before the first layer (of the token embedding, the rows of `ids`) resident
    while inputs are captured (an export asks for the modules outside the layers by name: outer_names,
    and outer's dtype and names). portions(count) says how an export takes the model: which layers
    and outer modules each of its passes holds."""

    def load(self, index: int, prefix: str, layer: nn.Module, device) -> None: ...

    def unload(self, index: int, prefix: str, layer: nn.Module) -> None: ...

    def outer(self, device, dtype=None, names=None): ...

    def outer_names(self) -> list[str]: ...

    def portions(self, count: int) -> list[Portion]: ...


class MemoryLayers:
    """LayerSource over a model held in memory: a layer is moved to the walk's device when loaded
    and back where it was when let go (the rest of the model stays where it is); the modules
    outside the layers are resident already; an export takes the whole model in one portion."""

    def __init__(self, model: nn.Module, arch: Arch):
        self.model, self.arch = model, arch
        self._homes: dict[int, Optional[torch.device]] = {}

    def load(self, index: int, prefix: str, layer: nn.Module, device) -> None:
        param = next(layer.parameters(), None)
        self._homes[index] = None if param is None else param.device
        layer.to(device)

    def unload(self, index: int, prefix: str, layer: nn.Module) -> None:
        home = self._homes.pop(index, None)
        if home is not None:
            layer.to(home)

    def outer(self, device, dtype=None, names=None, tokens=None):
        return nullcontext()  # resident, in the dtype the model holds

    def outer_names(self) -> list[str]:
        return [name for name, _ in outer_modules(self.model, self.arch.layers)]

    def portions(self, count: int) -> list[Portion]:
        return [Portion(list(range(count)), self.outer_names())]
