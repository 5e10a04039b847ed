"""What every quantization step receives: the model, its layout and (lazily) calibration data."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from lowbit.calibrate.arch import Arch
from lowbit.calibrate.observers import cached_kv_absmax, linear_input_absmax
from lowbit.calibrate.offload import Offload
from lowbit.calibrate.layer_source import LayerSource, LayerStore


@dataclass
class StepContext:
    model: nn.Module
    arch: Arch
    ignore: tuple[str, ...]
    make_batches: Callable[[], torch.Tensor]  # (samples, seq_len) token ids, built on first use
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    layer_store: Optional[LayerStore] = None  # checkpoints each finished layer of a walk (resume)
    layer_source: Optional[LayerSource] = None  # streamed runs: where a walk loads each layer from
    # streamed runs: statistics a layer walk observed before the step ("linear_inputs", "kv"), where
    # a resident run observes them through whole-model forwards
    observed: dict = field(default_factory=dict)
    offload: Optional[Offload] = None  # where a walk's activations wait between layers (None: on device)
    # streamed data-free steps: reads a linear (full name) whose weights the layer's load left on meta
    # (a routed expert, read only when it is rounded: app/streamed.py)
    read_deferred: Optional[Callable[[str], None]] = None
    # resident runs: loads the float model again as the recipe names it (distill learns against it)
    reference: Optional[Callable[[], nn.Module]] = None
    stored_dtype: torch.dtype = torch.bfloat16  # the checkpoint's float tensors and scales (export.dtype)
    _batches: Optional[torch.Tensor] = None

    def resident(self, name: str, module: nn.Module) -> None:
        """The linear's weights in memory: read now where the load deferred them."""
        if self.read_deferred is not None and module.weight.is_meta:
            self.read_deferred(name)

    @property
    def batches(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = self.make_batches()
        return self._batches

    def linear_input_absmax(self, names: list[str]) -> dict[str, torch.Tensor]:
        """name -> (in_features,) absmax of that linear's input over the calibration tokens."""
        if "linear_inputs" in self.observed:
            return {name: self.observed["linear_inputs"][name] for name in names}
        return linear_input_absmax(self.model, names, self.batches)

    def kv_absmax(self) -> dict[str, torch.Tensor]:
        """{"k_absmax", "v_absmax"}: (layers, kv_heads) maxima of the cached keys and values."""
        if "kv" in self.observed:
            return self.observed["kv"]
        return cached_kv_absmax(self.model, self.batches)
