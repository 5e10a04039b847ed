"""GGUF export of smollm2-135m, read back two ways: perplexity of the file in lowbit and in
transformers (`gguf_file=`, its own dequantizer and the tokenizer built from the file's metadata).

    python bench/gguf_export.py [--json] [--types q8_0,q4_0] [--max-tokens 16384]

Per type: the float model exported with `lowbit export --format gguf --type TYPE` (llama.cpp's
reference round to nearest; rows its block does not divide get llama.cpp's fallback; token
embedding and norms as --dtype and F32), model.gguf's size, bits per weight of the linears as
stored, and both perplexities under the project's protocol (wiki, context 512). smollm2's weights
came from a Q4_1 file, so these are round-to-nearest figures on already-rounded weights.
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from lowbit.calibrate.models import load_model, resolve_model_path
from lowbit.evaluate.config import PerplexityProtocol
from lowbit.evaluate.perplexity import perplexity
from lowbit.export import checkpoint
from lowbit.export.convert import convert


def linear_bits(path: Path) -> float:
    """Bits per weight over the 2-D block-quantized tensors of a .gguf file."""
    import gguf

    tensors = [t for t in gguf.GGUFReader(str(path)).tensors
               if t.tensor_type.name not in ("F32", "F16", "BF16") and t.name != "token_embd.weight"]
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def transformers_model(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")


def measure(source: str, gguf_type: str, dtype: str, protocol: PerplexityProtocol, tmp: Path) -> dict:
    start = time.perf_counter()
    out = convert(source, tmp / gguf_type, "gguf", dtype=dtype, gguf_type=gguf_type)
    export_s = time.perf_counter() - start
    with torch.no_grad():
        ours = perplexity(*checkpoint.load(out), protocol)["perplexity"]
        theirs = perplexity(*transformers_model(out), protocol)["perplexity"]
    return {"type": gguf_type, "file_mib": (out / "model.gguf").stat().st_size / 2**20,
            "linear_bits_per_weight": linear_bits(out / "model.gguf"), "export_s": export_s,
            "ppl_lowbit": ours, "ppl_transformers": theirs, "rel_diff": theirs / ours - 1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", default="q8_0,q4_0")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    protocol = PerplexityProtocol(max_tokens=args.max_tokens)
    source = resolve_model_path("smollm2-135m")
    model, tokenizer, _ = load_model("smollm2-135m")
    with torch.no_grad():
        baseline = perplexity(model, tokenizer, protocol)["perplexity"]
    del model
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for gguf_type in args.types.split(","):
            row = {**measure(source, gguf_type, args.dtype, protocol, Path(tmp)), "ppl_float": baseline}
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    if not args.json:
        print(f"float perplexity {baseline:.3f} (wiki, {args.max_tokens} tokens, context 512)")
        print("| type | model.gguf MiB | linear bits/weight | ppl lowbit | ppl transformers | diff |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['type']} | {r['file_mib']:.1f} | {r['linear_bits_per_weight']:.3f} | {r['ppl_lowbit']:.3f} "
                  f"| {r['ppl_transformers']:.3f} | {100 * r['rel_diff']:+.4f}% |")


if __name__ == "__main__":
    main()
