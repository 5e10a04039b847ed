"""What `lowbit fit` checks before it measures anything (measuring takes minutes on a small model,
hours on a large one): the KV formats that apply to the model, and a budget that holds the
cheapest plan lowbit could make, every decoder-layer linear at its smallest candidate format
(with a memory budget: beside the smallest KV cache, at the smallest prefill chunk). A budget
below it is refused in one line that says both in bits per weight. Also how one KV format splits a
memory budget (the sizes it is written in: recipes/fit_config.py).
"""
from __future__ import annotations

import sys

from transformers.cache_utils import get_layer_types_and_kwargs

from lowbit.evaluate import sensitivity
from lowbit.evaluate.memory import ModelShape, kv_cache_bytes, prefill_workspace_bytes
from lowbit.quantize.grids.gguf_plan import F16

MIB = 2**20


def kv_kinds(model, cfg) -> list[str]:
    """The KV formats to weigh. The quantized cache stores full-attention layers only, so a model
    with sliding-window (or other) layers keeps a 16-bit cache unless kv_formats asked otherwise
    (then the measurement says why it cannot); a format that cannot hold the model's heads (int4's
    groups must divide head_dim) is left out with a note, and none left is an error."""
    kinds = sorted(cfg.kv_candidates)
    text_config = model.config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    if not cfg.kv_formats and set(layer_types) - {"full_attention"} and kinds != [F16]:
        print(f"[lowbit] fit: {model.config.model_type} has {sorted(set(layer_types) - {'full_attention'})} layers, "
              "which the quantized KV cache does not store: the KV cache stays 16-bit", file=sys.stderr)
        return [F16]
    head_dim = ModelShape.from_config(model.config).head_dim
    unfit = [k for k in kinds if k != F16 and not sensitivity.kv_format(k).fits(head_dim)]
    for kind in unfit:
        print(f"[lowbit] fit: KV format {kind} left out: its groups of {sensitivity.kv_format(kind).group_size} "
              f"do not divide the model's head_dim {head_dim}", file=sys.stderr)
    usable = [k for k in kinds if k not in unfit]
    if not usable:
        raise ValueError(f"kv_formats {', '.join(kinds)}: none can hold this model's heads (head_dim {head_dim}); "
                         f"add int8, fp8 or f16")
    return usable


def check_bits_budget(bits: float, options: dict[str, dict[str, int]], params: int) -> None:
    """Refuse a bits-per-weight budget below every linear at its smallest candidate format."""
    floor = sum(min(kinds.values()) for kinds in options.values())
    if int(bits * params / 8) < floor:  # what allocate() is given
        raise ValueError(f"budget {bits:g} bits per weight is below the cheapest plan lowbit can make for this "
                         f"model, {floor * 8 / params:.3f} bits per weight (every decoder-layer linear at its "
                         f"smallest candidate: {_smallest_kinds(options)}); raise the budget or add smaller "
                         "candidate types")


def check_memory_budget(model, cfg, options: dict[str, dict[str, int]], params: int, kinds: list[str],
                        split: dict) -> None:
    """Refuse a memory budget that cannot hold the smallest KV cache, the workspace at the smallest
    prefill chunk and the linears' cheapest plan (`split`: the budget's fixed parts, as _fit_memory
    counts them)."""
    floor = sum(min(k.values()) for k in options.values())
    shape = ModelShape.from_config(model.config)
    entries = [kv_entry(shape, cfg, split, kind, sensitivity.kv_bytes_per_element(model, kind)) for kind in kinds]
    if max(e["linears_budget"] for e in entries) >= floor:
        return
    smallest_kv = min(entries, key=lambda e: e["kv_cache_bytes"])
    left = smallest_kv["linears_budget"]
    raise ValueError(
        f"memory {cfg.memory}: nothing fits. The workspace ({smallest_kv['workspace'] / MIB:.1f} MiB in prefill chunks "
        f"of {split['prefill_chunk']}), the runtime's overhead ({split['overhead'] / MIB:.1f} MiB), the weights "
        f"outside the linears ({split['other_weights'] / MIB:.1f} MiB) and the smallest KV cache "
        f"({smallest_kv['kv_format']}, {smallest_kv['kv_cache_bytes'] / MIB:.1f} MiB at {cfg.batch} x {cfg.context} "
        f"tokens) leave {left / MIB:.1f} MiB, {left * 8 / params:.3f} bits per weight for the decoder-layer "
        f"linears; the cheapest plan needs {floor * 8 / params:.3f} bits per weight "
        f"({floor / MIB:.1f} MiB, {_smallest_kinds(options)}); lower context or batch, or add smaller candidates")


def kv_entry(shape: ModelShape, cfg, split: dict, kind: str, per_element: float) -> dict:
    """What KV format `kind` leaves the linears of a memory budget: its cache, the workspace beside
    it (a quantized cache hands its history back dequantized: more than a 16-bit one) and the rest."""
    kv = kv_cache_bytes(shape, cfg.context, cfg.batch, per_element)
    work = prefill_workspace_bytes(shape, cfg.batch, cfg.context, split["prefill_chunk"], 4, quantized_kv=kind != F16)
    left = split["memory"] - work - split["overhead"] - split["other_weights"] - kv
    return {"kv_format": kind, "kv_cache_bytes": kv, "workspace": work, "linears_budget": left}


def _smallest_kinds(options: dict[str, dict[str, int]]) -> str:
    return ", ".join(sorted({min(kinds, key=kinds.get) for kinds in options.values()}))
