"""StepSpec: what a recipe step is and what it leaves on the model, asked by the recipe loader,
the audit, the memory model and the report (never an isinstance chain or a step's name).

Each algorithm's file defines its config, its apply() and one SPEC; registry.py lists them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from lowbit.quantize.grids.inputs import InputQuant
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.grids.kv import KVCacheConfig
from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.steps.context import StepContext


def _nothing(cfg) -> None:
    return None


def _per_layer(cfg) -> str:
    return LAYERS


# MODEL: applied once to the skeleton, no layer resident (it changes no weights)
WALK, LAYERS, MODEL = "walk", "layers", "model"


@dataclass(frozen=True)
class StepSpec:
    name: str  # the key a recipe lists it under
    config: type  # frozen dataclass of the step's options, validated on load
    apply: Callable[[StepContext, Any], dict]  # changes ctx.model; returns the step's record
    summary: str  # one line for `lowbit recipes` and the docs
    # the scheme every linear the step targets is left with (weight steps), else None
    writes: Callable[[Any], Optional[LinearScheme]] = _nothing
    # input quantization added to the linears already quantized whose grid takes it (quantize_inputs:
    # an InputQuant for integer ones; fp8: an activation mode for FP8 ones)
    adds_inputs: Callable[[Any], Union[InputQuant, str, None]] = _nothing
    # the KV-cache format the model runs with afterwards
    kv_cache: Callable[[Any], Optional[KVCacheConfig]] = _nothing
    # the weight grid a scale search assumes (awq, smoothquant): the next weight step must write it
    searches: Callable[[Any], Optional[IntScheme]] = _nothing
    # how it runs on a streamed model (never resident): WALK when its own layer walk loads each
    # layer (ctx.layer_source), LAYERS when it needs no data and is applied to one resident layer
    # at a time, MODEL when applied once with no layer resident; other text: why it cannot stream
    streamed: Callable[[Any], str] = _per_layer
    # statistics it reads through ctx (linear_inputs: linear_input_absmax, kv: kv_absmax), which a
    # streamed run observes with a layer walk before the step
    observes: Callable[[Any], Optional[str]] = _nothing
    # it rewrites the float model every later step calibrates on (rotate): the recipe lists it first
    runs_first: bool = False
    # it trains what a weight step wrote (distill): the recipe lists it after one
    follows_weights: bool = False
