"""The per-layer KV-cache model against the every-layer-every-token formula, and a measured peak.

    python bench/memory_model.py                     # KV predictions at --context for known layouts
    python bench/memory_model.py --measure smollm2-135m --batch 4 --measure-context 2048 [--json]

Predictions use configs built in-process with the published models' sizes (no hub): Mistral-7B
v0.1 (4096-token window on all 32 layers), Gemma 2 9B-like (alternating 4096 window / full),
Gemma 3 1B-like (five 512-window layers per full one), DeepSeek-V3 (MLA latent), and a Llama 3
8B-like reference without windows. --measure loads MODEL in a fresh process (as evaluation does
on CPU) and prints the measured increase of one prefill + decoded tokens beside the prediction.
"""
from __future__ import annotations

import argparse
import json

import transformers as T

from lowbit.evaluate.memory import ModelShape, kv_cache_bytes

GIB, MIB = 2**30, 2**20
LLAMA_8B = dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=32000)
CONFIGS = {
    "mistral-7b-v0.1": lambda: T.MistralConfig(**LLAMA_8B, sliding_window=4096),
    "gemma2-9b-like": lambda: T.Gemma2Config(num_hidden_layers=42, num_key_value_heads=8, head_dim=256,
                                             sliding_window=4096),
    "gemma3-1b-like": lambda: T.Gemma3TextConfig(num_hidden_layers=26, num_key_value_heads=1, head_dim=256,
                                                 sliding_window=512),
    "deepseek-v3": lambda: T.DeepseekV3Config(),
    "llama3-8b-like": lambda: T.LlamaConfig(**LLAMA_8B),
}


def kv_predictions(context: int, kv_bytes: float) -> list[dict]:
    rows = []
    for name, make in CONFIGS.items():
        shape = ModelShape.from_config(make())
        every_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * kv_bytes * context  # the old formula
        per_layer = kv_cache_bytes(shape, context, 1, kv_bytes)
        rows.append({"model": name, "context": context, "kv_old_gib": every_token / GIB,
                     "kv_per_layer_gib": per_layer / GIB, "ratio": every_token / per_layer})
    return rows


def measured(model_name: str, batch: int, context: int, decode_tokens: int) -> dict:
    from lowbit.evaluate.config import MemoryConfig
    from lowbit.evaluate.loading import load_target
    from lowbit.evaluate.peak_probe import Loadable
    from lowbit.evaluate.suite import measured_prefill_peak

    model, _, _ = load_target(model_name, False, False)
    cfg = MemoryConfig(batch=batch, context=context, measure_context=context, measure_decode_tokens=decode_tokens)
    peak = measured_prefill_peak(model, ModelShape.from_config(model.config), cfg, Loadable(model_name))
    keys = ("model_resident_bytes", "model_tensor_bytes", "cache_bytes", "predicted_kv_cache", "increase_bytes",
            "predicted_kv_plus_activations")
    return {"model": model_name, "batch": batch, "context": context, "decode_tokens": decode_tokens,
            "dtype": peak["dtype"], **{k.replace("_bytes", "_mib"): peak[k] / MIB for k in keys},
            "measured_over_predicted": peak["increase_bytes"] / peak["predicted_kv_plus_activations"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--kv-bytes", type=float, default=2.0)
    parser.add_argument("--measure", metavar="MODEL")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--measure-context", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    rows = kv_predictions(a.context, a.kv_bytes)
    if a.measure:
        rows.append(measured(a.measure, a.batch, a.measure_context, a.decode_tokens))
    for row in rows:
        print(json.dumps(row) if a.json else "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                      for k, v in row.items()))


if __name__ == "__main__":
    main()
