"""INT8 input quantization of QuantLinear: int8 matmul vs reference path, static calibration."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.hardware import cpu_flags, onednn_allows
from lowbit.quantize.runtime import int8_inputs as activation
from lowbit.quantize.steps import int8_inputs as input_quant
from lowbit.quantize.steps import rtn
from lowbit.quantize.grids.inputs import InputQuant, per_token_scale
from lowbit.quantize.grids.integer import IntScheme, quantize_rtn
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.quantize.steps.context import StepContext

from tiny_models import make_tiny_model

# torch 2.13 sends CPU _int_mm to oneDNN by the CPU's VNNI flag alone; with oneDNN capped below VNNI
# (ONEDNN_MAX_CPU_ISA, as when this machine stands in for an AVX2 CPU) it returns wrong sums
needs_correct_int_mm = pytest.mark.skipif(
    "avx512_vnni" in cpu_flags() and not onednn_allows(os.environ, "AVX512_CORE_VNNI"),
    reason="ONEDNN_MAX_CPU_ISA caps oneDNN below the VNNI torch._int_mm dispatches on: it returns wrong sums")


def _qlinear(scheme, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(64, 48, bias=bias)
    lin.weight.data = torch.randn(48, 64, generator=gen)
    lin.bias.data = torch.randn(48, generator=gen)
    return lin, QuantLinear.from_quantized(quantize_rtn(lin.weight.data, scheme), lin.bias)


def _fake_quant_reference(q, x):
    """The definition: the input rounded onto its grid, times the dequantized weight."""
    x2d = x.reshape(-1, x.shape[-1])
    iq = q.input_quant
    scale = per_token_scale(x2d, iq.qmax) if iq.dynamic else q.input_scale.reshape(1, 1)
    xq = torch.round(x2d / scale).clamp(-128, 127) * scale
    return torch.nn.functional.linear(xq, q.dequantized_weight(), q.bias).reshape(*x.shape[:-1], -1)


@needs_correct_int_mm
@pytest.mark.parametrize("dynamic", [True, False])
def test_int8_and_float32_products_agree_exactly_and_match_the_definition(dynamic):
    _, q = _qlinear(IntScheme(8, strategy="channel"))
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1))
    input_quant.enable_input_quant(q, InputQuant(dynamic=dynamic), absmax=x.abs().amax(dim=(0, 1)) * 0.8)
    with_int_mm = activation.quantized_input_linear(q, x, use_int_mm=True)
    with_float32 = activation.quantized_input_linear(q, x, use_int_mm=False)
    assert torch.equal(with_int_mm, with_float32)  # the same integer sums, scaled the same way
    torch.testing.assert_close(with_float32, _fake_quant_reference(q, x), rtol=1e-5, atol=1e-4)


@needs_correct_int_mm
def test_float32_sums_of_int8_codes_are_exact_up_to_2_pow_24():
    # 1024 products of -128 x -128 sum to 2^24 exactly: the worst case below which float32
    # accumulation cannot round; random extreme codes must match _int_mm bit for bit
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (32, 1024), generator=gen, dtype=torch.int8)
    codes[0] = -128
    weight = torch.randint(-128, 128, (40, 1024), generator=gen, dtype=torch.int8)
    weight[0] = -128
    exact = torch._int_mm(codes, weight.t())
    assert exact[0, 0] == 2 ** 24
    assert torch.equal((codes.float() @ weight.t().float()).to(torch.int32), exact)


@pytest.mark.parametrize("env, expected", [
    pytest.param({"LOWBIT_CPU_INT8": "native"}, True, marks=needs_correct_int_mm),
    ({"LOWBIT_CPU_INT8": "emulated"}, False),
    ({"LOWBIT_CPU_ISA": "none"}, False),  # a forced lesser CPU has no VNNI
])
def test_cpu_path_follows_int8_capability(env, expected, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _, q = _qlinear(IntScheme(8, strategy="channel"))
    input_quant.enable_input_quant(q, InputQuant())
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))
    calls = []
    real_int_mm = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape) or real_int_mm(a, b))
    y = q(x)
    assert activation.int_mm_fast(q, x) == expected and bool(calls) == expected
    assert activation.product_path("cpu").startswith("torch._int_mm") == expected  # what the step records
    torch.testing.assert_close(y, _fake_quant_reference(q, x), rtol=1e-5, atol=1e-4)


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
    assert not activation.plain_int8_grid(q)
    torch.testing.assert_close(q(x), _fake_quant_reference(q, x), rtol=1e-5, atol=1e-4)


def test_static_step_calibrates_documented_buffer():
    model = make_tiny_model("llama")
    batches = torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(0))
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: batches)
    rtn.apply(ctx, rtn.RTNConfig(IntScheme(8, strategy="channel")))
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
    rtn.apply(ctx, rtn.RTNConfig(IntScheme(8, strategy="channel")))
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
