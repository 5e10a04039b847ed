"""GGUF quality on smollm2-135m (the project's perplexity protocol): lowbit's calibrated GGUF files
against the `gguf` package's own round-to-nearest quantizer on the same weights.

    lowbit run gguf-q4_0-gptq --output runs/gguf-q4_0-gptq      # and gguf-q4_k-gptq, gguf-q8_0
    python bench/gguf_quality.py runs/gguf-q4_0-gptq runs/gguf-q4_k-gptq [--json]

In this process: the float model, and the llama.cpp Q4_0 file the `gguf` package's quantizer
makes of it (every decoder-layer linear Q4_0, the tied embedding Q8_0 as llama.cpp's rules give
a 576-wide output). Per run folder: lowbit's figure (its results.json) and transformers' on the
file itself (`gguf_file=model.gguf`, tokenizer from the file, in a fresh process), the file's bits
per weight, and the share of the package Q4_0's perplexity gap to float that the file closes.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, quants

from lowbit.calibrate.arch import arch_for, linear_weight
from lowbit.calibrate.models import load_model
from lowbit.evaluate.config import PerplexityProtocol
from lowbit.evaluate.perplexity import perplexity
from lowbit.quantize.targets import select_targets

FILE_PPL = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from lowbit.evaluate.config import PerplexityProtocol
from lowbit.evaluate.perplexity import perplexity
folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")
with torch.no_grad():
    print(json.dumps(perplexity(model, tokenizer, PerplexityProtocol())["perplexity"]))
"""


def package_round_trip(weight: torch.Tensor, kind: GGMLQuantizationType) -> torch.Tensor:
    data = quants.quantize(weight.detach().float().numpy(), kind)
    return torch.from_numpy(quants.dequantize(data, kind)).to(weight.dtype)


@torch.no_grad()
def package_q4_0(model) -> None:
    """llama.cpp's Q4_0 file of the model, by the gguf package's quantizer."""
    for name, module in select_targets(model, arch_for(model), ("lm_head",)).linears.items():
        linear_weight(module).copy_(package_round_trip(linear_weight(module), GGMLQuantizationType.Q4_0))
    embedding = model.get_input_embeddings().weight
    embedding.copy_(package_round_trip(embedding, GGMLQuantizationType.Q8_0))


def file_perplexity(folder: Path) -> float:
    out = subprocess.run([sys.executable, "-c", FILE_PPL, str(folder)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def package_bits_per_weight(model) -> float:
    """Linears at Q4_0's 4.5 bits, the embedding at Q8_0's 8.5, norms at F32, over all parameters."""
    linears = sum(m.weight.numel() for m in select_targets(model, arch_for(model), ("lm_head",)).linears.values())
    embedding = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    return (4.5 * linears + 8.5 * embedding + 32 * (total - linears - embedding)) / total


def file_row(folder: Path, fp: float, package: float, params: int) -> dict:
    results = json.loads((folder / "results.json").read_text())
    mine = results["quality"]["perplexity"]
    theirs = file_perplexity(folder)
    bpw = round(8 * results["memory"]["weight_bytes"] / params, 3)
    return {"run": folder.name, "lowbit_ppl": round(mine, 4), "transformers_file_ppl": round(theirs, 4),
            "file_vs_lowbit_pct": round(100 * (theirs / mine - 1), 4), "bits_per_weight": bpw,
            "gap_closed_vs_package_q4_0_pct": round(100 * (package - mine) / (package - fp), 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", type=Path, help="gguf checkpoint folders written by lowbit run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    model, tokenizer, _ = load_model("smollm2-135m", dtype=torch.float32)
    fp = perplexity(model, tokenizer, PerplexityProtocol())["perplexity"]
    params = sum(p.numel() for p in model.parameters())
    package_q4_0(model)
    package = perplexity(model, tokenizer, PerplexityProtocol())["perplexity"]
    rows = [{"run": "float", "lowbit_ppl": round(fp, 4)},
            {"run": "gguf package Q4_0 (RTN, embedding Q8_0)", "lowbit_ppl": round(package, 4),
             "bits_per_weight": round(package_bits_per_weight(model), 3)}]
    rows += [file_row(folder, fp, package, params) for folder in args.runs]
    for row in rows:
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
