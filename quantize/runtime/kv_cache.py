"""The `kv_cache` step and its runtime: a transformers Cache that stores K/V quantized.

What the step leaves on the model (for the runtime and, later, export):
- each attention module (`<layers>.<i>.self_attn`) gets non-persistent float32 buffers `k_scale`
  and `v_scale` — a scalar (strategy tensor) or (kv_heads,) (strategy head) — calibrated on the
  keys after RoPE and the values that attention really caches (observed through Cache.update);
  strategy token (and int4) has no stored scales;
- `model.lowbit_kv_cache` holds the KVCacheConfig;
- a forward pre-hook gives every cached forward a QuantizedKVCache (when the caller passes no
  cache, or the empty DynamicCache that generate() makes), so generate() decodes from quantized
  K/V and a plain forward (perplexity) attends over quantize-dequantized K/V: attention reads the
  K/V back from the quantized store, prompt tokens included, exactly as a decode step would.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, get_layer_types_and_kwargs

from lowbit.calibrate.arch import Arch, arch_for, decoder_layers
from lowbit.calibrate.cached_forward import CACHE_KEYWORDS, cache_keyword
from lowbit.quantize.grids.kv import KVCacheConfig, dequantize_kv, quantize_kv

SCALE_NAMES = ("k_scale", "v_scale")


class QuantizedKVLayer(DynamicLayer):
    """One layer's cache: appends quantized K/V and returns the whole dequantized history.

    What transformers' BaseQuantizedLayer gives (newer 5.x only; 5.17 has none) is written out
    here on DynamicLayer, so the layer is the same on every 5.x: the token count is kept apart from
    the quantized store, the float `keys`/`values` stay empty, and it cannot be cropped."""

    is_croppable = False

    def __init__(self, cfg: KVCacheConfig, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]):
        super().__init__()
        if cfg.static and (k_scale is None or v_scale is None):
            raise ValueError(f"KV strategy {cfg.strategy!r} needs calibrated k_scale/v_scale buffers "
                             "on the attention modules; run the kv_cache step first")
        self.cfg, self.k_scale, self.v_scale = cfg, k_scale, v_scale
        self.cumulative_length = 0
        self._quantized_keys = self._quantized_values = None

    def _quantize(self, tensor, scale=None):
        return quantize_kv(tensor, self.cfg, scale)

    def _dequantize(self, q_tensor):
        return dequantize_kv(q_tensor, self.cfg, self.dtype)

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)  # empty self.keys / self.values
        self.dtype = key_states.dtype

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        """Empty, keeping the object: the next update quantizes from scratch."""
        self.keys = self.values = None
        self._quantized_keys = self._quantized_values = None
        self.cumulative_length, self.is_initialized = 0, False

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        new_k, new_v = self._quantize(key_states, self.k_scale), self._quantize(value_states, self.v_scale)
        if self._quantized_keys is None:
            self._quantized_keys, self._quantized_values = new_k, new_v
        else:
            self._quantized_keys = self._quantized_keys.append(new_k, self.cfg.static)
            self._quantized_values = self._quantized_values.append(new_v, self.cfg.static)
        return self._dequantize(self._quantized_keys), self._dequantize(self._quantized_values)

    def _map_batch(self, fn) -> None:
        if self._quantized_keys is not None:
            self._quantized_keys = self._quantized_keys.map_batch(fn, self.cfg.static)
            self._quantized_values = self._quantized_values.map_batch(fn, self.cfg.static)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the quantized KV cache cannot be cropped (assisted/speculative decoding)")

    def offload(self):
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        self._map_batch(lambda t: t.to(self.device, non_blocking=True))

    def nbytes(self) -> int:
        """Bytes held for this layer: quantized codes plus their scales (and int4 minima)."""
        if self._quantized_keys is None:
            return 0
        return self._quantized_keys.nbytes() + self._quantized_values.nbytes()


class QuantizedKVCache(Cache):
    """A Cache of QuantizedKVLayer, one per decoder layer, reading the model's k_scale/v_scale."""

    def __init__(self, model: nn.Module, cfg: Optional[KVCacheConfig] = None):
        cfg = cfg or getattr(model, "lowbit_kv_cache", None)
        if cfg is None:
            raise ValueError("no KV-cache config: pass one, or run the kv_cache step on the model first")
        layer_types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            raise ValueError(f"{model.config.model_type}: the quantized KV cache supports full-attention "
                             f"layers only; this model also has {other}")
        attns = attention_modules(model, arch_for(model))
        super().__init__(layers=[QuantizedKVLayer(cfg, getattr(a, "k_scale", None), getattr(a, "v_scale", None))
                                 for a in attns])
        self.cfg = cfg

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


def attention_modules(model: nn.Module, arch: Arch) -> list[nn.Module]:
    """The attention module of every decoder layer, in order (cache layer i is decoder layer i)."""
    found = []
    for i, layer in enumerate(decoder_layers(model, arch)):
        if arch.k_proj is not None:
            found.append(layer.get_submodule(arch.k_proj.rpartition(".")[0]))
            continue
        attn = [m for n, m in layer.named_modules() if hasattr(m, "layer_idx") and "Attention" in type(m).__name__]
        if not attn:
            raise ValueError(f"{arch.layers}.{i}: no attention module (one with a layer_idx) found")
        found.append(attn[0])
    return found


def _supply_cache(model, args, kwargs):
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = model.config.use_cache
    cache = next((kwargs[k] for k in CACHE_KEYWORDS if kwargs.get(k) is not None), None)
    if not use_cache or not (cache is None or (type(cache) is DynamicCache and cache.get_seq_length() == 0)):
        return None
    for keyword in CACHE_KEYWORDS:  # generate() passes the name its transformers release uses
        kwargs.pop(keyword, None)
    kwargs[cache_keyword(model)] = QuantizedKVCache(model)
    return args, kwargs


def attach(model: nn.Module, cfg: KVCacheConfig) -> None:
    """Make the model's cached forwards (generate, plain calls) use a QuantizedKVCache."""
    detach(model)
    model.lowbit_kv_cache = cfg
    model._lowbit_kv_hook = model.register_forward_pre_hook(_supply_cache, with_kwargs=True)


def detach(model: nn.Module) -> None:
    """Back to the model's own float cache (the k_scale/v_scale buffers stay)."""
    hook = getattr(model, "_lowbit_kv_hook", None)
    if hook is not None:
        hook.remove()
        del model._lowbit_kv_hook
    if hasattr(model, "lowbit_kv_cache"):
        del model.lowbit_kv_cache
