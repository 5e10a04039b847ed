"""Everything the evaluation stage measures on one in-memory model, as results.json sections.

recipes/run.py calls these on the reloaded checkpoint; `lowbit eval` calls them on whatever it
was given. The unquantized reference model is loaded lazily, only when KL, speed or a
bitsandbytes baseline needs it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from .baseline import cached_baseline
from .config import EvaluateConfig, MemoryConfig
from .kl import kl_divergence
from .memory import ModelShape, fit_table, measure_peak, predicted_total

MEASURE_CONTEXT_CAP = 512  # measured peak: one prefill of at most this many tokens (CPU time)


class LazyModel:
    """Loads the reference model on first use; `loaded` says whether anything was paid for."""

    def __init__(self, load: Optional[Callable[[], object]]):
        self._load, self._model = load, None

    @property
    def available(self) -> bool:
        return self._load is not None

    def get(self):
        if self._model is None:
            self._model = self._load()
        return self._model


def evaluate_extras(model, tokenizer, cfg: EvaluateConfig, *, model_name: str, weight_bytes: int,
                    baseline_weight_bytes: Optional[int], reference: LazyModel, steps: list[dict]) -> dict:
    """The sections beyond perplexity and weight bytes, each only when enabled:
    {"quality": {kl, lm_eval, baseline_lm_eval}, "memory": {...}, "speed": {...}, "baselines": {...}}."""
    kv_bytes = kv_bytes_for(cfg.memory, steps)
    memory = memory_section(model, weight_bytes, cfg.memory, kv_bytes)
    if baseline_weight_bytes:  # the unquantized model as a 16-bit deployment (16-bit KV too)
        base = memory_section(model, baseline_weight_bytes, dataclasses.replace(cfg.memory, measure_peak=False), 2.0)
        memory.update(baseline_predicted=base["predicted"], baseline_fit=base["fit"])
    out = {"quality": quality_extras(model, tokenizer, cfg, reference, model_name), "memory": memory}
    if cfg.speed.enabled:
        from .speed import speed_on_devices

        models = {"model": model, **({"baseline": reference.get()} if reference.available else {})}
        out["speed"] = speed_on_devices(models, cfg.speed)
    if cfg.bnb_baselines:
        out["baselines"] = {f"bnb-{mode}": bnb_row(model_name, mode, tokenizer, cfg, reference, kv_bytes)
                            for mode in cfg.bnb_baselines}
    return out


def quality_extras(model, tokenizer, cfg: EvaluateConfig, reference: LazyModel, model_name: str) -> dict:
    """KL vs the reference and lm-eval scores (the reference's cached), each only when enabled."""
    out = {}
    if cfg.kl.enabled and reference.available:
        out["kl"] = kl_divergence(reference.get(), model, tokenizer, cfg.perplexity, cfg.kl)
    if cfg.lm_eval.tasks:
        from .lm_tasks import LMEvalKey, run_lm_eval

        out["lm_eval"] = run_lm_eval(model, tokenizer, cfg.lm_eval)
        if reference.available and cfg.baseline:
            out["baseline_lm_eval"] = cached_baseline(
                model_name, LMEvalKey(cfg=cfg.lm_eval), lambda: run_lm_eval(reference.get(), tokenizer, cfg.lm_eval))
            out["baseline_lm_eval"].pop("cached", None)
    return out


def bnb_row(model_name: str, mode: str, tokenizer, cfg: EvaluateConfig, reference: LazyModel,
            kv_bytes: float) -> dict:
    """One bitsandbytes baseline measured like the model itself, or why it could not be."""
    from .bnb import bnb_quality, bnb_weight_bytes, load_bnb

    try:
        model = load_bnb(model_name, mode)
        quality = bnb_quality(model_name, mode, model, tokenizer, cfg, reference)
        row = {"quality": {k: v for k, v in quality.items() if k != "cached"}}
        weights = bnb_weight_bytes(model)
        memory = memory_section(model, weights, dataclasses.replace(cfg.memory, measure_peak=False), kv_bytes)
        row["memory"] = {"weight_bytes": weights, **memory}
        if cfg.speed.enabled:
            from .speed import compare_speed

            row["speed"] = compare_speed({"model": model}, cfg.speed)  # bnb models stay where loaded
        return row
    except Exception as err:  # any failure of bitsandbytes here is a finding to report, not to hide
        return {"unavailable": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}


def memory_section(model, weight_bytes: int, cfg: MemoryConfig, kv_bytes: float) -> dict:
    """Predicted total and fit table for deployment (16-bit activations), and a measured peak."""
    shape = ModelShape.from_config(model.config)
    m = cfg
    out = {
        "predicted": predicted_total(weight_bytes, shape, m.batch, m.context, kv_bytes, m.act_bytes),
        "fit": fit_table(weight_bytes, shape, m.budgets_gb, m.fit_context, kv_bytes, m.act_bytes),
        "model_max_context": getattr(model.config.get_text_config(), "max_position_embeddings", None),
    }
    if m.measure_peak:
        out["measured_peak"] = measured_prefill_peak(model, shape, m)
    return out


@torch.inference_mode()
def measured_prefill_peak(model, shape: ModelShape, cfg: MemoryConfig) -> dict:
    """Peak memory of one prefill at batch x context (capped), beside the formula for the same
    run at the model's own dtype, so the two can be compared."""
    from transformers import DynamicCache

    from .speed import _forward_kwargs

    param = next(model.parameters())
    context = min(cfg.context, MEASURE_CONTEXT_CAP)
    ids = torch.randint(0, shape.vocab, (cfg.batch, context), generator=torch.Generator().manual_seed(0))
    cache_kw, keep = _forward_kwargs(model)
    extra = {"logits_to_keep": 1} if keep else {}

    def prefill():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids.to(param.device), use_cache=True, **{cache_kw: cache}, **extra)
        return cache

    cache, peak = measure_peak(prefill, param.device)
    elem = param.element_size()
    predicted = predicted_total(0, shape, cfg.batch, context, elem, elem)
    return {**peak, "batch": cfg.batch, "context": context, "dtype": str(param.dtype).removeprefix("torch."),
            "predicted_kv_plus_activations": predicted["kv_cache"] + predicted["activations"]}


def kv_bytes_for(cfg: MemoryConfig, steps: list[dict]) -> float:
    """Bytes per cached K/V element: the recipe's explicit value, else what a KV-cache step
    recorded ('kv_bits' / 'kv_cache_bits' in any step, or 'bits' of a step named *kv*; a kv step
    that says nothing is taken as FP8), else 16-bit."""
    if cfg.kv_bytes is not None:
        return cfg.kv_bytes
    for step in steps:
        named_kv = "kv" in str(step.get("name", ""))
        bits = step.get("kv_bits", step.get("kv_cache_bits", step.get("bits") if named_kv else None))
        if isinstance(bits, (int, float)) and not isinstance(bits, bool) and bits > 0:
            return bits / 8
        if named_kv:
            return 1.0
    return 2.0
