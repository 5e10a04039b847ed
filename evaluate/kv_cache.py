"""KV-cache figures: bytes per token (measured from the cache tensors, and by formula) and the
perplexity effect of a KV scheme alone (same weights, float cache vs quantized cache)."""
from __future__ import annotations

import torch
from torch import nn

from lowbit.calibrate.cached_forward import cached_forward
from lowbit.quantize.runtime import kv_cache

from .config import PerplexityProtocol
from .perplexity import perplexity

def kv_bytes_per_token_formula(config, bytes_per_element: float) -> float:
    """2 (K and V) x layers x kv_heads x head_dim x bytes: the codes alone, scales not counted."""
    c = config.get_text_config(decoder=True)
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * bytes_per_element


def cache_nbytes(cache) -> int:
    """Bytes the cache really holds: a QuantizedKVCache's codes and scales, or a float cache's K/V."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


@torch.no_grad()
def measure_kv_cache(model: nn.Module, prompt_ids: torch.Tensor, decode_steps: int = 4) -> dict:
    """Prefill prompt_ids (batch, tokens), decode a few greedy tokens, then weigh the cache.

    The model's own cache is used: a QuantizedKVCache when the kv_cache step is attached, else
    transformers' float DynamicCache. `bytes_16bit` is what a 16-bit cache would hold for the
    same tokens (formula with 2 bytes), the reference for the memory ratio.
    """
    device = next(model.parameters()).device
    out, cache = cached_forward(model, prompt_ids.to(device))
    for _ in range(decode_steps):
        out, cache = cached_forward(model, out.logits[:, -1:].argmax(-1), cache)
    tokens = cache.get_seq_length() * prompt_ids.shape[0]
    measured = cache_nbytes(cache)
    bytes_16bit = kv_bytes_per_token_formula(model.config, 2) * tokens
    cfg = getattr(model, "lowbit_kv_cache", None)
    formula = kv_bytes_per_token_formula(model.config, cfg.bytes_per_element) if cfg else None
    return {
        "cache": type(cache).__name__,
        "scheme": None if cfg is None else f"{cfg.format}/{cfg.strategy}",
        "tokens": tokens,
        "bytes_measured": measured,
        "bytes_per_token_measured": measured / tokens,
        "bytes_per_token_formula": formula,
        "bytes_per_token_16bit": bytes_16bit / tokens,
        "ratio_to_16bit": measured / bytes_16bit,
    }


def kv_perplexity_effect(model: nn.Module, tokenizer, protocol: PerplexityProtocol) -> dict:
    """Perplexity with the attached quantized KV cache and with a float cache, same weights."""
    cfg = getattr(model, "lowbit_kv_cache", None)
    if cfg is None:
        raise ValueError("the model has no quantized KV cache attached; run the kv_cache step first")
    if not model.config.use_cache:
        # perplexity() calls the model without use_cache, so the config decides; without a cache
        # attention would read float K/V and the effect would read as zero
        raise ValueError("model.config.use_cache is False: the forward would bypass the KV cache")
    quantized = perplexity(model, tokenizer, protocol)["perplexity"]
    kv_cache.detach(model)
    try:
        float_kv = perplexity(model, tokenizer, protocol)["perplexity"]
    finally:
        kv_cache.attach(model, cfg)
    return {"scheme": f"{cfg.format}/{cfg.strategy}", "perplexity_float_kv": float_kv,
            "perplexity_quantized_kv": quantized, "kv_effect_pct": 100 * (quantized / float_kv - 1)}
