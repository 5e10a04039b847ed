"""llama.cpp's `{arch}.*` metadata keys for a model, from its transformers config, as
convert_hf_to_gguf writes them."""
from __future__ import annotations

from .names import GGUFArch
from .rope import head_dim as _head_dim


def add_hyperparameters(writer, config, arch: GGUFArch) -> None:
    """llama.cpp's `{arch}.*` keys, from a transformers config (as convert_hf_to_gguf writes them)."""
    head_dim = _head_dim(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    # Llama 4: intermediate_size is the experts' width, intermediate_size_mlp the dense layers'
    writer.add_feed_forward_length(config.intermediate_size_mlp if arch.llama4 else config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    # latent attention in llama.cpp's MHA path: every head its own k and v, decompressed by attn_kv_b
    writer.add_head_count_kv(config.num_attention_heads if arch.latent_attention else config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    rotated = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    # GLM-4.5 rotates half of each head; DeepSeek's latent attention its keys' rope part
    writer.add_rope_dimension_count(config.qk_rope_head_dim if arch.latent_attention else int(head_dim * rotated))
    writer.add_vocab_size(config.vocab_size)
    if arch.latent_attention:
        add_latent_attention(writer, config)
    elif head_dim != config.hidden_size // config.num_attention_heads or arch.moe:
        writer.add_key_length(head_dim)  # always for a MoE: transformers' GGUF reader takes head_dim from it
        writer.add_value_length(head_dim)
    if arch.moe:
        add_expert_hyperparameters(writer, config)
    if arch.sigmoid_routing:
        add_sigmoid_routing(writer, config)
    if rope.get("rope_type") == "yarn":
        add_yarn(writer, rope)
    if arch.gpt_oss:
        add_gpt_oss(writer, config)
    if arch.llama4:
        writer.add_interleave_moe_layer_step(config.interleave_moe_layer_step)
        writer.add_expert_feed_forward_length(config.intermediate_size)


def add_gpt_oss(writer, config) -> None:
    """The keys llama.cpp's gpt-oss graph reads beyond a MoE's: the window, the experts' width."""
    writer.add_sliding_window(config.sliding_window)
    writer.add_expert_feed_forward_length(config.intermediate_size)


def add_yarn(writer, rope: dict) -> None:
    """YaRN's keys, as convert_hf_to_gguf writes them; DeepSeek's attention mscale as its
    `yarn_log_multiplier` (0.1 x mscale_all_dim, which llama.cpp's deepseek2 graph divides back)."""
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key, add in (("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                     ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                     ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                     ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
        if rope.get(key) is not None:
            add(rope[key])
    if rope.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def add_latent_attention(writer, config) -> None:
    """DeepSeek's latent attention for llama.cpp's MHA path: no `*_mla` lengths, so llama.cpp reads
    attn_kv_b whole; keys of nope + rope width, values of v_head_dim; the ranks (q_lora_rank 0 where q
    is one projection)."""
    writer.add_key_length(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length(config.v_head_dim)
    writer.add_q_lora_rank(config.q_lora_rank or 0)
    writer.add_kv_lora_rank(config.kv_lora_rank)


def add_expert_hyperparameters(writer, config) -> None:
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    inner = getattr(config, "moe_intermediate_size", None)  # absent: experts as wide as intermediate_size
    if inner:
        writer.add_expert_feed_forward_length(inner)
    shared = getattr(config, "shared_expert_intermediate_size", None)
    if shared:
        writer.add_expert_shared_feed_forward_length(shared)


def add_sigmoid_routing(writer, config) -> None:
    """The keys llama.cpp's DeepSeek-style graphs read: shared experts, leading dense layers, sigmoid
    gating, the routing weights' normalization and scale."""
    import gguf

    writer.add_expert_shared_count(getattr(config, "n_shared_experts", None) or 0)
    groups = getattr(config, "n_group", None) or 1
    if groups > 1:  # the router keeps the topk_group groups whose two best scores sum highest
        writer.add_expert_group_count(groups)
        writer.add_expert_group_used_count(config.topk_group)
    writer.add_leading_dense_block_count(getattr(config, "first_k_dense_replace", None) or 0)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(float(getattr(config, "routed_scaling_factor", None) or 1.0))
    writer.add_expert_weights_norm(bool(getattr(config, "norm_topk_prob", False)))
