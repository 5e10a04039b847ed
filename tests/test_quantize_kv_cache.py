"""KV-cache quantization: the tensor core, calibration on cached K/V, the cache class in generation."""
from __future__ import annotations

import pytest
import torch

from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.cached_forward import cached_forward, returned_cache
from lowbit.calibrate.observers import cached_kv_absmax
from lowbit.evaluate.kv_cache import kv_bytes_per_token_formula, measure_kv_cache
from lowbit.quantize.runtime import kv_cache
from lowbit.quantize.steps import kv_cache as kv_cache_step
from lowbit.quantize.grids.kv import KVCacheConfig, dequantize_kv, quantize_kv, static_scale
from lowbit.quantize.steps.context import StepContext
from lowbit.recipes.schema import load_recipe
from lowbit.quantize.steps.registry import STEPS

SCHEMES = [("int8", "tensor"), ("int8", "head"), ("int8", "token"), ("fp8", "tensor"), ("fp8", "head"),
           ("fp8", "token"), ("int4", "token")]
STORED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}


def _ids(rows=2, tokens=24, seed=0):
    return torch.randint(3, 500, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def _apply(model, scheme, strategy, batches=None):
    cfg = KVCacheConfig(scheme, strategy)
    batches = _ids(4, 32) if batches is None else batches
    kv_cache_step.apply(StepContext(model, arch_for(model), (), lambda: batches), cfg)
    return cfg


@pytest.mark.parametrize("scheme,strategy", SCHEMES)
def test_roundtrip_error_and_storage(scheme, strategy):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 64) * torch.tensor([0.5, 2.0, 8.0]).reshape(1, 3, 1, 1)
    cfg = KVCacheConfig(scheme, strategy)
    scale = static_scale(x.abs().amax(dim=(0, 2, 3)), cfg) if cfg.static else None
    q = quantize_kv(x, cfg, scale)
    assert q.codes.dtype == STORED[scheme]
    assert q.codes.shape[-1] == (32 if scheme == "int4" else 64)  # int4: two codes per byte
    err = (dequantize_kv(q, cfg, torch.float32) - x).abs()
    # half a step, as a fraction of the |max| a scale covers (int4: the range spans up to 2 |max|)
    bound = {"int8": 1 / 254, "fp8": 1 / 16, "int4": 2 / 30}[scheme] * 1.01
    assert (err <= bound * x.abs().amax() + 1e-6).all()
    if strategy != "tensor":  # finer scales: the small head gets a grid of its own
        assert err[:, 0].max() <= bound * x[:, 0].abs().amax() + 1e-6


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_static_scale_saturates_values_beyond_calibration(scheme):
    cfg = KVCacheConfig(scheme, "tensor")
    x = torch.tensor([1.0, -1.0, 50.0, -1e9]).reshape(1, 1, 1, 4)
    y = dequantize_kv(quantize_kv(x, cfg, static_scale(torch.tensor([1.0]), cfg)), cfg, torch.float32)
    assert torch.isfinite(y).all()
    assert torch.allclose(y.flatten(), torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-2)


def test_int4_needs_the_token_strategy():
    with pytest.raises(ValueError, match="strategy: token"):
        KVCacheConfig("int4", "tensor")


def test_calibration_observes_the_keys_after_rope(tiny_llama):
    ids = _ids(3, 40)
    stats = cached_kv_absmax(tiny_llama, ids, micro_batch=2)
    with torch.no_grad():
        _, cache = cached_forward(tiny_llama, ids)  # float cache: keys as attention stores them
    for i, layer in enumerate(cache.layers):
        assert torch.allclose(stats["k_absmax"][i], layer.keys.abs().amax(dim=(0, 2, 3)))
        assert torch.allclose(stats["v_absmax"][i], layer.values.abs().amax(dim=(0, 2, 3)))
    with torch.no_grad():  # keys before RoPE differ: the observer sees what is cached, not k_proj's output
        pre_rope = tiny_llama.model.layers[0].self_attn.k_proj(tiny_llama.model.layers[0].input_layernorm(
            tiny_llama.model.embed_tokens(ids)))
    assert not torch.allclose(pre_rope.abs().amax(), stats["k_absmax"][0].amax())


@pytest.mark.parametrize("strategy,shape", [("tensor", ()), ("head", (2,))])
def test_step_stores_scales_on_attention_modules(tiny_llama, strategy, shape):
    cfg = _apply(tiny_llama, "fp8", strategy)
    attn = tiny_llama.model.layers[1].self_attn
    assert attn.k_scale.shape == shape and attn.v_scale.shape == shape and (attn.k_scale > 0).all()
    assert tiny_llama.lowbit_kv_cache == cfg
    assert not any(k.endswith(("k_scale", "v_scale")) for k in tiny_llama.state_dict())  # export writes them


@pytest.mark.parametrize("scheme,strategy", [("int8", "tensor"), ("fp8", "head"), ("int8", "token"), ("int4", "token")])
def test_decoding_reads_quantized_storage_and_matches_one_forward(tiny_llama, scheme, strategy):
    _apply(tiny_llama, scheme, strategy)
    ids = _ids(2, 20)
    with torch.no_grad():
        full = tiny_llama(input_ids=ids).logits
        out = tiny_llama(input_ids=ids[:, :12])  # a plain forward: the hook supplies the cache
        cache, steps = returned_cache(out), [out.logits[:, -1]]
        for t in range(12, 19):
            out, cache = cached_forward(tiny_llama, ids[:, t : t + 1], cache)
            steps.append(out.logits[:, -1])
    assert isinstance(cache, kv_cache.QuantizedKVCache)
    assert cache.layers[0]._quantized_keys.codes.dtype == STORED[scheme]
    assert cache.layers[0].keys.numel() == 0  # nothing kept in float
    # token by token from the quantized store == one forward over quantize-dequantized K/V
    assert torch.allclose(torch.stack(steps, 1), full[:, 11:19], atol=1e-4)


def test_generation_matches_float_cache_within_tolerance(tiny_llama):
    ids = _ids(1, 16)
    kw = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ref = tiny_llama.generate(ids, **kw)
    _apply(tiny_llama, "int8", "head")
    got = tiny_llama.generate(ids, **kw)
    assert isinstance(returned_cache(got), kv_cache.QuantizedKVCache)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores):
        assert (a - b).norm() / b.norm() < 0.05


@pytest.mark.parametrize("scheme,strategy", [("fp8", "tensor"), ("int4", "token")])
def test_long_generation_stays_finite(tiny_llama, scheme, strategy):
    _apply(tiny_llama, scheme, strategy)
    out = tiny_llama.generate(_ids(1, 8), max_new_tokens=120, min_new_tokens=120, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)  # raw logits: no -inf masks
    assert returned_cache(out).get_seq_length() == 127
    assert all(torch.isfinite(s).all() for s in out.logits)


def test_cache_memory_measured_and_by_formula(tiny_llama):
    c = tiny_llama.config
    assert kv_bytes_per_token_formula(c, 1) == 2 * c.num_hidden_layers * c.num_key_value_heads * (
        c.hidden_size // c.num_attention_heads)
    _apply(tiny_llama, "int8", "tensor")
    r = measure_kv_cache(tiny_llama, _ids(1, 100), decode_steps=3)
    assert r["cache"] == "QuantizedKVCache" and r["tokens"] == 103
    # codes are exactly the formula; the per-tensor scales add a few bytes per layer
    assert r["bytes_per_token_formula"] <= r["bytes_per_token_measured"] < r["bytes_per_token_formula"] * 1.01
    assert r["ratio_to_16bit"] <= 0.55


def test_recipe_composes_weight_step_with_kv_cache(tiny_llama):
    recipe = load_recipe("w4a16-rtn-kv8")
    ctx = StepContext(tiny_llama, arch_for(tiny_llama), recipe.ignore, lambda: _ids(4, 32))
    for step in recipe.steps:
        STEPS[step.name].apply(ctx, step.config)
    with torch.no_grad():
        out = tiny_llama(input_ids=_ids(1, 10))
    assert isinstance(returned_cache(out), kv_cache.QuantizedKVCache) and torch.isfinite(out.logits).all()


def test_static_cache_without_calibration_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="k_scale"):
        kv_cache.QuantizedKVCache(tiny_llama, KVCacheConfig("int8", "tensor"))


@torch.no_grad()
def test_a_reset_cache_starts_afresh_and_is_never_cropped(tiny_llama):
    # lowbit's own layer logic (transformers 5.17 has no BaseQuantizedLayer to inherit it from)
    _apply(tiny_llama, "int8", "token")
    ids = _ids(1, 10)
    fresh = tiny_llama(input_ids=ids).logits
    _, cache = cached_forward(tiny_llama, _ids(1, 6, seed=1))
    assert cache.get_seq_length() == 6 and cache.nbytes() > 0 and not cache.is_croppable
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0
    out, again = cached_forward(tiny_llama, ids, cache)  # nothing of the 6 earlier tokens is attended
    assert again is cache and cache.get_seq_length() == 10 and torch.equal(out.logits, fresh)


def test_perplexity_effect_runs_through_the_quantized_cache(tiny_tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from lowbit.evaluate.config import PerplexityProtocol
    from lowbit.evaluate.kv_cache import kv_perplexity_effect

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    _apply(model, "int4", "token")
    r = kv_perplexity_effect(model, tokenizer, PerplexityProtocol(context_len=128, stride=128, max_tokens=256))
    assert r["perplexity_quantized_kv"] != r["perplexity_float_kv"]  # the KV scheme was really in the loop
    assert abs(r["kv_effect_pct"]) < 5 and model.lowbit_kv_cache.format == "int4"  # re-attached


@pytest.mark.slow
def test_smollm2_int8_kv_cache_is_at_most_55_percent_of_16bit(smollm2):
    model, tokenizer = smollm2
    from lowbit.evaluate.config import PerplexityProtocol
    from lowbit.evaluate.perplexity import eval_tokens

    prompt = eval_tokens(tokenizer, PerplexityProtocol())[:2000][None]
    try:
        _apply(model, "int8", "tensor", batches=prompt[:, :256])
        r = measure_kv_cache(model, prompt, decode_steps=2)
    finally:
        kv_cache.detach(model)  # the fixture is shared by the session
    assert r["tokens"] == 2002 and r["ratio_to_16bit"] <= 0.55
