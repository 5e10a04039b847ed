"""The observers of observers.py for a model that is never resident: the same statistics, gathered
by a layer walk (walker.walk with a LayerSource) instead of whole-model forwards, so one decoder
layer is loaded at a time. The walk computes each layer's outputs as the whole forward does, and
maxima do not depend on the order they are taken in, so the figures are the resident ones.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers.cache_utils import Cache

from .arch import Arch, decoder_layers
from .cached_forward import cache_keyword
from .offload import Offload
from .observers import AbsmaxRecordingLayer, ChannelAbsMax, stack_kv_stats
from .walker import LayerSource, forward_context, record_linear_inputs, to_device, walk


@torch.no_grad()
def walked_linear_input_absmax(model: nn.Module, arch: Arch, batches: torch.Tensor, source: LayerSource,
                               device, micro_batch: int = 8,
                               offload: Optional[Offload] = None) -> dict[str, torch.Tensor]:
    """Full name -> (in_features,) input absmax of every decoder-layer linear of the table."""
    observers: dict[str, ChannelAbsMax] = {}

    def on_layer(i, prefix, layer, inputs):
        names = list(arch.linears)
        for n in names:
            observers[f"{prefix}.{n}"] = ChannelAbsMax()
        record_linear_inputs(layer, names, inputs, device, lambda n, x: observers[f"{prefix}.{n}"].update(x))

    walk(model, arch, batches, on_layer, device=device, label="observe activations", micro_batch=micro_batch,
         final_outputs=False, source=source, offload=offload)
    return {name: o.value for name, o in observers.items()}


@torch.no_grad()
def walked_kv_absmax(model: nn.Module, arch: Arch, batches: torch.Tensor, source: LayerSource, device,
                     micro_batch: int = 8, offload: Optional[Offload] = None) -> dict[str, torch.Tensor]:
    """{"k_absmax", "v_absmax"}: (layers, kv_heads), as observers.cached_kv_absmax."""
    n_layers = len(decoder_layers(model, arch))
    stats: dict = {"k_absmax": {}, "v_absmax": {}}

    def on_layer(i, prefix, layer, inputs):
        key = cache_keyword(layer)  # a layer that ignores it is caught: stack_kv_stats names it
        with forward_context(inputs, device):
            for hidden, kwargs in zip(inputs.hidden, inputs.kwargs):
                cache = Cache(layers=[AbsmaxRecordingLayer(stats, j) for j in range(n_layers)])
                layer(to_device(hidden, device), **{**to_device(kwargs, device), key: cache, "use_cache": True})

    walk(model, arch, batches, on_layer, device=device, label="observe kv cache", micro_batch=micro_batch,
         final_outputs=False, source=source, offload=offload)
    return stack_kv_stats(stats, n_layers, model)

