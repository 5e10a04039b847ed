"""Folding a per-channel scale leaves the model's function unchanged."""
from __future__ import annotations

import pytest
import torch

from lowbit.calibrate.arch import SmoothPair, arch_for, decoder_layers
from lowbit.quantize.steps.fold import fold_scale, follower_index, prev_channels, reduce_to_prev

from tiny_models import make_tiny_model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text", "opt", "phi3", "gpt2"])
def test_folding_every_pair_keeps_logits(model_type):
    model = make_tiny_model(model_type)
    arch = arch_for(model)
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    gen = torch.Generator().manual_seed(1)
    changed = 0
    for layer in decoder_layers(model, arch):
        for pair in arch.smooth:
            channels = prev_channels(layer.get_submodule(pair.prev))
            scale = torch.exp(0.5 * torch.randn(channels, generator=gen))
            old = layer.get_submodule(pair.linears[0]).weight.detach().clone()
            fold_scale(layer, pair, scale, arch.norm_offset)
            changed += not torch.equal(old, layer.get_submodule(pair.linears[0]).weight)
    assert changed == len(arch.smooth) * len(decoder_layers(model, arch))  # folding did touch them
    after = _logits(model, ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_gqa_index_maps_query_heads_to_their_kv_head():
    model = make_tiny_model("llama")  # 4 query heads, 2 kv heads, head_dim 32
    layer = decoder_layers(model, arch_for(model))[0]
    index = follower_index(layer, "self_attn.o_proj", 64)
    assert index.shape == (128,)
    assert torch.equal(index[:32], torch.arange(32)) and torch.equal(index[32:64], torch.arange(32))
    assert torch.equal(index[64:96], torch.arange(32, 64)) and torch.equal(index[96:], torch.arange(32, 64))
    stat = torch.arange(128.0)
    assert torch.equal(reduce_to_prev(stat, index, 64), torch.cat([torch.arange(32, 64.0), torch.arange(96, 128.0)]))


def test_fold_rejects_wrong_shape_and_nonpositive_scales():
    model = make_tiny_model("llama")
    layer = decoder_layers(model, arch_for(model))[0]
    pair = SmoothPair("input_layernorm", ("self_attn.q_proj",))
    with pytest.raises(ValueError, match="shape"):
        fold_scale(layer, pair, torch.ones(5))
    with pytest.raises(ValueError, match="positive"):
        fold_scale(layer, pair, torch.zeros(128))
