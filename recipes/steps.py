"""The steps a recipe may list: name -> (frozen config class, apply(ctx, cfg) -> results dict).

Each quantization algorithm registers here; the recipe loader validates a step's options
against its config class.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from lowbit.quantize import awq, fp8_step, gptq, input_quant, kv_cache, rtn, smoothquant


class StepSpec(NamedTuple):
    config: type
    apply: Callable
    summary: str


STEPS: dict[str, StepSpec] = {
    "gptq": StepSpec(gptq.GPTQConfig, gptq.apply, "GPTQ: error-compensating weight quantization, layer by layer"),
    "rtn": StepSpec(rtn.RTNConfig, rtn.apply, "round-to-nearest weight quantization"),
    "smoothquant": StepSpec(smoothquant.SmoothQuantConfig, smoothquant.apply,
                            "migrate activation outliers into the weights (folds scales; quantizes nothing)"),
    "awq": StepSpec(awq.AWQConfig, awq.apply,
                    "activation-aware weight scaling and clipping (folds scales; a later step quantizes)"),
    "quantize_inputs": StepSpec(input_quant.InputQuantConfig, input_quant.apply,
                                "INT8 input quantization of the quantized linears (W8A8 after an int8 weight step)"),
    "fp8": StepSpec(fp8_step.FP8Config, fp8_step.apply, "FP8 weights and activations (dynamic or static)"),
    "kv_cache": StepSpec(kv_cache.KVCacheConfig, kv_cache.apply, "INT8/FP8/INT4 KV cache, scales on cached K/V"),
}
