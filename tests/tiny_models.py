"""Tiny random models of several architectures (hidden 128, 2 layers) for structure tests."""
from __future__ import annotations

import torch

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)


def tiny_config(model_type: str):
    from transformers import (Gemma3TextConfig, GPT2Config, LlamaConfig, MistralConfig, OPTConfig,
                              Phi3Config, Qwen2Config, Qwen3Config, Gemma2Config)

    if model_type == "opt":
        return OPTConfig(hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=512, max_position_embeddings=256, word_embed_proj_dim=128)
    if model_type == "gpt2":
        return GPT2Config(n_embd=128, n_inner=256, n_layer=2, n_head=4, vocab_size=512, n_positions=256,
                          bos_token_id=0, eos_token_id=0)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "phi3": Phi3Config, "gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig}[model_type]
    extra = {"head_dim": 32} if model_type in ("qwen3", "gemma2", "gemma3_text") else {}
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # inside the tiny vocabulary
    return cls(**TINY, **extra, **ids)


def make_tiny_model(model_type: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32)
    return model.eval()


ARCH_TYPES = ["llama", "qwen2", "gemma3_text", "opt", "gpt2", "phi3", "mistral", "qwen3"]


def save_tiny_llama(folder, seed: int = 0, layers: int = 2, **config):
    """A tiny random llama saved with the smollm2 tokenizer (same vocabulary) into `folder`, a
    model folder that `lowbit run --model` accepts. Seeded: the same seed writes the same weights.
    `config`: LlamaConfig fields to change (e.g. initializer_range)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lowbit.calibrate.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    torch.manual_seed(seed)
    fields = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    cfg = LlamaConfig(**{**fields, **config})
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# the pinned recipes' overrides (tests/test_recipe_pins.py and the runs compared with them): four
# 64-token samples, a 256-token perplexity text, no baseline, KL or peak measurement
PINNED_RUN = ("calibration.samples=4", "calibration.seq_len=64", "evaluate.baseline=false",
              "evaluate.kl.enabled=false", "evaluate.memory.measure_peak=false", "evaluate.perplexity.max_tokens=256",
              "evaluate.perplexity.context_len=128", "evaluate.perplexity.stride=128")

# a run's overrides that keep a tiny pipeline fast: two short calibration samples, a short
# perplexity text, no baseline, KL or peak measurement
SMALL_RUN = ("calibration.samples=2", "calibration.seq_len=32", "evaluate.baseline=false",
             "evaluate.kl.enabled=false", "evaluate.memory.measure_peak=false",
             "evaluate.perplexity.max_tokens=128", "evaluate.perplexity.context_len=64",
             "evaluate.perplexity.stride=64")


def run_on_tiny_llama(folder, recipe: dict, seed: int = 1) -> tuple:
    """Run `recipe` (a mapping; its model set to a tiny llama saved under `folder`) with SMALL_RUN:
    (exit code, output folder)."""
    import json
    from pathlib import Path

    from lowbit.app.cli import main

    folder = Path(folder)
    model_dir = save_tiny_llama(folder / "tiny", seed=seed)
    path = folder / "recipe.yaml"
    path.write_text(json.dumps({"model": str(model_dir), **recipe}))
    out = folder / "run"
    return main(["run", str(path), "--output", str(out), *[f"--set={s}" for s in SMALL_RUN]]), out


def save_tiny_qwen3_moe(folder, seed: int = 0):
    """A tiny random Qwen3-MoE (2 layers, 4 experts, top-2, hidden 64) saved with the smollm2
    tokenizer into `folder`. Loaded, transformers 5.x holds its experts as fused 3-D parameters
    (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) beside a router (mlp.gate);
    save_pretrained writes them one expert at a time."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lowbit.calibrate.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                         num_experts_per_tok=2, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=True, max_position_embeddings=256)
    Qwen3MoeForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
