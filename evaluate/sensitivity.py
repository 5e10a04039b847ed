"""How much each linear's quantization costs the model, measured: KL of the output distribution.

For every decoder-layer linear and every candidate format (a GGML type, an integer format such
as int4_g64, or f16, which costs nothing), the linear alone is rounded to that format (llama.cpp's
reference rounding, or round-to-nearest on the integer grid), the model runs on the
calibration tokens and the mean per-token KL(float || this), summed in float64 (float32 alone
leaves ~1e-7 nats of rounding, as much as a Q8_0 linear costs), is its loss. Only the layers from
the linear's own onward run: the float inputs of every decoder layer are recorded once, earlier
layers pass their input through, and the linear's layer starts from its recorded input.

Cost: one forward of the float model, then per (linear, type) a forward of the layers from the
linear's onward (half the model on average) plus the output head, on `tokens` tokens. Memory:
the model, the inputs of every layer (layers x tokens x hidden float32) and the float logits
(tokens x vocab float32): for a 7B Llama on 1024 tokens 0.5 + 0.13 GB beside the weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from lowbit.calibrate.arch import Arch, decoder_layers, linear_weight, target_linears
from lowbit.calibrate.progress import Progress
from lowbit.calibrate.walker import pass_through
from lowbit.quantize.grids.gguf import LAYOUTS, GGUFScheme, fallback_type, quantize_gguf
from lowbit.quantize.grids.gguf_plan import F16
from lowbit.quantize.grids.formats import fits_columns, format_bytes, grid_named
from lowbit.quantize.grids.kv import KVCacheConfig
from lowbit.quantize.runtime import kv_cache

from .kl import token_kl

CANDIDATES = ("q4_0", "q4_k", "q5_0", "q6_k", "q8_0", F16)  # Q4_1 left out: see fit_candidates
# compressed-tensors: group 64 and 128 (128 only where it divides the rows), 3, 4 and 8 bits
INT_CANDIDATES = ("int3_g64", "int4_g64", "int4_g128", "int8", F16)
# KV cache formats, scaled per token and head (no calibration to measure them): bytes from a cache
KV_CANDIDATES = ("int4", "int8", "fp8", F16)


def is_ggml_type(kind: str) -> bool:
    return kind in LAYOUTS


def type_bytes(kind: str, rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) weight stored as GGML type or named format `kind` (f16: 2 per weight)."""
    if not is_ggml_type(kind):
        return format_bytes(kind, rows, cols)
    layout = LAYOUTS[kind]
    return rows * (cols // layout.block) * layout.type_size


def rounded(kind: str, weight: torch.Tensor, name: str) -> torch.Tensor:
    """The weight as format `kind` holds it (llama.cpp's reference rounding, or the named grid's
    round-to-nearest), dequantized."""
    if is_ggml_type(kind):
        return quantize_gguf(weight, GGUFScheme(kind), name).dequantize()
    return grid_named(kind).fake_round(weight, name)


@dataclass(frozen=True)
class Option:
    kind: str  # a GGML type, or f16
    bytes: int
    loss: float  # mean per-token KL in nats (0 for f16)


def linear_options(model: nn.Module, arch: Arch, kinds=CANDIDATES) -> dict[str, dict[str, int]]:
    """Per decoder-layer linear, the formats it can take and their bytes: GGML types after
    llama.cpp's fallbacks for rows a block does not divide (duplicates merged); integer formats
    whose group divides the rows."""
    out = {}
    for name, module in target_linears(model, arch).items():
        rows, cols = linear_weight(module).shape
        kinds_here = {fallback_type(k, cols) if is_ggml_type(k) else k for k in kinds}
        kinds_here = {k for k in kinds_here if k is not None and (is_ggml_type(k) or fits_columns(k, cols))}
        out[name] = {k: type_bytes(k, rows, cols) for k in sorted(kinds_here)}
    return out


@torch.no_grad()
def measure(model: nn.Module, arch: Arch, batches: torch.Tensor, options: dict[str, dict[str, int]],
            micro_batch: int = 4, on_progress: Optional[Callable[[str], None]] = None) -> dict[str, dict[str, float]]:
    """Per linear and type, the mean per-token KL when that linear alone is rounded to the type."""
    layers = decoder_layers(model, arch)
    prefix = arch.layers + "."
    chunks = list(batches.to(model.get_input_embeddings().weight.device).split(micro_batch))
    layer_inputs = _record_layer_inputs(model, layers, chunks)
    reference = [model(input_ids=ids, use_cache=False).logits.float() for ids in chunks]
    measured = sum(len([k for k in kinds if k != F16]) for kinds in options.values())
    progress = Progress("sensitivity", measured, "roundings")
    losses: dict[str, dict[str, float]] = {}
    for name, kinds in options.items():
        index = int(name[len(prefix):].split(".")[0])
        module = model.get_submodule(name)
        weight = linear_weight(module)
        original = weight.detach().clone()
        losses[name] = {F16: 0.0} if F16 in kinds else {}
        for kind in (k for k in kinds if k != F16):
            weight.copy_(rounded(kind, original, name).to(weight.dtype))
            losses[name][kind] = _tail_kl(model, layers, index, layer_inputs[index], chunks, reference)
            progress.step(f"{name} {kind} {losses[name][kind]:.2e}")
        weight.copy_(original)
    return losses


@torch.no_grad()
def measure_kv(model: nn.Module, batches: torch.Tensor, kinds=KV_CANDIDATES, micro_batch: int = 4) -> dict[str, float]:
    """Per KV format, the mean per-token KL when the cache alone holds that format (attention reads
    every token's K/V back from the quantized store, as decoding does); f16 costs nothing."""
    chunks = list(batches.to(model.get_input_embeddings().weight.device).split(micro_batch))
    reference = [model(input_ids=ids, use_cache=False).logits.float() for ids in chunks]
    losses = {F16: 0.0} if F16 in kinds else {}
    for kind in (k for k in kinds if k != F16):
        kv_cache.attach(model, kv_format(kind))
        try:
            total, count = 0.0, 0
            for ids, ref in zip(chunks, reference):
                kl = token_kl(ref, model(input_ids=ids, use_cache=True).logits, torch.float64)
                total, count = total + float(kl.double().sum()), count + kl.numel()
        finally:
            kv_cache.detach(model)
        losses[kind] = total / count
    return losses


def kv_format(kind: str) -> KVCacheConfig:
    """A KV candidate as the kv_cache step's config: scales per token and head (int4: groups of 32)."""
    return KVCacheConfig(format=kind, strategy="token")


@torch.no_grad()
def kv_bytes_per_element(model: nn.Module, kind: str, tokens: int = 16) -> float:
    """Bytes per cached K/V element in format `kind`, scales included, weighed from a real cache
    after a short prefill (f16: 2)."""
    if kind == F16:
        return 2.0
    from .kv_cache import measure_kv_cache

    kv_cache.attach(model, kv_format(kind))
    try:
        ids = torch.arange(3, 3 + tokens).unsqueeze(0)
        figures = measure_kv_cache(model, ids, decode_steps=0)
    finally:
        kv_cache.detach(model)
    return 2.0 * figures["ratio_to_16bit"]


def _record_layer_inputs(model, layers, chunks) -> list[list[torch.Tensor]]:
    """The hidden states entering every decoder layer, per micro-batch, in the float model."""
    seen: list[list[torch.Tensor]] = [[] for _ in layers]

    def recorder(index):
        def hook(module, args, kwargs):
            seen[index].append((args[0] if args else kwargs["hidden_states"]).detach().clone())
        return hook

    handles = [layer.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for ids in chunks:
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _tail_kl(model, layers, index: int, inputs: list[torch.Tensor], chunks, reference) -> float:
    """Mean KL over all tokens, running layers index.. from their recorded float inputs (the
    layers before pass their input through; the model adds its masks, rotary and head)."""
    current = {"hidden": None}

    def start_here(module, args, kwargs):
        if args:
            return (current["hidden"], *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": current["hidden"]}

    skipped = layers[:index]
    for layer in skipped:
        layer.forward = pass_through
    handle = layers[index].register_forward_pre_hook(start_here, with_kwargs=True)
    try:
        total, count = 0.0, 0
        for ids, hidden, ref in zip(chunks, inputs, reference):
            current["hidden"] = hidden
            logits = model(input_ids=ids, use_cache=False).logits
            kl = token_kl(ref, logits, torch.float64)
            total, count = total + float(kl.double().sum()), count + kl.numel()
        return total / count
    finally:
        handle.remove()
        for layer in skipped:
            del layer.forward
