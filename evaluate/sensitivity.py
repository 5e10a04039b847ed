"""How much each linear's quantization costs the model, measured: KL of the output distribution.

For every decoder-layer linear and every candidate GGML type (or f16, which costs nothing), the
linear alone is rounded to that type (llama.cpp's reference rounding), the model runs on the
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

from .kl import token_kl

CANDIDATES = ("q4_0", "q4_k", "q5_0", "q6_k", "q8_0", F16)  # Q4_1 left out: see fit_candidates


def type_bytes(kind: str, rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) weight stored as GGML type `kind` (f16: 2 per weight)."""
    if kind == F16:
        return rows * cols * 2
    layout = LAYOUTS[kind]
    return rows * (cols // layout.block) * layout.type_size


@dataclass(frozen=True)
class Option:
    kind: str  # a GGML type, or f16
    bytes: int
    loss: float  # mean per-token KL in nats (0 for f16)


def linear_options(model: nn.Module, arch: Arch, kinds=CANDIDATES) -> dict[str, dict[str, int]]:
    """Per decoder-layer linear, the types it can take (after llama.cpp's fallbacks for rows a
    block does not divide, duplicates merged) and their bytes."""
    out = {}
    for name, module in target_linears(model, arch).items():
        rows, cols = linear_weight(module).shape
        kinds_here = {F16 if k == F16 else fallback_type(k, cols) for k in kinds}
        out[name] = {k: type_bytes(k, rows, cols) for k in sorted(kinds_here - {None})}
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
            weight.copy_(quantize_gguf(original, GGUFScheme(kind), name).dequantize().to(weight.dtype))
            losses[name][kind] = _tail_kl(model, layers, index, layer_inputs[index], chunks, reference)
            progress.step(f"{name} {kind} {losses[name][kind]:.2e}")
        weight.copy_(original)
    return losses


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
