"""The per-layer KV-cache model against hand-computed figures and against the cache transformers
really allocates (configs built in-process, no hub)."""
import pytest
import torch
import transformers as T
from transformers import DynamicCache

from lowbit.calibrate.cached_forward import cached_forward
from lowbit.evaluate.kv_layout import LayerKV, kv_layers
from lowbit.evaluate.memory import GIB, ModelShape, fit_table, kv_bytes_per_layer, kv_cache_bytes, predicted_total

MISTRAL_7B = dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=32000)


def test_plain_llama_caches_every_token_on_every_layer():
    shape = ModelShape.from_config(T.LlamaConfig(**MISTRAL_7B))
    assert kv_cache_bytes(shape, 32768, 2, 2) == 2 * 32 * 8 * 128 * 2 * 32768 * 2
    # the same as a shape that knows nothing of layers (the formula before per-layer layouts)
    bare = ModelShape(32, 4096, 14336, 32, 8, 128, 32000)
    assert kv_cache_bytes(bare, 32768, 2, 2) == kv_cache_bytes(shape, 32768, 2, 2)


def test_mistral_sliding_window_caps_every_layer():
    shape = ModelShape.from_config(T.MistralConfig(**MISTRAL_7B, sliding_window=4096))
    per_token = 2 * 8 * 128 * 2  # K and V, 8 heads of 128, 16-bit: 4 KiB per layer
    assert kv_bytes_per_layer(shape, 1000, 2) == [per_token * 1000] * 32  # under the window: every token
    assert kv_cache_bytes(shape, 32768, 1, 2) == 32 * per_token * 4096 == GIB // 2  # not 4 GiB


def test_gemma2_alternates_sliding_and_full_layers():
    c = T.Gemma2Config(num_hidden_layers=26, num_key_value_heads=4, head_dim=256, sliding_window=4096)
    per_layer = kv_bytes_per_layer(ModelShape.from_config(c), 32768, 2)
    per_token = 2 * 4 * 256 * 2
    assert per_layer[0::2] == [per_token * 4096] * 13  # even layers slide (Gemma 2's layer_types)
    assert per_layer[1::2] == [per_token * 32768] * 13


def test_gemma3_five_sliding_layers_per_full_one():
    c = T.Gemma3TextConfig(num_hidden_layers=12, num_key_value_heads=4, head_dim=256, sliding_window=1024)
    layers = kv_layers(c)
    assert [layer.window for layer in layers] == ([1024] * 5 + [None]) * 2
    assert kv_cache_bytes(ModelShape.from_config(c), 32768, 1, 2) == 2 * 4 * 256 * 2 * (10 * 1024 + 2 * 32768)


def test_deepseek_mla_caches_the_latent_and_the_rotary_key():
    c = T.DeepseekV3Config()  # DeepSeek-V3's sizes: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64
    assert kv_layers(c) == (LayerKV(512 + 64),) * 61
    assert kv_cache_bytes(ModelShape.from_config(c), 4096, 1, 2) == 61 * 576 * 4096 * 2


def test_gemma3n_shared_layers_cache_nothing_of_their_own():
    c = T.Gemma3nTextConfig()  # 35 layers, the last 15 reuse earlier layers' caches
    per_layer = kv_bytes_per_layer(ModelShape.from_config(c), 8192, 2)
    assert per_layer[-15:] == [0] * 15 and all(b > 0 for b in per_layer[:-15])


def test_an_unknown_layer_type_is_named():
    c = T.Gemma2Config(num_hidden_layers=2)
    c.layer_types = ["sliding_attention", "warp_attention"]
    with pytest.raises(ValueError, match=r"layer_types\[1\] is 'warp_attention'.*full_attention"):
        kv_layers(c)


def test_fit_table_of_a_sliding_window_model_counts_the_window():
    sliding = ModelShape.from_config(T.MistralConfig(**MISTRAL_7B, sliding_window=4096))
    full = ModelShape.from_config(T.LlamaConfig(**MISTRAL_7B))
    weights = 4 * GIB
    slid, = fit_table(weights, sliding, (24,), fit_context=32768, kv_bytes=2, act_bytes=2)
    dense, = fit_table(weights, full, (24,), fit_context=32768, kv_bytes=2, act_bytes=2)
    for shape, row in ((sliding, slid), (full, dense)):
        b = row["max_sequences"]
        assert predicted_total(weights, shape, b, 32768, 2, 2)["total"] <= 24 * GIB
        assert predicted_total(weights, shape, b + 1, 32768, 2, 2)["total"] > 24 * GIB
    # by hand, per 32k sequence: activations 32768 x (2 x 4096 + 3 x 14336) x 2 B = 3.125 GiB, KV 4 GiB
    # (all tokens) or 0.5 GiB (window): 20 GiB left after weights holds 2 dense or 5 sliding sequences
    assert (dense["max_sequences"], slid["max_sequences"]) == (2, 5)
    assert slid["max_context"] > 2 * dense["max_context"]


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
MLA = dict(num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
           qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=4,
           moe_intermediate_size=32, n_group=1, topk_group=1)
TINY_MODELS = {
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=8)),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(sliding_window=8)),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(sliding_window=8, num_hidden_layers=6)),
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, MLA),
}


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_prediction_is_what_dynamic_cache_allocates_after_a_prefill_past_the_window(name):
    """transformers keeps window - 1 tokens on a sliding layer between steps (the next token makes
    the window); the model counts the full window, so each sliding layer differs by one token."""
    config_class, model_class, extra = TINY_MODELS[name]
    config = config_class(**{**TINY, **extra})
    torch.manual_seed(0)
    model = model_class(config).eval()
    cache, tokens = DynamicCache(config=model.config), 20
    with torch.no_grad():
        cached_forward(model, torch.randint(0, 128, (1, tokens)), cache)
    held = [layer.keys.nbytes + layer.values.nbytes for layer in cache.layers]
    predicted = kv_bytes_per_layer(ModelShape.from_config(config), tokens, 4)  # float32
    for layer, got, want in zip(kv_layers(config), held, predicted):
        one_token = layer.elements_per_token * 4
        assert got == (want - one_token if layer.window is not None and tokens >= layer.window else want)
    assert any(layer.window for layer in kv_layers(config)) or name == "deepseek_v3"
