"""bitsandbytes baselines (NF4, LLM.int8) through transformers' BitsAndBytesConfig: load-time
quantization of the same model, measured with the same protocol as lowbit's own schemes.

When bitsandbytes cannot load or run here, the result says so ("unavailable": reason) rather
than leaving the row out silently.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lowbit.calibrate.models import resolve_model_path

from .baseline import cached_baseline
from .config import EvaluateConfig, KLConfig, PerplexityProtocol
from .perplexity import perplexity

MODES = ("nf4", "llm_int8")


def bnb_config(mode: str):
    from transformers import BitsAndBytesConfig

    if mode == "nf4":  # float32 compute: lowbit evaluates every model in float32 on CPU
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_compute_dtype=torch.float32)
    if mode == "llm_int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"evaluate.bnb_baselines: unknown mode {mode!r}; valid: {list(MODES)}")


def load_bnb(model_name: str, mode: str, device: str = "cpu", trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(model_name), quantization_config=bnb_config(mode), dtype=torch.float32,
        device_map=device, use_safetensors=True, trust_remote_code=trust_remote_code)
    return model.eval()


def bnb_weight_bytes(model) -> int:
    """Bytes of the weights as a deployment holds them: packed bnb codes plus their quantization
    state (absmax, codebook, int8 row scales), other float parameters at 16 bits."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        kind = type(p).__name__
        if kind in ("Params4bit", "Int8Params"):
            total += p.numel() * p.element_size() + _state_bytes(p)
        else:
            total += p.numel() * (2 if p.is_floating_point() else p.element_size())
    return total


def _state_bytes(param) -> int:
    tensors = []
    state = getattr(param, "quant_state", None)
    while state is not None:  # 4-bit: absmax and codebook, nested once for double quantization
        tensors += [getattr(state, "absmax", None), getattr(state, "code", None)]
        state = getattr(state, "state2", None)
    tensors.append(getattr(param, "SCB", None))  # LLM.int8 row scales
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class _BnbKey:
    """What a cached bnb quality figure depends on."""
    mode: str
    perplexity: PerplexityProtocol
    kl: KLConfig


def bnb_quality(model_name: str, mode: str, model, tokenizer, cfg: EvaluateConfig, reference) -> dict:
    """Perplexity (and KL vs the reference when enabled), cached per model, mode and protocol."""
    from .kl import kl_divergence

    def measure():
        out = {"perplexity": perplexity(model, tokenizer, cfg.perplexity)["perplexity"]}
        if cfg.kl.enabled and reference.available:
            out["kl"] = kl_divergence(reference.get(), model, tokenizer, cfg.perplexity, cfg.kl)
        return out

    key = _BnbKey(mode, cfg.perplexity, dataclasses.replace(cfg.kl, enabled=cfg.kl.enabled and reference.available))
    return cached_baseline(model_name, key, measure)  # the key holds the mode
