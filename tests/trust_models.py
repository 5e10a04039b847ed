"""Model folders lowbit must refuse or handle with care, built for real: a tiny model with its own
code (auto_map), encoders, an encoder-decoder, a headless base model, and weights edited in place."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_models import save_tiny_llama

CONFIGURATION = """from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tinycustom"
"""
MODELING = """from transformers import LlamaForCausalLM

from .configuration_tinycustom import TinyCustomConfig
from .tinycustom_scale import LOGIT_SCALE


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
    logit_scale = LOGIT_SCALE
"""
SCALE = "LOGIT_SCALE = 1.0  # imported by modeling_tinycustom.py only: carried because it is imported\n"
CODE_FILES = {"configuration_tinycustom.py": CONFIGURATION, "modeling_tinycustom.py": MODELING,
              "tinycustom_scale.py": SCALE}
AUTO_MAP = {"AutoConfig": "configuration_tinycustom.TinyCustomConfig",
            "AutoModelForCausalLM": "modeling_tinycustom.TinyCustomForCausalLM"}


def save_remote_code_model(folder: Path) -> Path:
    """A tiny llama whose config.json names its own code: a new model_type, auto_map, and the .py
    files subclassing transformers' Llama classes (one imported only by the modeling file)."""
    save_tiny_llama(folder)
    for name, text in CODE_FILES.items():
        (folder / name).write_text(text)
    edit_config(folder, model_type="tinycustom", architectures=["TinyCustomForCausalLM"], auto_map=AUTO_MAP)
    return folder


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}, indent=2))


def edit_weights(folder: Path, change) -> Path:
    """Load model.safetensors, let change(tensors) edit the mapping, save it back."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def save_non_causal(kind: str, folder: Path) -> Path:
    """A tiny T5 (encoder-decoder), BERT (masked LM or bare encoder) or headless LlamaModel folder,
    saved by transformers from its own config: no tokenizer (a refusal must come before it is read)."""
    from transformers import (BertConfig, BertForMaskedLM, BertModel, LlamaConfig, LlamaModel, T5Config,
                              T5ForConditionalGeneration)

    bert = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    builders = {
        "t5": lambda: T5ForConditionalGeneration(T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128,
                                                          num_layers=2, num_heads=4)),
        "bert-mlm": lambda: BertForMaskedLM(BertConfig(**bert)),
        "bert": lambda: BertModel(BertConfig(**bert)),
        "llama-headless": lambda: LlamaModel(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                         num_hidden_layers=2, num_attention_heads=4,
                                                         num_key_value_heads=2, tie_word_embeddings=False)),
    }
    torch.manual_seed(0)
    builders[kind]().save_pretrained(folder)
    return folder
