"""The gguf format: model.gguf holds exactly lowbit's weights (read by the gguf package and by
transformers in a fresh process), lowbit reads it back byte for byte, and bad input is refused."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gguf_models import ALL_TYPES, gguf_tiny, smollm2_tokenizer
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.quantize.runtime.gguf_linear import GGUFLinear

SENTENCE = "Hello world! Numbers 12345, naïve café <|im_start|>user\nWhat's up?<|im_end|>"

TRANSFORMERS_LOAD = """
import json, sys, torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, ids, out, sentence = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")
with torch.no_grad():
    logits = model(load_file(ids)["ids"]).logits
save_file({"logits": logits.contiguous()}, out)
print(json.dumps({"ids": tokenizer(sentence)["input_ids"], "model_type": model.config.model_type,
                  "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
                  "tied": model.config.tie_word_embeddings, "bias": getattr(model.config, "attention_bias", None),
                  "lowbit": any(m.startswith("lowbit") for m in sys.modules)}))
"""


def transformers_gguf(folder: Path, ids: torch.Tensor, tmp: Path) -> tuple[torch.Tensor, dict]:
    """Logits and facts of folder/model.gguf loaded by transformers alone, in a fresh process."""
    save_file({"ids": ids}, tmp / "ids.safetensors")
    run = subprocess.run([sys.executable, "-c", TRANSFORMERS_LOAD, str(folder), str(tmp / "ids.safetensors"),
                          str(tmp / "logits.safetensors"), SENTENCE], capture_output=True, text=True, cwd=tmp)
    assert run.returncode == 0, run.stderr[-3000:]
    return load_file(tmp / "logits.safetensors")["logits"], json.loads(run.stdout.strip().splitlines()[-1])


def reverse_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order undone, written as transformers' GGUF loader writes it."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def hf_expected(model) -> dict[str, torch.Tensor]:
    """What each tensor must dequantize to: GGUFLinear's dequantized weight, float tensors as they are."""
    out = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
    for name, module in model.named_modules():
        if isinstance(module, GGUFLinear):
            out[f"{name}.weight"] = module.dequantized_weight()
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


# llama: tied head, q/k biases (permuted with their rows); qwen2: its q/k/v biases, an untied head
CASES = [("llama", {"attention_bias": True, "tie_word_embeddings": True}), ("qwen2", {"tie_word_embeddings": False})]


@pytest.mark.parametrize("model_type,extra", CASES)
def test_every_tensor_dequantized_by_gguf_equals_lowbits_weight(tmp_path, tokenizer, model_type, extra):
    import gguf

    model = gguf_tiny(model_type, **extra)
    out = checkpoint.save(model, tokenizer, tmp_path / "ckpt", ExportConfig(format="gguf", dtype="float32"))
    reader = gguf.GGUFReader(str(out / "model.gguf"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if model_type == "llama" else gguf.MODEL_ARCH.QWEN2, 2)
    expected = hf_expected(model)
    by_gguf = {names.get_name(k, try_suffixes=(".weight", ".bias")): k for k in expected}
    seen, types = set(), set()
    for t in reader.tensors:
        hf = by_gguf[t.name]
        values = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        if model_type == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            values = reverse_permute(values, 4 if ".attn_q." in t.name else 2)
        assert torch.equal(torch.from_numpy(values.copy()).float(), expected[hf].float()), t.name
        seen.add(hf)
        types.add(t.tensor_type.name.lower())
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert seen == set(expected) - tied  # a tied head has no output.weight, as llama.cpp writes it
    assert set(ALL_TYPES) <= types
    field = reader.fields["general.architecture"]
    assert field.contents() == model_type


@pytest.mark.parametrize("model_type,extra", [("llama", {"tie_word_embeddings": True}), CASES[1]])
def test_transformers_loads_the_file_to_lowbits_logits_and_tokens(tmp_path, tokenizer, model_type, extra):
    model = gguf_tiny(model_type, **extra)
    out = checkpoint.save(model, tokenizer, tmp_path / "ckpt", ExportConfig(format="gguf", dtype="float32"))
    ids = torch.randint(3, 49000, (2, 48), generator=torch.Generator().manual_seed(0))
    logits, facts = transformers_gguf(out, ids, tmp_path)
    with torch.no_grad():
        ours = model(ids).logits
    assert not facts["lowbit"] and facts["model_type"] == model_type
    assert facts["tied"] == model.config.tie_word_embeddings
    assert (logits - ours).abs().max() <= 1e-5 * ours.abs().max()
    assert (logits.argmax(-1) == ours.argmax(-1)).all()
    assert facts["ids"] == tokenizer(SENTENCE)["input_ids"]
    assert facts["special"] == [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id] == [1, 2, 2]
    assert not (out / "tokenizer.json").exists()  # beside it, transformers would drop those special tokens


def test_lowbit_reads_back_the_same_bytes_and_types(tmp_path, tokenizer):
    model = gguf_tiny("llama", **CASES[0][1])
    out = checkpoint.save(model, tokenizer, tmp_path / "ckpt", ExportConfig(format="gguf"))  # bf16 floats
    loaded, tok = checkpoint.load(out)
    written = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    read = {n: m for n, m in loaded.named_modules() if isinstance(m, GGUFLinear)}
    assert set(read) == set(written)
    for name, module in written.items():
        assert read[name].scheme == module.scheme
        assert torch.equal(read[name].weight, module.weight), name
        if module.bias is None:
            assert read[name].bias is None, name
        else:
            assert torch.equal(read[name].bias, module.bias), name  # biases are F32 in the file
    embed = model.model.embed_tokens.weight.to(torch.bfloat16).float()
    assert torch.equal(loaded.model.embed_tokens.weight, embed)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert tok(SENTENCE)["input_ids"] == tokenizer(SENTENCE)["input_ids"]  # read from model.gguf
    assert (tok.bos_token, tok.eos_token) == (tokenizer.bos_token, tokenizer.eos_token)
    assert checkpoint.is_checkpoint(out) and checkpoint.is_lowbit_export(out)
