"""The sections the evaluation measures on one in-memory model (evaluation.evaluate() assembles
them into Results), and the unquantized reference they compare against, loaded only when KL,
a baseline figure missing from the cache, speed or a bitsandbytes baseline needs it (or, streamed,
never loaded)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from lowbit.calibrate.streaming import ShardedWeights

from .baseline import cached_baseline
from .config import EvaluateConfig, MemoryConfig
from .kl import kl_divergence
from .kl_streamed import streamed_kl_divergence
from .memory import (ModelShape, fit_table, kv_cache_bytes, measure_peak, model_weight_bytes, predicted_total,
                     prefill_workspace_bytes)
from .peak_probe import Loadable, measure_in_subprocess, prefill_and_decode, random_prompt
from .placement import place, resolve_placement
DEFAULT_KV_BYTES = 2.0  # a cache nothing quantizes: 16-bit keys and values


class Reference:
    """The unquantized model named `name`, loaded on first use and held until dropped with the
    Reference; `weight_bytes` (as a 16-bit checkpoint) is counted from it unless already known.
    With `stream_from` (its folder) and no loader, the reference is never loaded: its baseline
    perplexity and KL are measured one decoder layer at a time (KL's logits one batch at a time
    from the final hidden states) and its bytes are read from the shards' headers; what needs a
    resident copy (speed, lm-eval) is left out."""

    def __init__(self, name: Optional[str], load: Optional[Callable[[], object]], weight_bytes: Optional[int] = None,
                 stream_from: Optional[str] = None):
        self.name, self._load, self._model, self._weight_bytes = name, load, None, weight_bytes
        self.stream_from = stream_from
        self.placement = resolve_placement("cpu", "float32")  # evaluate() sets the evaluation's

    @property
    def available(self) -> bool:
        return self._load is not None

    def get(self):
        """The reference, loaded on first use, on the evaluation's device and in its dtype."""
        if self._model is None:
            self._model = place(self._load(), self.placement)
        return self._model

    def weight_bytes(self) -> Optional[int]:
        if self._weight_bytes is None and self.available:
            self._weight_bytes = model_weight_bytes(self.get(), bytes_per_param=2)
        elif self._weight_bytes is None and self.stream_from is not None:
            self._weight_bytes = 2 * ShardedWeights(self.stream_from).numel()
        return self._weight_bytes


def kv_bytes_per_element(model, cfg: MemoryConfig) -> float:
    """Bytes per cached K/V element: what the model's quantized KV cache stores (config.json's
    lowbit_kv_cache, re-attached on load), else the evaluate config's explicit kv_bytes, else 16-bit."""
    kv = getattr(model, "lowbit_kv_cache", None)
    if kv is not None:
        return kv.bytes_per_element
    return cfg.kv_bytes if cfg.kv_bytes is not None else DEFAULT_KV_BYTES


def memory_sections(model, weight_bytes: int, reference: Reference, cfg: MemoryConfig, kv_bytes: float,
                    source: Optional[Loadable] = None) -> dict:
    """The model's memory section (its peak measured before anything else is loaded; on CPU in a
    fresh process that loads `source`), with the reference's predicted footprint and fit beside
    it (a 16-bit deployment, 16-bit KV too)."""
    memory = memory_section(model, weight_bytes, cfg, kv_bytes, source)
    baseline_weight_bytes = reference.weight_bytes()
    memory["baseline_weight_bytes"] = baseline_weight_bytes
    if baseline_weight_bytes:
        base = memory_section(model, baseline_weight_bytes, dataclasses.replace(cfg, measure_peak=False),
                              DEFAULT_KV_BYTES)
        memory.update(baseline_predicted=base["predicted"], baseline_fit=base["fit"])
    return memory


def quality_extras(model, tokenizer, cfg: EvaluateConfig, reference: Reference, model_name: str) -> dict:
    """KL vs the reference and lm-eval scores (the reference's cached), each only when enabled."""
    out = {}
    if cfg.kl.enabled and reference.available:
        out["kl"] = kl_divergence(reference.get(), model, tokenizer, cfg.perplexity, cfg.kl)
    elif cfg.kl.enabled and reference.stream_from:
        where = reference.placement
        out["kl"] = streamed_kl_divergence(reference.stream_from, model, tokenizer, cfg.perplexity, cfg.kl,
                                           device=where.device, dtype=where.dtype)
    if cfg.lm_eval.tasks:
        from .lm_tasks import LMEvalKey, run_lm_eval

        out["lm_eval"] = run_lm_eval(model, tokenizer, cfg.lm_eval)
        if reference.available and cfg.baseline:
            out["baseline_lm_eval"] = cached_baseline(
                model_name, LMEvalKey(cfg=cfg.lm_eval), lambda: run_lm_eval(reference.get(), tokenizer, cfg.lm_eval))
            out["baseline_lm_eval"].pop("cached", None)
    return out


def bnb_row(model_name: str, mode: str, tokenizer, cfg: EvaluateConfig, reference: Reference,
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


def memory_section(model, weight_bytes: int, cfg: MemoryConfig, kv_bytes: float,
                   source: Optional[Loadable] = None) -> dict:
    """Predicted total and fit table for deployment (16-bit activations), and a measured peak."""
    shape = ModelShape.from_config(model.config)
    m = cfg
    out = {
        "predicted": predicted_total(weight_bytes, shape, m.batch, m.context, kv_bytes, m.act_bytes),
        "fit": fit_table(weight_bytes, shape, m.budgets_gb, m.fit_context, kv_bytes, m.act_bytes),
        "model_max_context": getattr(model.config.get_text_config(), "max_position_embeddings", None),
    }
    if m.measure_peak:
        out["measured_peak"] = measured_prefill_peak(model, shape, m, source)
    return out


def measured_prefill_peak(model, shape: ModelShape, cfg: MemoryConfig, source: Optional[Loadable] = None) -> dict:
    """Peak memory of one prefill at batch x context (capped) and a few decoded tokens, beside
    the formula for the same run at the model's own dtype (its quantized KV cache's bytes where
    attached), so the two can be compared. On CPU, in a fresh process that loads `source` when
    given (cfg.measure_in), else in this one; on a GPU, torch's allocator counts in this one."""
    param = next(model.parameters())
    context = min(cfg.context, cfg.measure_context)
    steps = cfg.measure_decode_tokens
    chunk = cfg.prefill_chunk
    if param.device.type == "cpu" and source is not None and cfg.measure_in == "subprocess":
        peak = measure_in_subprocess(source, cfg.batch, context, steps, chunk, cfg.lean_runtime)
    else:
        if cfg.lean_runtime:
            raise ValueError("memory.lean_runtime is measured in a fresh CPU process (measure_in: subprocess)")
        ids = random_prompt(shape.vocab, cfg.batch, context)
        cache_bytes, peak = measure_peak(lambda: prefill_and_decode(model, ids, steps, chunk), param.device)
        peak.update(process="this process", cache_bytes=cache_bytes)
    elem = param.element_size()
    kv = getattr(model, "lowbit_kv_cache", None)
    kv_elem = kv.stored_bytes_per_element(shape.head_dim) if kv else elem
    kv_bytes = kv_cache_bytes(shape, context + steps, cfg.batch, kv_elem)
    work = prefill_workspace_bytes(shape, cfg.batch, context, chunk or context, elem, kv is not None)
    out = {**peak, "batch": cfg.batch, "context": context, "decode_tokens": steps, "prefill_chunk": chunk,
           "dtype": str(param.dtype).removeprefix("torch."), "predicted_kv_cache": kv_bytes,
           "predicted_kv_plus_activations": kv_bytes + work}
    if "model_resident_bytes" in peak:  # the whole footprint: the loaded model, then the prefill's rise
        out["measured_total_bytes"] = peak["model_resident_bytes"] + peak["increase_bytes"]
    return out
