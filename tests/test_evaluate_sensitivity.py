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
