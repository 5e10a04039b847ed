"""evaluate(target, cfg): quality, memory (and on request speed) of a checkpoint folder or a plain
model, returned as the Results that results.json holds. `lowbit run` calls it on the checkpoint it
has just written (so the figures are the checkpoint's), `lowbit eval` on whatever it is given.

What is resident when: the evaluated model from the start; the reference only from the first
figure that needs it (KL, a baseline figure missing from the cache, speed, bitsandbytes), never
before the measured peak; a streamed reference never, one decoder layer (or its head) at a time
while its perplexity and KL are measured; a bitsandbytes model one at a time. All go when
evaluate() returns.
"""
from __future__ import annotations

import dataclasses
from importlib.metadata import version
from pathlib import Path
from typing import Optional

from lowbit.calibrate.hardware import cpu_info
from lowbit.calibrate.provenance import provenance

from .baseline import cached_baseline
from .config import EvaluateConfig
from .loading import load_target
from .peak_probe import Loadable
from .placement import place, resolve_placement
from .perplexity import perplexity
from .perplexity_streamed import streamed_perplexity
from .results import Memory, ModelInfo, Quality, Results, plain
from .suite import Reference, bnb_row, kv_bytes_per_element, memory_sections, quality_extras


def evaluate(target: str | Path, cfg: EvaluateConfig, reference: Optional[Reference] = None, *,
             trust_remote_code: bool = False, allow_pickle: bool = False) -> Results:
    """Evaluate `target`, a checkpoint folder (reloaded as written) or a model name/folder (weights
    counted as 16-bit), against `reference` when given."""
    reference = reference or Reference(None, None)
    placement = resolve_placement(cfg.device, cfg.dtype)  # a GPU asked for and absent: said before any work
    reference.placement = placement
    model, tokenizer, weight_bytes = load_target(target, trust_remote_code, allow_pickle)
    place(model, placement)
    measured = perplexity(model, tokenizer, cfg.perplexity)
    kv_bytes = kv_bytes_per_element(model, cfg.memory)
    where = placement.describe()
    memory = memory_sections(model, weight_bytes, reference, cfg.memory, kv_bytes,
                             Loadable(str(target), trust_remote_code, allow_pickle, where["dtype"]))
    model_name = reference.name or str(target)
    quality = Quality(
        perplexity=measured["perplexity"],
        baseline_perplexity=baseline_perplexity(reference, tokenizer, cfg),
        dataset=cfg.perplexity.dataset,
        protocol={**plain(cfg.perplexity), **measured, **where},
        **quality_extras(model, tokenizer, cfg, reference, model_name),
        held_out={name: held_out_quality(model, tokenizer, cfg, reference, name) for name in cfg.held_out
                  if name != cfg.perplexity.dataset} or None)
    speed = baselines = None
    if cfg.speed.enabled:
        from .speed import speed_on_devices

        speed = speed_on_devices({"model": model, **({"baseline": reference.get()} if reference.available else {})},
                                 cfg.speed)
    if cfg.bnb_baselines:
        baselines = {f"bnb-{mode}": bnb_row(model_name, mode, tokenizer, cfg, reference, kv_bytes)
                     for mode in cfg.bnb_baselines}
    return Results(
        lowbit_version=version("lowbit"),
        model=ModelInfo(id=str(target), model_type=model.config.model_type, reference=reference.name,
                        dtype=where["dtype"]),  # what evaluation computed in, reference alike
        hardware=cpu_info().to_dict(),
        recipe={"name": f"eval {Path(target).name or target}", "evaluate": written(cfg)},
        quality=quality, memory=Memory(weight_bytes=weight_bytes, **memory), speed=speed, baselines=baselines,
        measured=provenance())


def held_out_quality(model, tokenizer, cfg: EvaluateConfig, reference: Reference, dataset: str) -> dict:
    """Perplexity, the baseline's and KL on another text, under the same protocol otherwise."""
    cfg = dataclasses.replace(cfg, perplexity=dataclasses.replace(cfg.perplexity, dataset=dataset),
                              lm_eval=dataclasses.replace(cfg.lm_eval, tasks=()))
    extras = quality_extras(model, tokenizer, cfg, reference, reference.name or "")
    return {"perplexity": perplexity(model, tokenizer, cfg.perplexity)["perplexity"],
            "baseline_perplexity": baseline_perplexity(reference, tokenizer, cfg), **extras}


def baseline_perplexity(reference: Reference, tokenizer, cfg: EvaluateConfig) -> Optional[float]:
    """The reference's perplexity under the same protocol, from the cache (a run fills it before
    quantizing, while its model is still the baseline) or measured on the reference: resident, or
    streamed from its folder (the same figure, so the two share the cache)."""
    if not cfg.baseline or not (reference.available or reference.stream_from):
        return None
    where = reference.placement
    if reference.available:
        measure = lambda: perplexity(reference.get(), tokenizer, cfg.perplexity)  # noqa: E731
    else:
        measure = lambda: streamed_perplexity(reference.stream_from, tokenizer, cfg.perplexity,  # noqa: E731
                                              device=where.device, dtype=where.dtype)
    return cached_baseline(reference.name, cfg.perplexity, measure, where.describe())["perplexity"]


def written(cfg: EvaluateConfig) -> dict:
    """The evaluation's options as a run's results.json writes them."""
    out = plain(cfg)
    for key in cfg.unwritten_keys():
        del out[key]
    return out
