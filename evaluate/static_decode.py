"""Greedy decoding into a preallocated KV cache, optionally with a compiled decode step, for the
speed measurement (evaluate/speed.py).

Eager decoding with transformers' growing DynamicCache (a torch.cat per layer and step) is bound
by kernel launches at batch 1 on a GPU and cannot be captured in a CUDA graph, so its figures
would not show the quantized kernels. Here the cache is transformers' StaticCache, sized
prompt + new tokens for the batch, so every decode step has the same shapes; the "compiled" mode
runs that step through torch.compile (CUDA graphs on CUDA, inductor's default on the CPU).

What cannot run this way (lowbit's quantized KV cache, a model transformers does not compile, a
graph break, a failed compile) falls back to eager decoding and says why: `prepared_decoder`
returns the decoder (None: eager) and what ran, {"decode": mode, "decode_fallback": reason}.
"""
from __future__ import annotations

import contextlib
import inspect
import time
from typing import Optional

import torch
from transformers.cache_utils import StaticCache

from lowbit.calibrate.cached_forward import cache_keyword, cached_forward

from .logits import logits_to_keep

DECODE_MODES = ("eager", "static", "compiled")
COMPILE_WARMUP_STEPS = 3  # CUDA graph trees run a new graph once, record it on the next call, then replay


def resolve_decode_mode(requested: str, device: torch.device) -> str:
    """SpeedConfig.decode -> the mode to try: auto is compiled on CUDA, eager elsewhere (on the CPU
    a compile costs more than a short measurement saves)."""
    if requested == "auto":
        return "compiled" if device.type == "cuda" else "eager"
    if requested not in DECODE_MODES:
        raise ValueError(f"decode mode must be auto or one of {', '.join(DECODE_MODES)}, got {requested!r}")
    return requested


def static_unsupported(model) -> Optional[str]:
    """Why the model cannot decode into a StaticCache, or None."""
    if getattr(model, "lowbit_kv_cache", None) is not None:
        # its pre-hook supplies a QuantizedKVCache only when no cache is passed: a StaticCache
        # would silently time float K/V instead of the quantized cache the model carries
        return "lowbit's quantized KV cache is attached (it grows per step; a static cache would bypass it)"
    try:
        cache_keyword(model)
    except ValueError as err:
        return str(err)
    return None


def compile_unsupported(model) -> Optional[str]:
    """Why the decode step should not be compiled, or None (the checks transformers' generate makes)."""
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"transformers does not compile {type(model).__name__} in one graph (_can_compile_fullgraph)"
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return f"its load-time quantization ({type(quantizer).__name__}) is not compileable"
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return "the model is spread over several devices (offloaded)"
    return None


def make_static_cache(model, max_len: int) -> StaticCache:
    """An empty StaticCache of `max_len` tokens per sequence for the model's layer types.

    transformers 5.17 and 5.25 take the same constructor, (config, max_cache_len): batch, heads,
    device and dtype are not arguments; each layer allocates its [batch, kv_heads, max_len,
    head_dim] tensors on the first update, from the K/V it is given (the model's device and
    dtype), and marks them static addresses for CUDA graphs. StaticDecoder.prepare runs that
    first update outside the timed runs, and the same cache is then reset and reused."""
    return StaticCache(config=model.config, max_cache_len=max_len)


def position_inputs(model, start: int, length: int, device: torch.device) -> dict:
    """Explicit positions of tokens start..start+length-1, so no forward derives them from the
    cache. transformers 5.17 and 5.25 models take `position_ids` only (a StaticLayer writes at its
    own on-device counter); `cache_position` goes only to a forward that declares it (as
    transformers' generate does), since others would pass it on unread through their kwargs."""
    positions = torch.arange(start, start + length, device=device)
    inputs = {"position_ids": positions.unsqueeze(0)}
    if "cache_position" in inspect.signature(model.forward).parameters:
        inputs["cache_position"] = positions
    return inputs


def step_logits(model, inputs: dict, extra: dict) -> torch.Tensor:
    """One forward's logits; what torch.compile traces (plain keywords: no signature lookups)."""
    return model(**inputs, use_cache=True, **extra).logits


_compiled_step = {}  # torch.compile mode -> compiled step_logits; dynamo keeps a graph per model and batch


def compiled_step_logits(device: torch.device):
    """step_logits compiled once per process and mode: CUDA graphs on CUDA ("reduce-overhead"),
    inductor's default elsewhere. Whole graph (a graph break raises, and the caller falls back)
    and static shapes (each batch size gets its own graph)."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    if mode not in _compiled_step:
        _compiled_step[mode] = torch.compile(step_logits, mode=mode, fullgraph=True, dynamic=False)
    return _compiled_step[mode]


def compile_settings(device: torch.device):
    """Config for the compiled calls: room for a graph per model and batch size, and a failure
    (not a silent eager run, or a compiled run without CUDA graphs) where that is not met."""
    stack = contextlib.ExitStack()
    dynamo = {"recompile_limit": 64, "fail_on_recompile_limit_hit": True}
    stack.enter_context(torch._dynamo.config.patch(**{k: v for k, v in dynamo.items()
                                                      if hasattr(torch._dynamo.config, k)}))
    if device.type == "cuda":
        import torch._inductor.config as inductor_config

        stack.enter_context(inductor_config.patch({"triton.cudagraph_or_error": True}))
    return stack


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a timer read after it then counts that work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StaticDecoder:
    """Greedy decoding of one model at one batch and length into one StaticCache, reset and
    reused by every run (a new cache would move the CUDA graphs' static addresses)."""

    def __init__(self, model, batch: int, prompt_len: int, new_tokens: int, compiled: bool):
        self.model, self.batch, self.prompt_len, self.new_tokens = model, batch, prompt_len, new_tokens
        self.device = next(model.parameters()).device
        self.compiled = compiled
        self.cache = make_static_cache(model, prompt_len + new_tokens)
        self.keyword = cache_keyword(model)
        self.extra = logits_to_keep(model, 1)  # as the eager path
        self.prefill_inputs = position_inputs(model, 0, prompt_len, self.device)
        # one small tensor per step, made once: no host-to-device copy inside a timed step
        self.step_inputs = [position_inputs(model, prompt_len + i, 1, self.device) for i in range(new_tokens - 1)]
        self.step = compiled_step_logits(self.device) if compiled else step_logits

    def settings(self):
        return compile_settings(self.device) if self.compiled else contextlib.nullcontext()

    @torch.inference_mode()
    def prepare(self, prompts: torch.Tensor) -> None:
        """Untimed runs: the cache's first update allocates it; a compiled step compiles (and, on
        CUDA, records its graph) here. Raises where the model does not run this way."""
        runs = -(-COMPILE_WARMUP_STEPS // (self.new_tokens - 1)) if self.compiled else 1
        for _ in range(runs):
            self.generate(prompts)
        filled = int(self.cache.get_seq_length())
        if filled != self.prompt_len + self.new_tokens - 1:  # the forward wrote into another cache
            raise RuntimeError(f"the static cache holds {filled} tokens after a run, expected "
                               f"{self.prompt_len + self.new_tokens - 1}")

    @torch.inference_mode()
    def generate(self, prompts: torch.Tensor) -> dict:
        """One greedy generation: seconds for the prefill (incl. first token) and each later step,
        and the tokens, (batch, new_tokens). The prefill runs eagerly (its shape is the prompt's)."""
        if tuple(prompts.shape) != (self.batch, self.prompt_len):
            raise ValueError(f"this decoder takes prompts of shape {(self.batch, self.prompt_len)}, "
                             f"got {tuple(prompts.shape)}")
        prompts = prompts.to(self.device)
        with self.settings():
            self.cache.reset()  # in place: zeroes K/V and the write position
            sync(self.device)
            start = time.perf_counter()
            out, _ = cached_forward(self.model, prompts, self.cache, **self.prefill_inputs, **self.extra)
            token = out.logits[:, -1:].argmax(-1)
            sync(self.device)
            prefill = time.perf_counter() - start
            tokens, steps = [token], []
            for inputs in self.step_inputs:
                start = time.perf_counter()
                token = self.decode_step(token, inputs)
                sync(self.device)
                steps.append(time.perf_counter() - start)
                tokens.append(token)
        return {"prefill_s": prefill, "step_s": steps, "tokens": torch.cat(tokens, dim=1)}

    def decode_step(self, token: torch.Tensor, positions: dict) -> torch.Tensor:
        if self.compiled and self.device.type == "cuda":  # a new inference step: the CUDA graph
            torch.compiler.cudagraph_mark_step_begin()   # may overwrite its last outputs (logits)
        logits = self.step(self.model, {"input_ids": token, self.keyword: self.cache, **positions}, self.extra)
        return logits[:, -1:].argmax(-1)  # outside the graph: the token is an ordinary tensor


def short_reason(err: BaseException) -> str:
    """`Type: first line` of an exception and dynamo's `Explanation:` line (what it could not
    trace), capped: dynamo's messages run to pages."""
    lines = [line.strip() for line in str(err).strip().splitlines()]
    said = lines[:1] + [line for line in lines[1:] if line.startswith("Explanation:")][:1]
    return f"{type(err).__name__}: {' '.join(said)[:400]}"


def prepared_decoder(model, requested: str, prompts: torch.Tensor, new_tokens: int):
    """(a prepared StaticDecoder, or None for eager decoding; {"decode": the mode that will run,
    "decode_fallback": why not the one asked for, where it fell back})."""
    device = next(model.parameters()).device
    mode = resolve_decode_mode(requested, device)
    if mode == "eager":
        return None, {"decode": "eager"}
    reason = static_unsupported(model) or (compile_unsupported(model) if mode == "compiled" else None)
    if reason is not None:
        return None, {"decode": "eager", "decode_fallback": f"{mode} unsupported: {reason}"}
    batch, prompt_len = prompts.shape
    try:
        decoder = StaticDecoder(model, batch, prompt_len, new_tokens, compiled=mode == "compiled")
        decoder.prepare(prompts)
    except Exception as err:  # noqa: BLE001 - a graph break, a failed compile, an unsupported layer type
        return None, {"decode": "eager", "decode_fallback": f"{mode} failed: {short_reason(err)}"}
    return decoder, {"decode": mode}
