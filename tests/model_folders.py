"""Tiny model folders on disk (random llama + the smollm2 tokenizer), whole or damaged on purpose."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch


def save_tiny_folder(folder: Path) -> Path:
    """A 2-layer random llama with the smollm2 tokenizer (same vocabulary), as safetensors."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lowbit.calibrate.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def copy_folder(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def to_pickle_weights(folder: Path, extra: dict | None = None) -> Path:
    """Replace model.safetensors by a pickle-based pytorch_model.bin (plus any extra objects)."""
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    torch.save({**state, **(extra or {})}, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


def looks_like_checkpoint(path: Path) -> bool:
    """What a user (or vLLM) would take for a whole model folder."""
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def leftovers(parent: Path, name: str) -> list[str]:
    """The output folder or any staging / backup folder a failed export might have left beside it."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))
