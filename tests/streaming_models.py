"""Tiny random models of several architectures saved as sharded safetensors folders with the
smollm2 tokenizer (its vocabulary, so real text tokenizes inside the model's embedding)."""
from __future__ import annotations

from pathlib import Path

import torch

from tiny_models import tiny_config


def save_sharded_tiny(folder: Path, model_type: str, tokenizer_dir: str, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_config(model_type)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, max_shard_size="3MB")  # several shards and an index
    tokenizer.save_pretrained(folder)
    return folder
