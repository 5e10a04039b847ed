"""Tiny random llama/qwen2 models on GGML grids (hidden 256, so the K-quants' 256-blocks apply),
with the smollm2 tokenizer (same vocabulary), for the GGUF export tests."""
from __future__ import annotations

import itertools

import torch

from lowbit.calibrate.models import resolve_model_path
from lowbit.quantize.grids.gguf import GGUFScheme, quantize_gguf
from lowbit.quantize.runtime.gguf_linear import GGUFLinear

ALL_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q6_k")


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))


def float_tiny(model_type: str, vocab_size: int, intermediate: int = 512, seed: int = 0, **extra):
    """A tiny random model whose norms and biases are random too (so each reaches the file as written)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[model_type]
    config = cls(hidden_size=256, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512,
                 bos_token_id=1, eos_token_id=2, pad_token_id=2, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if tensor.dim() == 1:  # norms (1 at init) and biases (0 at init)
                tensor.copy_(torch.randn_like(tensor) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def gguf_tiny(model_type: str = "llama", vocab_size: int = 49152, types=ALL_TYPES, **extra):
    """float_tiny with every decoder linear a GGUFLinear, the types taken in turn from `types`."""
    model = float_tiny(model_type, vocab_size, **extra)
    linears = [(n, m) for n, m in model.named_modules() if n.endswith("_proj")]
    for (name, module), type_ in zip(linears, itertools.cycle(types)):
        gw = quantize_gguf(module.weight.detach(), GGUFScheme(type_), name)
        model.set_submodule(name, GGUFLinear.from_weight(gw, module.bias))
    return model
