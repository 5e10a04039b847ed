"""Tiny random mixtures of experts (2 decoder layers, 4 experts, top-2, hidden 64) of every family
lowbit's table holds, saved with the smollm2 tokenizer into a model folder `lowbit run` accepts.
transformers 5.x holds their experts as fused 3-D parameters; save_pretrained writes the hub's
per-expert tensors."""
from __future__ import annotations

import torch

MOE_TYPES = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "llama4_text"]
EXPERTS = 4
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
EXTRA = {
    "qwen3_moe": dict(num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16),
    "mixtral": dict(num_local_experts=EXPERTS, num_experts_per_tok=2),
    "olmoe": dict(num_experts=EXPERTS, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128),
    # experts transposed, gate and up interleaved, with biases; attention with biases and sinks
    "gpt_oss": dict(num_local_experts=EXPERTS, num_experts_per_tok=2, head_dim=16, intermediate_size=64,
                    layer_types=["sliding_attention", "full_attention"]),
    # layer 0 dense (interleave step 2), layer 1 top-1 routed experts scaled on input and a shared one
    "llama4_text": dict(num_local_experts=EXPERTS, num_experts_per_tok=1, head_dim=16, intermediate_size=64,
                        intermediate_size_mlp=128, interleave_moe_layer_step=2),
    # not in lowbit's table and its experts class not split (tests of what lowbit does with such a model)
    "phimoe": dict(num_local_experts=EXPERTS, num_experts_per_tok=2),
    # layer 0 dense (first_k_dense_replace), layer 1 routed experts and a shared one; multi-head latent attention
    "deepseek_v3": dict(n_routed_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=64,
                        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
                        rope_scaling=None, num_key_value_heads=4),  # latent attention: k/v for every head
    # layer 0 dense, layer 1 routed experts (sigmoid router, grouped top-k) and a shared one; q/k norms,
    # half the head rotated
    "glm4_moe": dict(n_routed_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=2, topk_group=1, use_qk_norm=True, head_dim=16,
                     norm_topk_prob=True),
}
# Llama 3's RoPE scaling with a short original context, so that its divisors show within a 128-token chunk
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
# per layer: routed experts x (gate, up, down), the dense layers' MLP, a shared expert's projections
EXPERT_LAYERS = {"deepseek_v3": [1], "llama4_text": [1], "glm4_moe": [1]}
# inside a decoder layer, where the routed experts sit
EXPERTS_AT = {"llama4_text": "feed_forward.experts"}


def moe_config(model_type: str, tokenizer, **overrides):
    from transformers import AutoConfig

    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return AutoConfig.for_model(model_type, **{**COMMON, **EXTRA[model_type], **ids, **overrides})


def save_tiny_moe(folder, model_type: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowbit.calibrate.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(model_type, tok, **overrides), dtype=torch.float32)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def expert_layers(model_type: str) -> list[int]:
    return EXPERT_LAYERS.get(model_type, [0, 1])


def experts_at(model_type: str) -> str:
    return EXPERTS_AT.get(model_type, "mlp.experts")
