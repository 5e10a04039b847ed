"""llama.cpp itself (llama-cpp-python) runs a lowbit model.gguf: it tokenizes as the file's
tokenizer should and its logits follow lowbit's. Skipped where the binding is not installed: it
builds llama.cpp from source (`pip install llama-cpp-python`, 15-30 minutes on 2 cores), which
the test install does not do; the transformers tests in test_export_gguf.py always run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_models import gguf_tiny, smollm2_tokenizer
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (it compiles llama.cpp: pip install llama-cpp-python)")

SENTENCE = "Hello world! Numbers 12345, naïve café <|im_start|>user\nWhat's up?<|im_end|>"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny llama with every GGML type lowbit writes, exported to model.gguf."""
    tokenizer = smollm2_tokenizer()
    model = gguf_tiny("llama", tie_word_embeddings=True)
    out = checkpoint.save(model, tokenizer, tmp_path_factory.mktemp("gguf") / "ckpt",
                          ExportConfig(format="gguf", dtype="float32"))
    llm = llama_cpp.Llama(model_path=str(out / "model.gguf"), n_ctx=128, logits_all=True, n_threads=1,
                          verbose=False)
    yield model, tokenizer, llm
    llm.close()  # before interpreter shutdown, when the binding's free function may be gone


def test_llama_cpp_tokenizes_as_the_file_s_tokenizer(exported):
    _, tokenizer, llm = exported
    assert llm.tokenize(SENTENCE.encode(), add_bos=False, special=True) == tokenizer(SENTENCE)["input_ids"]
    assert llm.token_bos() == tokenizer.bos_token_id and llm.token_eos() == tokenizer.eos_token_id


def test_llama_cpp_logits_follow_lowbit_s(exported):
    """llama.cpp rounds activations to 8 bits before its quantized dot products, so its logits are
    close to lowbit's, not equal: nearly collinear, and the same next token almost everywhere."""
    model, _, llm = exported
    ids = torch.randint(3, 49000, (64,), generator=torch.Generator().manual_seed(0))
    llm.reset()
    llm.eval(ids.tolist())
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    with torch.no_grad():
        ours = model(ids[None]).logits[0]
    cosine = torch.nn.functional.cosine_similarity(theirs, ours, dim=-1)
    assert float(cosine.min()) > 0.999, cosine  # measured: 0.99990
    assert float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()) >= 0.9  # measured: 63 of 64
