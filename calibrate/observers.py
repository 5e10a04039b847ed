"""Observers: run calibration batches through the whole model and return statistics as plain tensors.

Statistics are artifacts: what comes back can be saved, inspected and reused; nothing is left
hanging on the model. Padding is not handled: calibration batches are full windows.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from .cached_forward import cached_forward
from .distributed import all_max
from .progress import Progress


def _micro_batches(batches: torch.Tensor, micro_batch: int):
    return [batches[i : i + micro_batch] for i in range(0, len(batches), micro_batch)]


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
        chunks = _micro_batches(batches, micro_batch)
        progress = Progress("observe activations", len(chunks), "batches")
        for chunk in chunks:
            model(input_ids=chunk.to(device), use_cache=False)
            progress.step()
    finally:
        for hook in hooks:
            hook.remove()
    missing = [n for n, o in observers.items() if o.value is None]
    if missing:
        raise RuntimeError(f"no input reached {missing[:3]} during calibration")
    return {name: all_max(o.value) for name, o in observers.items()}  # over every rank's samples


def _observe(observer: ChannelAbsMax):
    def hook(module, args):
        x = args[0]
        observer.update(x.reshape(-1, x.shape[-1]))
    return hook


class AbsmaxRecordingLayer(DynamicLayer):
    """A cache layer that stores nothing: it records per-head |K| and |V| maxima of what attention
    would cache (keys after RoPE) and hands the states straight back."""

    def __init__(self, stats: dict, layer_idx: int):
        super().__init__()
        self.stats, self.layer_idx = stats, layer_idx

    def update(self, key_states, value_states, *args, **kwargs):
        for name, states in (("k_absmax", key_states), ("v_absmax", value_states)):
            per_head = states.detach().abs().amax(dim=(0, 2, 3)).float().cpu()  # (kv_heads,)
            seen = self.stats[name].get(self.layer_idx)
            self.stats[name][self.layer_idx] = per_head if seen is None else torch.maximum(seen, per_head)
        return key_states, value_states


@torch.no_grad()
def cached_kv_absmax(model: nn.Module, batches: torch.Tensor, micro_batch: int = 8) -> dict[str, torch.Tensor]:
    """{"k_absmax", "v_absmax"}: (layers, kv_heads) float32 maxima of the cached keys (after RoPE)
    and values, observed through the model's own cache calls (Cache.update)."""
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    stats: dict = {"k_absmax": {}, "v_absmax": {}}
    device = next(model.parameters()).device
    chunks = _micro_batches(batches, micro_batch)
    progress = Progress("observe kv cache", len(chunks), "batches")
    for chunk in chunks:
        cache = Cache(layers=[AbsmaxRecordingLayer(stats, i) for i in range(n_layers)])
        cached_forward(model, chunk.to(device), cache)
        progress.step()
    stacked = stack_kv_stats(stats, n_layers, model)
    return {name: all_max(per_layer) for name, per_layer in stacked.items()}  # over every rank's samples


def stack_kv_stats(stats: dict, n_layers: int, model: nn.Module) -> dict[str, torch.Tensor]:
    """The per-layer maxima AbsmaxRecordingLayer gathered, as (layers, kv_heads) tensors; a layer
    that never wrote to the cache is an error naming it."""
    missing = [i for i in range(n_layers) if i not in stats["k_absmax"]]
    if missing:
        raise ValueError(f"layers {missing} never wrote to the KV cache; this architecture "
                         f"({model.config.model_type}) does not cache through transformers' Cache.update")
    return {name: torch.stack([per_layer[i] for i in range(n_layers)]) for name, per_layer in stats.items()}
