"""What every quantization step receives: the model, its layout and (lazily) calibration data."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from lowbit.calibrate.arch import Arch
from lowbit.calibrate.walker import LayerSource, LayerStore


@dataclass
class StepContext:
    model: nn.Module
    arch: Arch
    ignore: tuple[str, ...]
    make_batches: Callable[[], torch.Tensor]  # (samples, seq_len) token ids, built on first use
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    layer_store: Optional[LayerStore] = None  # checkpoints each finished layer of a walk (resume)
    layer_source: Optional[LayerSource] = None  # streamed runs: where a walk loads each layer from
    _batches: Optional[torch.Tensor] = None

    @property
    def batches(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = self.make_batches()
        return self._batches
