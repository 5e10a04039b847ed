"""FP8 primitives, FP8Linear and the fp8 step."""
from __future__ import annotations

import pytest
import torch

from lowbit.quantize.grids.fp8 import FP8Scheme
from lowbit.quantize.grids.integer import IntScheme
from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.observers import linear_input_absmax
from lowbit.quantize.steps import fp8 as fp8_step
from lowbit.quantize.grids.fp8 import (block_absmax, dynamic_token_scale, fp8_max, quantize_activation,
                                 quantize_weight_fp8, saturating_cast)
from lowbit.quantize.runtime.fp8_linear import FP8Linear
from lowbit.quantize.steps.gptq import GPTQConfig
from lowbit.quantize.steps.gptq_solver import gptq_solve_fp8
from lowbit.quantize.steps.context import StepContext
from lowbit.recipes.schema import load_recipe

E4M3_REL = 2.0 ** -4  # half a unit in the last place of a 3-bit mantissa, with margin


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_saturating_cast_clamps_instead_of_overflowing(fmt):
    m = fp8_max(fmt)
    x = torch.tensor([10 * m, -10 * m, 1e30, -1e30, m, 0.5])
    y = saturating_cast(x, fmt).float()
    assert torch.isfinite(y).all()
    assert y[:4].abs().eq(m).all() and y[0] > 0 and y[1] < 0
    assert y[4] == m and y[5] == 0.5


def test_plain_e5m2_cast_overflows_which_is_why_we_clamp():
    assert torch.isinf(torch.tensor([1e6]).to(torch.float8_e5m2).float()).all()


@pytest.mark.parametrize("strategy,scale_shape", [("tensor", (1, 1)), ("channel", (40, 1)), ("block", (1, 3))])
def test_weight_roundtrip_error_is_within_fp8_precision(strategy, scale_shape):
    torch.manual_seed(0)
    w = torch.randn(40, 300)
    fw = quantize_weight_fp8(w, strategy, "e4m3", block=128)
    assert fw.data.dtype == torch.float8_e4m3fn and tuple(fw.scale.shape) == scale_shape
    err = (fw.dequantize() - w).abs()
    # normal numbers: relative error; tiny ones fall in the subnormal range, bounded by its step
    assert (err <= w.abs() * E4M3_REL + fw.scale.max() * 2.0 ** -9).all()


def test_channel_scale_maps_each_row_maximum_to_the_format_max():
    w = torch.randn(8, 64) * torch.arange(1, 9).unsqueeze(1)
    fw = quantize_weight_fp8(w, "channel", "e4m3")
    assert torch.allclose(fw.data.float().abs().amax(dim=1), torch.full((8,), fp8_max("e4m3")))


def test_block_scales_keep_an_outlier_local():
    torch.manual_seed(0)
    w = torch.randn(256, 256)
    w[0, 0] = 1e5  # pushes the other blocks into the subnormal range under one tensor scale
    assert block_absmax(w, 128).shape == (2, 2)
    block_err = (quantize_weight_fp8(w, "block", "e4m3", 128).dequantize() - w)[128:, 128:].abs().mean()
    tensor_err = (quantize_weight_fp8(w, "tensor", "e4m3").dequantize() - w)[128:, 128:].abs().mean()
    assert block_err < tensor_err / 4


def test_dynamic_token_scale_uses_each_tokens_range():
    x = torch.randn(3, 5, 16) * torch.tensor([1.0, 10.0, 100.0]).reshape(3, 1, 1)
    q = quantize_activation(x, dynamic_token_scale(x, "e4m3"), "e4m3").float()
    assert torch.allclose(q.abs().amax(dim=-1), torch.full((3, 5), fp8_max("e4m3")))


@pytest.mark.parametrize("activations", ["dynamic", "static", "none"])
def test_fp8_linear_reference_path_is_close_to_float(activations):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(4, 7, 64)
    scale = x.abs().amax() / fp8_max("e4m3") if activations == "static" else None
    q = FP8Linear.from_weight(quantize_weight_fp8(lin.weight.data), lin.bias, activations, scale)
    assert not q.can_use_scaled_mm(x)  # CPU: the reference path
    ref = lin(x)
    assert (q(x) - ref).norm() / ref.norm() < 0.05


def test_static_requires_an_input_scale():
    fw = quantize_weight_fp8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="input_scale"):
        FP8Linear.from_weight(fw, None, "static")


def test_linear_input_absmax_matches_the_observed_inputs(tiny_llama):
    name = "model.layers.1.mlp.down_proj"
    seen = []
    handle = tiny_llama.get_submodule(name).register_forward_pre_hook(
        lambda m, a: seen.append(a[0].abs().amax(dim=(0, 1))))
    batches = torch.randint(3, 500, (5, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for row in batches:
            tiny_llama(input_ids=row[None])
    handle.remove()
    absmax = linear_input_absmax(tiny_llama, [name], batches, micro_batch=2)
    assert absmax[name].shape == (256,)  # per input channel
    assert torch.allclose(absmax[name], torch.stack(seen).amax(dim=0))


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_fp8_step_replaces_linears_and_keeps_logits_close(tiny_llama, activations):
    batches = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = tiny_llama(input_ids=batches).logits
    cfg = fp8_step.FP8Config(scheme=FP8Scheme(strategy="channel"), activations=activations)
    detail = fp8_step.apply(StepContext(tiny_llama, arch_for(tiny_llama), ("lm_head",), lambda: batches), cfg)
    assert len(detail["quantized"]) == 14 and "lm_head" in detail["ignored"]
    q = tiny_llama.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q, FP8Linear) and q.weight.dtype == torch.float8_e4m3fn
    assert (q.input_scale is not None) == (activations == "static")
    with torch.no_grad():
        out = tiny_llama(input_ids=batches).logits
    assert torch.isfinite(out).all()
    assert (out - ref).norm() / ref.norm() < 0.1


@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8-static", "fp8-dynamic-kv-fp8", "fp8-dynamic-gptq"])
def test_shipped_fp8_recipes_parse(name):
    recipe = load_recipe(name)
    assert recipe.steps[0].name == "fp8"


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_gptq_rounding_onto_fp8_beats_nearest_on_output_error(strategy):
    """GPTQ's error feedback works on the FP8 grid too: same scales as nearest rounding, every
    value on the grid, and a lower output error on correlated inputs."""
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(256, 256, generator=gen) / 16
    X = torch.randn(4096, 256, generator=gen) @ mix + 0.05 * torch.randn(4096, 256, generator=gen)
    X[:, :4] *= 8
    W = torch.randn(160, 256, generator=gen)
    H = 2 * X.t() @ X / X.shape[0]
    cfg = GPTQConfig(dampening_frac=0.01, actorder="static")
    fw, row_loss, _, retries = gptq_solve_fp8(W, H, cfg, strategy, "e4m3", block=128)
    nearest = quantize_weight_fp8(W, strategy, "e4m3", 128)
    assert fw.data.dtype == torch.float8_e4m3fn and retries == 0
    assert torch.equal(fw.scale, nearest.scale)
    err = lambda Q: float(((X @ (W - Q).t()) ** 2).mean())
    assert err(fw.dequantize()) < 0.7 * err(nearest.dequantize())
    assert row_loss.shape == (160,) and torch.isfinite(row_loss).all()


def test_fp8_step_gptq_rounding_walks_layers_and_records_losses(tiny_llama):
    batches = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = tiny_llama(input_ids=batches).logits
    cfg = fp8_step.FP8Config(scheme=FP8Scheme(strategy="channel"), activations="dynamic", rounding="gptq")
    detail = fp8_step.apply(StepContext(tiny_llama, arch_for(tiny_llama), ("lm_head",), lambda: batches), cfg)
    assert detail["rounding"] == "gptq" and detail["round_to_nearest"] == []
    losses = {n: s["loss"] for layer in detail["layers"] for n, s in layer["linears"].items()}
    assert set(losses) == set(detail["quantized"]) and all(v >= 0 for v in losses.values())
    q = tiny_llama.get_submodule("model.layers.1.mlp.down_proj")
    assert isinstance(q, FP8Linear) and q.weight.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        out = tiny_llama(input_ids=batches).logits
    assert torch.isfinite(out).all() and (out - ref).norm() / ref.norm() < 0.1


def test_fp8_gptq_rounding_rejects_group_act_order():
    with pytest.raises(ValueError, match="actorder"):
        gptq_solve_fp8(torch.randn(8, 16), torch.eye(16), GPTQConfig(scheme=IntScheme(4, True, "group", 16), actorder="group"))
