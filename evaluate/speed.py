"""Decode speed: prefill tokens/s, time to first token, time per output token, decode tokens/s,
and achieved bandwidth beside the roofline bound (bandwidth measured in the same run).

Greedy decoding from seeded random prompts (content does not change the work done), in the decode
mode SpeedConfig.decode asks for: the model's own growing cache (eager), a preallocated one (static)
or that with a compiled step (evaluate/static_decode.py); each row says which ran, and why not the
one asked for where it fell back. `warmup` discarded runs, then medians over `repeats` timed runs.
"""
from __future__ import annotations

import statistics
import time
from collections import Counter

import torch

from lowbit.calibrate.cached_forward import cached_forward
from lowbit.calibrate.experts import ExpertLinears
from lowbit.calibrate.hardware import cpu_info
from lowbit.quantize.runtime.backends import prepare

from .config import SpeedConfig
from .logits import logits_to_keep
from .memory import ModelShape, kv_cache_bytes, packed_tensor_bytes
from .static_decode import StaticDecoder, prepared_decoder
from .static_decode import sync as _sync


@torch.inference_mode()
def timed_generation(model, prompts: torch.Tensor, new_tokens: int, decoder: StaticDecoder | None = None) -> dict:
    """One greedy generation; seconds for the prefill (incl. first token) and each later step, and
    the tokens (batch, new_tokens). With a prepared `decoder` (static_decode.prepared_decoder) it
    runs there; else eagerly: the prefill makes the model's own cache (a quantized one where
    attached) and the steps extend it."""
    if decoder is not None:
        if decoder.new_tokens != new_tokens:
            raise ValueError(f"the decoder was prepared for {decoder.new_tokens} new tokens, asked for {new_tokens}")
        return decoder.generate(prompts)
    device = next(model.parameters()).device
    extra = logits_to_keep(model, 1)
    prompts = prompts.to(device)
    _sync(device)
    start = time.perf_counter()
    out, cache = cached_forward(model, prompts, None, **extra)
    token = out.logits[:, -1:].argmax(-1)
    _sync(device)
    prefill = time.perf_counter() - start
    tokens, steps = [token], []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        out, cache = cached_forward(model, token, cache, **extra)
        token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        steps.append(time.perf_counter() - start)
        tokens.append(token)
    return {"prefill_s": prefill, "step_s": steps, "tokens": torch.cat(tokens, dim=1)}


def measure_bandwidth(device: torch.device, size_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: median time to sum a buffer far larger than the caches."""
    x = torch.ones(size_bytes // 4, device=device)
    x.sum()  # warm-up: page the buffer in
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        x.sum()
        _sync(device)
        times.append(time.perf_counter() - start)
    return size_bytes / statistics.median(times)


def decode_step_bytes(model, batch: int, context: int) -> int:
    """Bytes one decode step must read: every weight (codes at their bit width, scales, floats;
    the input embedding only when tied to the output, since a lookup reads one row; of a mixture's
    routed experts only those the batch's tokens pick) plus the KV cache so far. Independent of the
    kernel that runs: the roofline of any of them."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is emb.weight
    weights = packed_tensor_bytes(model, exclude=() if tied else (emb.weight,)) - idle_expert_bytes(model, batch)
    kv_elem = next(model.parameters()).element_size()
    return weights + kv_cache_bytes(ModelShape.from_config(model.config), context, batch, kv_elem)


def idle_expert_bytes(model, batch: int) -> int:
    """Expected bytes of the routed experts no token of a decode step picks: with top-k of E experts
    per token, and tokens routed independently and evenly, an expert is read with probability
    1 - (1 - k/E)^batch (k/E at batch 1: 8 of 128 experts for Qwen3-30B-A3B)."""
    top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    idle = 0.0
    for module in model.modules():
        if isinstance(module, ExpertLinears) and top_k:
            read = 1 - (1 - min(top_k, len(module)) / len(module)) ** batch
            idle += (1 - read) * packed_tensor_bytes(module)
    return int(idle)


def speed_at_batch(model, cfg: SpeedConfig, batch: int, bandwidth: float, seed: int = 0) -> dict:
    vocab = model.config.get_text_config().vocab_size
    prompts = torch.randint(0, vocab, (batch, cfg.prompt_len), generator=torch.Generator().manual_seed(seed))
    # a static/compiled decoder is prepared here, untimed (cache allocated, step compiled); None: eager
    decoder, decode = prepared_decoder(model, cfg.decode, prompts, cfg.new_tokens)
    runs = [timed_generation(model, prompts, cfg.new_tokens, decoder) for _ in range(cfg.warmup + cfg.repeats)]
    runs = runs[cfg.warmup:]
    prefill = statistics.median(r["prefill_s"] for r in runs)
    tpot = statistics.median(statistics.median(r["step_s"]) for r in runs)
    step_bytes = decode_step_bytes(model, batch, cfg.prompt_len + cfg.new_tokens // 2)
    return {
        "batch": batch,
        "prefill_tok_s": batch * cfg.prompt_len / prefill,
        "ttft_s": prefill,
        "tpot_s": tpot,
        "decode_tok_s": batch / tpot,
        "bytes_per_step": step_bytes,
        "achieved_gbs": step_bytes / tpot / 1e9,
        "roofline_tpot_s": step_bytes / bandwidth,
        "roofline_decode_tok_s": batch * bandwidth / step_bytes,
        **decode,  # "decode": the mode that ran; "decode_fallback": why not cfg.decode's, where it fell back
    }


def compare_speed(models: dict, cfg: SpeedConfig) -> dict:
    """Speed of each named model ({"quantized": m, "baseline": m0}) in this process, same inputs."""
    device = next(next(iter(models.values())).parameters()).device
    bandwidth = measure_bandwidth(device)
    out = {"device": str(device), "threads": torch.get_num_threads(), "bandwidth_gbs": bandwidth / 1e9,
           "prompt_len": cfg.prompt_len, "new_tokens": cfg.new_tokens, "warmup": cfg.warmup,
           "repeats": cfg.repeats}
    if device.type == "cpu":  # the kernel variant auto picks, and whether it was forced
        out["cpu"] = cpu_info().describe()
    for name, model in models.items():
        kernels = prepare(model, cfg.backend)  # after any move: kernels pack for the device
        try:
            out[name] = {str(b): speed_at_batch(model, cfg, b, bandwidth) for b in cfg.batch_sizes}
        finally:
            prepare(model, "reference")
        if kernels:  # which matmul each quantized linear ran, counted
            out.setdefault("backends", {})[name] = dict(Counter(kernels.values()))
    return out


def speed_on_devices(models: dict, cfg: SpeedConfig) -> dict:
    """Figures where the models are (evaluate.device). Models on the CPU with a GPU present
    (evaluate.device: cpu) are measured on it too, under "cuda" (moved there and back), or
    why that failed."""
    out = compare_speed(models, cfg)
    if not torch.cuda.is_available() or out["device"].startswith("cuda"):
        return out
    home = {name: next(m.parameters()).device for name, m in models.items()}
    try:
        out["cuda"] = compare_speed({name: m.to("cuda") for name, m in models.items()}, cfg)
    except (RuntimeError, NotImplementedError) as err:  # e.g. out of memory, a CPU-only kernel
        out["cuda"] = {"unavailable": f"{type(err).__name__}: {err}"}
    finally:
        for name, m in models.items():
            m.to(home[name])
        torch._dynamo.reset()  # compiled decode steps of the CUDA runs, and their CUDA graphs' memory pool
        torch.cuda.empty_cache()
    return out
