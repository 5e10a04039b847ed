"""INT8 input quantization of QuantLinear: int8 matmul vs reference path, static calibration."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lowbit.calibrate.arch import arch_for
from lowbit.quantize import activation, input_quant, rtn
from lowbit.quantize.activation import InputQuant
from lowbit.quantize.primitives import IntScheme
from lowbit.quantize.qlinear import QuantLinear
from lowbit.quantize.step import StepContext
from lowbit.quantize.weight import quantize_rtn

from tiny_models import make_tiny_model


def _qlinear(scheme, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(64, 48, bias=bias)
    lin.weight.data = torch.randn(48, 64, generator=gen)
    lin.bias.data = torch.randn(48, generator=gen)
    return lin, QuantLinear.from_quantized(quantize_rtn(lin.weight.data, scheme), lin.bias)


@pytest.mark.parametrize("dynamic", [True, False])
def test_int8_matmul_matches_reference_path(dynamic, monkeypatch):
    _, q = _qlinear(IntScheme(8, strategy="channel"))
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1))
    input_quant.enable_input_quant(q, InputQuant(dynamic=dynamic), absmax=x.abs().amax(dim=(0, 1)))
    assert activation.int_mm_usable(q, x.reshape(-1, 64))
    fast = q(x)
    monkeypatch.setattr(activation, "int_mm_usable", lambda *a: False)
    reference = q(x)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-4)


def test_w8a8_output_is_close_to_float_and_differs_from_weight_only():
    lin, q = _qlinear(IntScheme(8, strategy="channel"))
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(2))
    weight_only = q(x)
    input_quant.enable_input_quant(q, InputQuant())
    w8a8 = q(x)
    ref = lin(x).detach()
    assert not torch.equal(w8a8, weight_only)
    assert (w8a8 - ref).norm() / ref.norm() < 0.02


def test_grouped_int4_weights_take_reference_path():
    _, q = _qlinear(IntScheme(4, strategy="group", group_size=16))
    input_quant.enable_input_quant(q, InputQuant())
    x = torch.randn(5, 64)
    assert not activation.int_mm_usable(q, x)
    assert q(x).shape == (5, 48)


def test_static_step_calibrates_documented_buffer():
    model = make_tiny_model("llama")
    batches = torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(0))
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: batches)
    rtn.apply(ctx, IntScheme(8, strategy="channel"))
    out = input_quant.apply(ctx, input_quant.InputQuantConfig(dynamic=False))
    q = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert "model.layers.0.self_attn.q_proj" in out["inputs_quantized"]
    assert q.input_scale.shape == (1,) and q.input_scale.item() > 0
    assert "input_scale" in q.state_dict()
    with torch.no_grad():
        assert torch.isfinite(model(batches).logits).all()


def test_config_rejects_other_bit_widths():
    with pytest.raises(ValueError, match="8 bits"):
        input_quant.InputQuantConfig(bits=4)


@pytest.mark.parametrize("dynamic", [True, False])
def test_input_quantization_survives_checkpoint_roundtrip(dynamic, tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    from lowbit.export import checkpoint
    from lowbit.export.config import ExportConfig

    model = make_tiny_model("llama")
    batches = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: batches)
    rtn.apply(ctx, IntScheme(8, strategy="channel"))
    input_quant.apply(ctx, input_quant.InputQuantConfig(dynamic=dynamic))
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    checkpoint.save(model, tokenizer, tmp_path / "ckpt", ExportConfig(dtype="float32"))
    reloaded, _ = checkpoint.load(tmp_path / "ckpt")
    q = reloaded.get_submodule("model.layers.1.mlp.down_proj")
    assert q.input_quant == InputQuant(dynamic=dynamic)
    if not dynamic:
        torch.testing.assert_close(q.input_scale, model.get_submodule("model.layers.1.mlp.down_proj").input_scale)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(batches).logits, model(batches).logits, rtol=1e-4, atol=1e-4)
