import pytest
import torch

from tiny_models import ARCH_TYPES, make_tiny_model
from lowbit.calibrate.arch import ARCHS, arch_for, decoder_layers, is_linear, target_linears
from lowbit.quantize.steps import rtn
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.quantize.steps.context import StepContext


@pytest.mark.parametrize("model_type", ARCH_TYPES + ["gemma2"])
def test_table_row_matches_the_model(model_type):
    model = make_tiny_model(model_type)
    arch = arch_for(model, allow_fallback=False)
    assert not arch.fallback
    layers = decoder_layers(model, arch)
    assert len(layers) == model.config.num_hidden_layers
    for layer in layers:
        for name in arch.linears:
            assert is_linear(layer.get_submodule(name)), name
        for pair in arch.smooth:
            layer.get_submodule(pair.prev)
            for name in pair.linears:
                assert name in arch.linears
    if arch.k_proj:
        assert arch.k_proj in arch.linears and arch.v_proj in arch.linears


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text", "opt", "gpt2"])
def test_rtn_8bit_on_every_arch_keeps_logits_close(model_type):
    model = make_tiny_model(model_type)
    ids = torch.randint(3, 500, (2, 16))
    with torch.no_grad():
        ref = model(ids).logits
        arch = arch_for(model)
        result = rtn.apply(StepContext(model, arch, ("lm_head",), lambda: None), rtn.RTNConfig(IntScheme(bits=8)))
        out = model(ids).logits
    assert len(result["quantized"]) == len(target_linears(model, arch))
    assert "lm_head" in result["ignored"]
    assert all(isinstance(m, QuantLinear) for m in target_linears(model, arch).values())
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_gpt2_conv1d_is_transposed_correctly():
    model = make_tiny_model("gpt2")
    conv = model.transformer.h[0].mlp.c_fc
    x = torch.randn(3, 128)
    with torch.no_grad():
        ref = conv(x)
        rtn.apply(StepContext(model, arch_for(model), ("lm_head",), lambda: None), rtn.RTNConfig(IntScheme(bits=8)))
        out = model.transformer.h[0].mlp.c_fc(x)
    assert (out - ref).abs().max() < 0.02 * ref.abs().max()


def test_unknown_architecture_falls_back_with_a_warning():
    model = make_tiny_model("llama")
    model.config.model_type = "my_new_llm"
    with pytest.warns(UserWarning, match="my_new_llm.*not in lowbit's table.*falling back"):
        arch = arch_for(model)
    assert arch.fallback and arch.layers == "model.layers"
    assert set(arch.linears) == set(ARCHS["llama"].linears)


def test_unknown_architecture_without_fallback_fails_clearly():
    model = make_tiny_model("llama")
    model.config.model_type = "my_new_llm"
    with pytest.raises(ValueError, match="my_new_llm.*known:.*llama"):
        arch_for(model, allow_fallback=False)
