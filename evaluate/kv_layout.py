"""What each decoder layer keeps in the KV cache, read from a transformers config.

Not every layer caches every token: sliding-window layers keep the last `window` tokens
(Mistral-style `sliding_window` on all layers; Gemma 2/3, GPT-OSS, Cohere 2, Qwen 2 list
per-layer `layer_types`), layers that reuse another layer's cache keep nothing (Gemma 3n/4
`kv_sharing_modes` / `num_kv_shared_layers`), and multi-head latent attention (DeepSeek V2/V3)
keeps one compressed latent (`kv_lora_rank`) plus a shared rotary key (`qk_rope_head_dim`) per
token instead of per-head K and V. transformers' DynamicCache allocates the same per layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

FULL, SLIDING, NONE = "full", "sliding", "none"

# config.layer_types values -> how the layer caches (transformers 5 names; "hybrid" layers add a
# constant recurrent state, which is not per token and not counted)
LAYER_TYPE_KINDS = {
    "full_attention": FULL, "hybrid": FULL,
    "sliding_attention": SLIDING, "chunked_attention": SLIDING, "hybrid_sliding": SLIDING,
    "linear_attention": NONE, "conv": NONE, "mamba": NONE, "moe": NONE, "mlp": NONE,
}


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache: elements per token (K and V together, or the MLA latent) for the last
    `window` tokens (None: every token). elements == 0: the layer caches nothing of its own."""

    elements_per_token: int
    window: Optional[int] = None

    def cached_tokens(self, tokens: int) -> int:
        return tokens if self.window is None else min(tokens, self.window)


def kv_layers(config) -> tuple[LayerKV, ...]:
    """Per decoder layer, what it caches (see the module docstring for the configs read)."""
    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = first_attr(c, "num_hidden_layers", "n_layer")
    per_layer = _per_layer_configs(c, n)
    kinds = _layer_kinds(c, n)
    shared = _reuses_another_layers_cache(c, n)
    layers = []
    for i, (layer_cfg, kind) in enumerate(zip(per_layer, kinds)):
        if kind == NONE or shared[i]:
            layers.append(LayerKV(0))
        elif kind == SLIDING:
            window = getattr(layer_cfg, "sliding_window", None) or getattr(layer_cfg, "attention_chunk_size", None)
            if not window:
                raise ValueError(f"{type(c).__name__}: layer {i} is a sliding-window layer but the config has no "
                                 "sliding_window (or attention_chunk_size)")
            layers.append(LayerKV(_elements_per_token(layer_cfg), int(window)))
        else:
            layers.append(LayerKV(_elements_per_token(layer_cfg)))
    return tuple(layers)


def _elements_per_token(c) -> int:
    if getattr(c, "kv_lora_rank", None):  # MLA: the latent and the shared rotary key, one "head"
        return int(c.kv_lora_rank + c.qk_rope_head_dim)
    heads = first_attr(c, "num_attention_heads", "n_head")
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or first_attr(c, "hidden_size", "n_embd", "d_model") // heads
    return 2 * kv_heads * head_dim


def _per_layer_configs(c, n: int) -> list:
    """transformers >= 5.x gives per-layer overrides (e.g. Gemma 4's wider global heads) through
    config.per_layer_config; older configs are uniform."""
    per_layer = getattr(c, "per_layer_config", None)
    return [per_layer[i] for i in range(n)] if per_layer is not None else [c] * n


def _layer_kinds(c, n: int) -> list[str]:
    layer_types = getattr(c, "layer_types", None)
    if layer_types is None:  # Mistral-style: one window for every layer, or none
        sliding = getattr(c, "sliding_window", None) or getattr(c, "attention_chunk_size", None)
        return [SLIDING if sliding else FULL] * n
    if len(layer_types) < n:
        raise ValueError(f"{type(c).__name__}.layer_types lists {len(layer_types)} layers, num_hidden_layers is {n}")
    kinds = []
    for i, t in enumerate(layer_types[:n]):
        if t not in LAYER_TYPE_KINDS:
            raise ValueError(f"{type(c).__name__}.layer_types[{i}] is {t!r}; the memory model knows "
                             f"{sorted(LAYER_TYPE_KINDS)}")
        kinds.append(LAYER_TYPE_KINDS[t])
    return kinds


def _reuses_another_layers_cache(c, n: int) -> list[bool]:
    """kv_sharing_modes ("reuse" per layer) where the config has it, else the last
    num_kv_shared_layers layers (Gemma 3n's convention)."""
    modes = getattr(c, "kv_sharing_modes", None)
    if modes is not None:
        return [m == "reuse" for m in list(modes)[:n]] + [False] * (n - len(modes))
    shared = getattr(c, "num_kv_shared_layers", None) or 0
    return [i >= n - shared for i in range(n)]


def first_attr(config, *names, default=...):
    """The first of `names` the config sets (configs spell the same size differently)."""
    for name in names:
        if getattr(config, name, None) is not None:
            return getattr(config, name)
    if default is ...:
        raise ValueError(f"{type(config).__name__} has none of {names}; cannot size the model")
    return default
