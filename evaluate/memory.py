"""Memory: weight bytes (exact, from the tensors), the predicted footprint for a batch and
context (weights + KV cache + activations), a fit table per budget, and the measured peak."""
from __future__ import annotations

import ctypes
import gc
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from lowbit.export.formats.registry import checkpoint_weight_bytes as format_weight_bytes
from lowbit.quantize.runtime.qlinear import QuantLinear

from .kv_layout import LayerKV, first_attr, kv_layers


def model_weight_bytes(model: nn.Module, bytes_per_param: float | None = None) -> int:
    """Bytes of the model's unique parameters, at their dtype or at bytes_per_param."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += int(p.numel() * (bytes_per_param or p.element_size()))
    return total


def resident_tensor_bytes(model: nn.Module, exclude: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of every unique parameter and buffer as held in memory now (quantized codes,
    scales, float weights), minus the tensors in `exclude`."""
    seen = {t.data_ptr() for t in exclude}
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def packed_tensor_bytes(model: nn.Module, exclude: tuple[torch.Tensor, ...] = ()) -> int:
    """resident_tensor_bytes with quantized codes at their bit width (bits/8 bytes per weight,
    as the kernels and checkpoints pack them) instead of the int8 storage QuantLinear keeps: the
    bytes a decode step must read, the same whichever kernel (or the reference path) runs."""
    total = resident_tensor_bytes(model, exclude)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            codes = m.weight_codes
            total -= codes.numel() * codes.element_size() - math.ceil(codes.numel() * m.scheme.bits / 8)
    return total


def checkpoint_weight_bytes(folder: str | Path) -> int:
    """Bytes of a checkpoint's weight tensors (codes, scales, float weights), as its format counts them."""
    return format_weight_bytes(folder)


# --- predicted footprint: weights + KV cache + activation workspace -------------------------

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """The sizes the memory formulas need, read from a transformers config."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    kv: tuple[LayerKV, ...] = ()  # per layer, what it caches; () = every layer K and V of every token

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden = first_attr(c, "hidden_size", "n_embd", "d_model")
        heads = first_attr(c, "num_attention_heads", "n_head")
        intermediate = first_attr(c, "intermediate_size", "ffn_dim", "n_inner", default=None) or 4 * hidden
        kv_heads = first_attr(c, "num_key_value_heads", default=None) or heads
        head_dim = getattr(c, "head_dim", None) or hidden // heads
        return cls(first_attr(c, "num_hidden_layers", "n_layer"), hidden, intermediate, heads, kv_heads,
                   head_dim, c.vocab_size, kv_layers(config))


def kv_bytes_per_layer(shape: ModelShape, tokens: int, kv_bytes: float) -> list[float]:
    """Bytes each layer caches for one sequence of `tokens` tokens: its elements per token times
    the tokens it keeps (all, or its sliding window; none where it reuses another layer's)."""
    layers = shape.kv or (LayerKV(2 * shape.kv_heads * shape.head_dim),) * shape.layers
    return [layer.elements_per_token * layer.cached_tokens(tokens) * kv_bytes for layer in layers]


def kv_cache_bytes(shape: ModelShape, tokens: int, batch: int, kv_bytes: float) -> int:
    """The KV cache of `batch` sequences of `tokens` tokens, summed over layers."""
    return int(sum(kv_bytes_per_layer(shape, tokens, kv_bytes)) * batch)


def activation_bytes(shape: ModelShape, batch: int, context: int, act_bytes: float) -> int:
    """Transient workspace of one prefill of batch x context (an estimate, not a measurement).

    Assumes fused attention (no context x context score matrix, as SDPA/flash kernels do) and
    logits for the last position only (as generation asks). The widest point per token is the
    MLP (residual, normed input, gate, up, their product) or attention (residual, normed
    input, q, k, v, output), whichever is wider; logits are float32.
    """
    mlp = 2 * shape.hidden + 3 * shape.intermediate
    attn = 2 * shape.hidden + 2 * shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim
    return int(batch * context * max(mlp, attn) * act_bytes + batch * shape.vocab * 4)


def prefill_workspace_bytes(shape: ModelShape, batch: int, context: int, chunk: int, act_bytes: float,
                            quantized_kv: bool = True) -> int:
    """Workspace of a prefill fed `chunk` tokens per forward (chunked prefill), as the CPU
    runtime allocates it (each term seen in torch's profiler on smollm2-135m): one chunk's widest
    activations (activation_bytes); the chunk's attention mask over the context, boolean plus the
    float copy SDPA makes; with a quantized cache, one layer's K and V handed back dequantized over
    the whole context, and as much again in the dequantization's temporaries; a block of the
    output head's rows widened (quantize/runtime/compact.py)."""
    from lowbit.quantize.runtime.compact import HEAD_ROWS

    tokens = min(chunk, context)
    mask = batch * tokens * context * 5 if context > tokens else 0
    history = 2 * batch * context * 2 * shape.kv_heads * shape.head_dim * act_bytes if quantized_kv else 0
    head = min(HEAD_ROWS, shape.vocab) * shape.hidden * act_bytes
    return int(activation_bytes(shape, batch, tokens, act_bytes) + mask + history + head)


def predicted_total(weight_bytes: int, shape: ModelShape, batch: int, context: int,
                    kv_bytes: float, act_bytes: float) -> dict:
    kv = kv_cache_bytes(shape, context, batch, kv_bytes)
    act = activation_bytes(shape, batch, context, act_bytes)
    return {"batch": batch, "context": context, "weights": weight_bytes, "kv_cache": kv,
            "activations": act, "total": weight_bytes + kv + act,
            "kv_bytes_per_element": kv_bytes, "act_bytes_per_element": act_bytes}


def fit_table(weight_bytes: int, shape: ModelShape, budgets_gib, fit_context: int,
              kv_bytes: float, act_bytes: float) -> list[dict]:
    """Per budget: longest context of one sequence, and most sequences of fit_context tokens."""
    def total(batch, context):
        return predicted_total(weight_bytes, shape, batch, context, kv_bytes, act_bytes)["total"]

    rows = []
    for gib in budgets_gib:
        budget = gib * GIB
        rows.append({"budget_gib": gib,
                     "max_context": _largest(lambda t: total(1, t) <= budget),
                     "max_sequences": _largest(lambda b: total(b, fit_context) <= budget),
                     "at_context": fit_context})
    return rows


def _largest(fits, limit: int = 2**40) -> int:
    """Largest n >= 1 with fits(n) (fits is monotone), 0 if even 1 does not fit."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --- measured peak -----------------------------------------------------------------------------

def measure_peak(fn: Callable[[], object], device: torch.device) -> tuple[object, dict]:
    """Run fn; return its result and the peak memory while it ran.

    GPU: torch.cuda.max_memory_allocated. CPU: the process's resident-set high-water mark
    (VmHWM), reset before the call through /proc/self/clear_refs where Linux allows it, else
    psutil RSS sampled every millisecond.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return result, {"method": "torch.cuda.max_memory_allocated", "before_bytes": before,
                        "peak_bytes": peak, "increase_bytes": peak - before}
    # garbage left by earlier work, collected while fn runs, would lower RSS under the baseline
    # and hide fn's own allocations (seen: a 256 MiB tensor measured as a 0-byte increase)
    gc.collect()
    _return_free_heap_to_os()
    if _reset_rss_peak():
        before = proc_status_bytes("VmRSS")
        result = fn()
        peak = proc_status_bytes("VmHWM")
        method = "VmHWM (reset via /proc/self/clear_refs)"
    else:
        result, before, peak = _sampled_rss(fn)
        method = "psutil RSS sampled every 1 ms"
    return result, {"method": method, "before_bytes": before, "peak_bytes": peak,
                    "increase_bytes": max(peak - before, 0)}


def _return_free_heap_to_os() -> None:
    """glibc keeps freed heap pages resident and hands them out again, so fn's allocations would
    not raise RSS; malloc_trim(0) gives them back first (a no-op elsewhere: no glibc)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc (macOS, musl): nothing to trim


def _reset_rss_peak() -> bool:
    path = Path("/proc/self/clear_refs")
    if not path.exists():
        return False
    try:
        path.write_text("5")  # "5" resets the peak RSS (VmHWM) of this process
    except OSError:
        return False  # not writable in this container: fall back to sampling
    return True


def proc_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise ValueError(f"/proc/self/status has no {field} line")


def _sampled_rss(fn):
    import psutil

    proc, peak, done = psutil.Process(), [0], threading.Event()
    before = proc.memory_info().rss

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = fn()
    finally:
        done.set()
        thread.join()
    return result, before, max(peak[0], proc.memory_info().rss)
