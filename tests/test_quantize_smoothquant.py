"""SmoothQuant: smoothing lowers W8A8 output error on inputs with outlier channels; searches are deterministic."""
from __future__ import annotations

import pytest
import torch

from lowbit.calibrate.arch import arch_for, decoder_layers
from lowbit.quantize.steps import int8_inputs as input_quant
from lowbit.quantize.steps import rtn
from lowbit.quantize.steps import smoothquant
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.steps.smoothing import PairError, per_token_int8, weight_quantizer
from lowbit.quantize.steps.context import StepContext

from tiny_models import make_tiny_model

W8 = IntScheme(8, strategy="channel")


def outlier_inputs(tokens=512, channels=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=gen)
    x[:, torch.randperm(channels, generator=gen)[: channels // 10]] *= 10  # 10% outlier channels
    return x


def test_smoothing_lowers_w8a8_error_on_outlier_channels():
    x = outlier_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    error = PairError(x, [w], weight_quantizer(W8), per_token_int8)
    s = smoothquant.smooth_scale(x.abs().amax(dim=0), w.abs().amax(dim=0), 0.5)
    assert error(s) < 0.5 * error(torch.ones(128))


def test_alpha_grid_picks_the_lowest_error_deterministically():
    x = outlier_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    error = PairError(x, [w], weight_quantizer(W8), per_token_int8)
    cfg = smoothquant.SmoothQuantConfig(alpha_grid=(0.0, 0.25, 0.5, 0.75))
    index = torch.arange(128)
    s, alpha = smoothquant.choose_scale(x.abs().amax(dim=0), [w], index, 128, cfg, error)
    losses = {a: error(smoothquant.smooth_scale(x.abs().amax(dim=0), w.abs().amax(dim=0), a))
              for a in cfg.alpha_grid}
    assert alpha == min(losses, key=losses.get)
    assert torch.equal(s, smoothquant.choose_scale(x.abs().amax(dim=0), [w], index, 128, cfg, error)[0])


def _outlier_model(model_type):
    model = make_tiny_model(model_type)
    gen = torch.Generator().manual_seed(4)
    arch = arch_for(model)
    for layer in decoder_layers(model, arch):
        for pair in arch.smooth[::2]:  # the norms before attention and the MLP
            norm = layer.get_submodule(pair.prev)
            norm.weight.data[torch.randperm(128, generator=gen)[:13]] += 10 * (1 + arch.norm_offset)
    return model


def _w8a8_logit_error(model, reference, ids):
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: ids)
    rtn.apply(ctx, rtn.RTNConfig(W8))
    input_quant.apply(ctx, input_quant.InputQuantConfig())
    with torch.no_grad():
        return (model(ids).logits - reference).pow(2).mean().item()


@pytest.mark.parametrize("model_type", ["llama", "opt"])
def test_smoothquant_beats_plain_w8a8_on_tiny_model(model_type):
    ids = torch.randint(3, 512, (4, 32), generator=torch.Generator().manual_seed(5))
    plain = _outlier_model(model_type)
    with torch.no_grad():
        reference = plain(ids).logits
    smoothed = _outlier_model(model_type)
    smoothquant.apply(StepContext(smoothed, arch_for(smoothed), ("lm_head",), lambda: ids),
                      smoothquant.SmoothQuantConfig(alpha=0.5))
    with torch.no_grad():  # smoothing alone is exact
        torch.testing.assert_close(smoothed(ids).logits, reference, rtol=1e-4, atol=1e-4)
    assert _w8a8_logit_error(smoothed, reference, ids) < _w8a8_logit_error(plain, reference, ids)


def test_alpha_search_on_model_is_deterministic():
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(6))
    cfg = smoothquant.SmoothQuantConfig(alpha_grid=(0.3, 0.5, 0.7))
    runs = []
    for _ in range(2):
        model = _outlier_model("llama")
        runs.append(smoothquant.apply(StepContext(model, arch_for(model), ("lm_head",), lambda: ids), cfg))
    assert runs[0]["alphas_chosen"] == runs[1]["alphas_chosen"]
    assert all(a in cfg.alpha_grid for layer in runs[0]["alphas_chosen"] for a in layer.values())


def test_config_rejects_alpha_outside_unit_interval():
    with pytest.raises(ValueError, match="alpha"):
        smoothquant.SmoothQuantConfig(alpha=1.5)
