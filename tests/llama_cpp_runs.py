"""llama.cpp's own llama-perplexity on a lowbit GGUF file, and lowbit's perplexity of the same file
by the same protocol (the tests that compare them skip, naming the command that builds the tools,
where llama.cpp's tools are not built; CI does not build them)."""
from __future__ import annotations

import importlib.util
import math
import re
import subprocess
from pathlib import Path

import gguf
import pytest
import torch

_spec = importlib.util.spec_from_file_location("llama_cpp_tools",
                                               Path(__file__).parents[1] / "bench" / "llama_cpp_tools.py")
llama_cpp_tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama_cpp_tools)
PERPLEXITY = llama_cpp_tools.tool("llama-perplexity")
needs_llama_cpp = pytest.mark.skipif(PERPLEXITY is None, reason="llama.cpp's tools are not built: python "
                                     "bench/llama_cpp_tools.py (about 15 minutes on 2 cores)")

CONTEXT, CHUNKS = 128, 8  # llama-perplexity scores the second half of each context-long chunk


def llama_cpp_perplexity(file: Path, text_file: Path) -> float:
    done = subprocess.run([str(PERPLEXITY), "-m", str(file), "-f", str(text_file), "-c", str(CONTEXT), "-b",
                           str(CONTEXT), "--chunks", str(CHUNKS), "-t", "2"], capture_output=True, text=True,
                          timeout=600)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    assert done.returncode == 0 and found, (done.stdout + done.stderr)[-2000:]
    return float(found.group(1))


def lowbit_perplexity(folder: Path, text: str) -> float:
    """llama-perplexity's protocol on lowbit's reading of the same file: the file's tokenizer, a BOS
    first where the file asks for one, chunk by chunk, the second half of each scored."""
    from lowbit.export.reader import load

    model, tokenizer = load(folder)
    field = gguf.GGUFReader(str(folder / "model.gguf")).fields.get("tokenizer.ggml.add_bos_token")
    add_bos = bool(field.parts[field.data[0]][0]) if field else False
    ids = ([tokenizer.bos_token_id] if add_bos else []) + tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= CONTEXT * CHUNKS
    nll, count, first = 0.0, 0, CONTEXT // 2
    with torch.no_grad():
        for i in range(CHUNKS):
            chunk = ids[i * CONTEXT:(i + 1) * CONTEXT]
            chunk[0] = tokenizer.bos_token_id if add_bos else chunk[0]
            logp = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), -1)
            target = torch.tensor(chunk[first + 1:])
            nll -= float(logp[first:CONTEXT - 1].gather(1, target[:, None]).sum())
            count += len(target)
    return math.exp(nll / count)
