"""A lowbit model.gguf run by llama.cpp itself (through llama-cpp-python): its tokenizer on the
evaluation text, its perplexity under the project's protocol, and a greedy continuation, beside
lowbit's own figures for the same file.

    pip install llama-cpp-python        # compiles llama.cpp: about an hour on 2 shared cores
    python bench/gguf_llama_cpp.py runs/gguf-q4_0-gptq [runs/gguf-q4_k-gptq ...] [--json]

The evaluation tokens are the file's own tokenizer's (transformers reads it from model.gguf);
llama.cpp tokenizes the same text too and the bench reports whether the ids agree. Perplexity
uses the same windows as lowbit's (evaluate/perplexity.py), one window per llama.cpp decode.
llama.cpp multiplies Q4/Q8 weights with activations it rounds to 8 bits, so its figure may
differ from lowbit's by a little more than float rounding.
"""
import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from lowbit.calibrate.data import load_text
from lowbit.evaluate.config import PerplexityProtocol
from lowbit.evaluate.perplexity import bos_id, eval_tokens, windows

PROMPT = "The history of the city begins"


def load_llama(path: Path, context: int):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=context, logits_all=True, n_threads=torch.get_num_threads(),
                 verbose=False)


def llama_perplexity(llm, ids: torch.Tensor, prefix: list[int], protocol: PerplexityProtocol) -> tuple[float, int]:
    nll, count = 0.0, 0
    for begin, end, first in windows(len(ids), protocol):
        seq = prefix + ids[begin:end].tolist()
        llm.reset()
        llm.eval(seq)
        logits = torch.from_numpy(np.array(llm.scores[: len(seq)], dtype=np.float32))
        scored = range(len(prefix) + first - begin, len(seq))  # positions whose token is scored
        logp = torch.log_softmax(logits[[t - 1 for t in scored]], dim=-1)
        nll -= float(logp[torch.arange(len(scored)), torch.tensor([seq[t] for t in scored])].sum())
        count += len(scored)
    return math.exp(nll / count), count


def greedy(llm, steps: int = 24) -> str:
    llm.reset()
    out = llm(PROMPT, max_tokens=steps, temperature=0.0, top_k=1)
    return out["choices"][0]["text"]


def measure(folder: Path, protocol: PerplexityProtocol) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")
    ids = eval_tokens(tokenizer, protocol)
    llm = load_llama(folder / "model.gguf", protocol.context_len)
    text = load_text(protocol.dataset, "eval")
    theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)[: len(ids)]
    start = time.perf_counter()
    ppl, scored = llama_perplexity(llm, ids, [bos_id(tokenizer)] if protocol.bos else [], protocol)
    results = folder / "results.json"
    lowbit = json.loads(results.read_text())["quality"]["perplexity"] if results.exists() else None
    return {"run": folder.name, "llama_cpp_perplexity": ppl, "lowbit_perplexity": lowbit,
            "relative_difference": None if lowbit is None else ppl / lowbit - 1,
            "token_ids_agree": theirs == ids.tolist(), "tokens_scored": scored,
            "seconds": time.perf_counter() - start, "greedy": greedy(llm)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run or checkpoint folders holding model.gguf")
    parser.add_argument("--max-tokens", type=int, default=None, help="score fewer tokens than the protocol")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    protocol = PerplexityProtocol()
    if args.max_tokens:
        protocol = PerplexityProtocol(max_tokens=args.max_tokens)
    for folder in args.runs:
        row = measure(folder, protocol)
        if args.json:
            print(json.dumps(row))
        else:
            diff = "" if row["lowbit_perplexity"] is None else \
                f"  lowbit {row['lowbit_perplexity']:.3f} ({100 * row['relative_difference']:+.3f}%)"
            print(f"{row['run']}: llama.cpp {row['llama_cpp_perplexity']:.3f}{diff}  token ids agree: "
                  f"{row['token_ids_agree']}  ({row['seconds']:.0f} s)\n  greedy: {PROMPT}{row['greedy']!r}")


if __name__ == "__main__":
    main()
