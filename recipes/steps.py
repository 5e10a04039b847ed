"""The steps a recipe may list: name -> (frozen config class, apply(ctx, cfg) -> results dict).

Each quantization algorithm registers here; the recipe loader validates a step's options
against its config class.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from lowbit.quantize import fp8_step, kv_cache, rtn


class StepSpec(NamedTuple):
    config: type
    apply: Callable
    summary: str


STEPS: dict[str, StepSpec] = {
    "rtn": StepSpec(rtn.RTNConfig, rtn.apply, "round-to-nearest weight quantization"),
    "fp8": StepSpec(fp8_step.FP8Config, fp8_step.apply, "FP8 weights and activations (dynamic or static)"),
    "kv_cache": StepSpec(kv_cache.KVCacheConfig, kv_cache.apply, "INT8/FP8/INT4 KV cache, scales on cached K/V"),
}
