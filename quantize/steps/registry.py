"""The steps a recipe may list. A new algorithm is its own file in this folder (config, apply(),
SPEC) plus one entry here."""
from __future__ import annotations

from lowbit.quantize.steps import awq, distill, fp8, gptq, int8_inputs, kv_cache, rotate, rtn, rtn_mse, signround, smoothquant
from lowbit.quantize.steps.spec import StepSpec

STEPS: dict[str, StepSpec] = {spec.name: spec for spec in (
    rotate.SPEC,
    gptq.SPEC,
    signround.SPEC,
    rtn.SPEC,
    rtn_mse.SPEC,
    smoothquant.SPEC,
    awq.SPEC,
    int8_inputs.SPEC,
    fp8.SPEC,
    kv_cache.SPEC,
    distill.SPEC,
)}
