"""KV-cache scheme in a checkpoint: compressed-tensors' `kv_cache_scheme` with per-layer
`self_attn.k_scale` / `v_scale` tensors (what vLLM reads), plus lowbit's exact KV config under
the config.json key `lowbit_kv_cache`, so lowbit's reader re-attaches the same quantized cache.
"""
from __future__ import annotations

import torch
from torch import nn

KEY = "lowbit_kv_cache"


def kv_config(model: nn.Module):
    return getattr(model, "lowbit_kv_cache", None)


def kv_cache_scheme(cfg) -> dict:
    """compressed-tensors QuantizationArgs for the cache (static strategies carry scales)."""
    strategy = {"tensor": "tensor", "head": "attn_head", "token": "token"}[cfg.strategy]
    return {"num_bits": 4 if cfg.format == "int4" else 8, "type": "float" if cfg.format == "fp8" else "int",
            "symmetric": cfg.format != "int4", "strategy": strategy, "dynamic": not cfg.static,
            "group_size": cfg.group_size if cfg.format == "int4" else None}


def scale_tensors(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`<attention>.k_scale` / `.v_scale` for every attention module holding static scales."""
    out = {}
    for name, module in model.named_modules():
        for attr in ("k_scale", "v_scale"):
            value = getattr(module, attr, None)
            if isinstance(value, torch.Tensor) and hasattr(module, "layer_idx"):
                out[f"{name}.{attr}"] = value.detach().float().reshape(-1).to(dtype).contiguous()
    return out


def add_to_config(config: dict, cfg) -> None:
    config[KEY] = cfg.to_file()
    if "quantization_config" in config:
        config["quantization_config"]["kv_cache_scheme"] = kv_cache_scheme(cfg)


def restore(model: nn.Module, config_dict: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Put k_scale/v_scale back on the attention modules and re-attach the quantized cache."""
    from lowbit.quantize.runtime.kv_cache import attach
    from lowbit.quantize.grids.kv import KVCacheConfig

    saved = config_dict.get(KEY)
    if not saved:
        return
    cfg = KVCacheConfig.from_file(saved)
    for key in [k for k in tensors if k.endswith((".k_scale", ".v_scale"))]:
        owner, _, attr = key.rpartition(".")
        value = tensors.pop(key).float()
        module = model.get_submodule(owner)
        module.register_buffer(attr, value.reshape(()) if cfg.strategy == "tensor" else value, persistent=False)
    attach(model, cfg)
