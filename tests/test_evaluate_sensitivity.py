"""Measured sensitivity: a linear's loss, computed from its layer onward, is the KL a whole
forward with that linear alone rounded gives."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_model
from lowbit.calibrate.arch import arch_for, linear_weight
from lowbit.evaluate.kl import token_kl
from lowbit.evaluate.sensitivity import linear_options, measure, type_bytes
from lowbit.quantize.grids.gguf import GGUFScheme, quantize_gguf


def full_forward_kl(model, batches, name: str, kind: str) -> float:
    with torch.no_grad():
        ref = model(input_ids=batches, use_cache=False).logits
        weight = linear_weight(model.get_submodule(name))
        original = weight.clone()
        weight.copy_(quantize_gguf(original, GGUFScheme(kind), name).dequantize())
        logits = model(input_ids=batches, use_cache=False).logits
        weight.copy_(original)
    return float(token_kl(ref, logits, torch.float64).mean())


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text", "opt"])
def test_tail_forward_kl_equals_a_full_forward_with_the_linear_rounded(model_type):
    model = make_tiny_model(model_type)
    arch = arch_for(model)
    batches = torch.randint(3, 500, (3, 24), generator=torch.Generator().manual_seed(0))
    options = linear_options(model, arch, ("q4_0", "q8_0", "f16"))
    names = list(options)
    picked = {n: options[n] for n in (names[1], names[len(names) // 2 + 1], names[-1])}  # layer 0 and 1
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = measure(model, arch, batches, picked, micro_batch=2)
    for name in picked:
        assert losses[name]["f16"] == 0.0
        for kind in ("q4_0", "q8_0"):
            assert losses[name][kind] == pytest.approx(full_forward_kl(model, batches, name, kind), rel=1e-3)
        assert 0 < losses[name]["q8_0"] < losses[name]["q4_0"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # weights restored


def test_options_follow_llama_cpp_s_fallbacks_and_count_their_bytes():
    model = make_tiny_model("llama")  # rows 128 (256 for down_proj): no 256-block on 128-wide rows
    options = linear_options(model, arch_for(model), ("q4_k", "q6_k", "q4_0", "f16"))
    q = options["model.layers.0.self_attn.q_proj"]
    assert sorted(q) == ["f16", "q4_0", "q5_0", "q8_0"]  # q4_k -> q5_0, q6_k -> q8_0 on 128-wide rows
    assert sorted(options["model.layers.0.mlp.down_proj"]) == ["f16", "q4_0", "q4_k", "q6_k"]
    assert q["q4_0"] == 128 * 128 // 32 * 18 and q["f16"] == 128 * 128 * 2
    assert type_bytes("q4_k", 4096, 4096) * 8 / (4096 * 4096) == 4.5


def test_integer_formats_are_measured_like_ggml_types_and_offered_where_their_group_fits():
    from lowbit.evaluate.sensitivity import rounded

    model = make_tiny_model("llama")  # q/k/v/o/gate/up take 128 columns, down_proj 256
    arch = arch_for(model)
    options = linear_options(model, arch, ("int3_g64", "int4_g256", "int8", "f16"))
    assert sorted(options["model.layers.0.self_attn.q_proj"]) == ["f16", "int3_g64", "int8"]  # 256 > 128 columns
    assert sorted(options["model.layers.0.mlp.down_proj"]) == ["f16", "int3_g64", "int4_g256", "int8"]
    batches = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    name = "model.layers.1.mlp.down_proj"
    losses = measure(model, arch, batches, {name: options[name]}, micro_batch=2)[name]
    with torch.no_grad():
        ref = model(input_ids=batches, use_cache=False).logits
        weight = linear_weight(model.get_submodule(name))
        original = weight.clone()
        for kind in ("int3_g64", "int8"):
            weight.copy_(rounded(kind, original, name))
            full = float(token_kl(ref, model(input_ids=batches, use_cache=False).logits, torch.float64).mean())
            assert losses[kind] == pytest.approx(full, rel=1e-3)
        weight.copy_(original)
    assert 0 < losses["int8"] < losses["int4_g256"] < losses["int3_g64"]


def test_kv_formats_cost_in_the_order_of_their_bits_and_weigh_what_the_formula_says():
    from lowbit.evaluate.sensitivity import kv_bytes_per_element, kv_format, measure_kv

    model = make_tiny_model("llama")
    batches = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    losses = measure_kv(model, batches, ("int4", "int8", "f16"), micro_batch=2)
    assert losses["f16"] == 0.0 and 0 < losses["int8"] < losses["int4"]
    assert getattr(model, "lowbit_kv_cache", None) is None  # the float cache is back
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    for kind in ("int4", "int8", "fp8"):  # the cache's real tensors against the stored-bytes formula
        assert kv_bytes_per_element(model, kind) == pytest.approx(kv_format(kind).stored_bytes_per_element(head_dim))
