"""The `kv_cache` step: calibrate static K/V scales on the cached keys (after RoPE) and values,
and attach the quantized cache (lowbit.quantize.runtime.kv_cache) that the model then runs with."""
from __future__ import annotations

from typing import Optional

from torch import nn

from lowbit.quantize.grids.kv import KVCacheConfig, static_scale
from lowbit.quantize.runtime.kv_cache import SCALE_NAMES, attach, attention_modules, detach
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.spec import MODEL, StepSpec


def set_scales(attns: list[nn.Module], stats: Optional[dict], cfg: KVCacheConfig) -> None:
    """Store (or, for per-token schemes, clear) k_scale/v_scale on each attention module."""
    for i, attn in enumerate(attns):
        for name, stat in zip(SCALE_NAMES, ("k_absmax", "v_absmax")):
            value = static_scale(stats[stat][i], cfg) if cfg.static else None
            attn.register_buffer(name, value, persistent=False)


def apply(ctx: StepContext, cfg: KVCacheConfig) -> dict:
    detach(ctx.model)  # observe what a float cache would hold, after any weight quantization
    attns = attention_modules(ctx.model, ctx.arch)
    stats = ctx.kv_absmax() if cfg.static else None
    set_scales(attns, stats, cfg)
    attach(ctx.model, cfg)
    detail = {"format": cfg.format, "strategy": cfg.strategy, "layers": len(attns)}
    if stats is not None:
        detail["k_scale"] = [a.k_scale.tolist() for a in attns]
        detail["v_scale"] = [a.v_scale.tolist() for a in attns]
    return detail


SPEC = StepSpec("kv_cache", KVCacheConfig, apply, "INT8/FP8/INT4 KV cache, scales on cached K/V",
                kv_cache=lambda cfg: cfg,
                streamed=lambda cfg: MODEL, observes=lambda cfg: "kv" if cfg.static else None)
