"""Observers: run calibration batches through the whole model and return statistics as plain tensors.

Statistics are artifacts: what comes back can be saved, inspected and reused; nothing is left
hanging on the model. Padding is not handled: calibration batches are full windows.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from .progress import Progress


def _micro_batches(batches: torch.Tensor, micro_batch: int):
    return [batches[i : i + micro_batch] for i in range(0, len(batches), micro_batch)]


@torch.no_grad()
def linear_input_absmax(model: nn.Module, names: list[str], batches: torch.Tensor,
                        micro_batch: int = 8) -> dict[str, torch.Tensor]:
    """name -> scalar float32 tensor: the largest |input| each named linear sees."""
    absmax = {name: torch.zeros(()) for name in names}

    def hook_for(name):
        def hook(module, args):
            absmax[name] = torch.maximum(absmax[name], args[0].detach().abs().amax().float().cpu())
        return hook

    handles = [model.get_submodule(n).register_forward_pre_hook(hook_for(n)) for n in names]
    device = next(model.parameters()).device
    try:
        chunks = _micro_batches(batches, micro_batch)
        progress = Progress("observe activations", len(chunks), "batches")
        for chunk in chunks:
            model(input_ids=chunk.to(device), use_cache=False)
            progress.step()
    finally:
        for h in handles:
            h.remove()
    return absmax


class _AbsmaxRecordingLayer(DynamicLayer):
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
        cache = Cache(layers=[_AbsmaxRecordingLayer(stats, i) for i in range(n_layers)])
        model(input_ids=chunk.to(device), cache=cache, use_cache=True)
        progress.step()
    missing = [i for i in range(n_layers) if i not in stats["k_absmax"]]
    if missing:
        raise ValueError(f"layers {missing} never wrote to the KV cache; this architecture "
                         f"({model.config.model_type}) does not cache through transformers' Cache.update")
    return {name: torch.stack([per_layer[i] for i in range(n_layers)]) for name, per_layer in stats.items()}
