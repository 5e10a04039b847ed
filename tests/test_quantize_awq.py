"""AWQ: the scale and clip searches beat plain RTN on inputs with outlier channels, deterministically."""
from __future__ import annotations

import torch

from lowbit.calibrate.arch import arch_for, decoder_layers
from lowbit.quantize.steps import awq
from lowbit.quantize.steps import rtn
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.steps.smoothing import PairError, weight_quantizer
from lowbit.quantize.steps.context import StepContext

from tiny_models import make_tiny_model

CFG = awq.AWQConfig(scheme=IntScheme(4, True, "group", 32), grid=10, clip_grid=10)


def outlier_inputs(tokens=512, channels=128, seed=0):
    """Gaussian activations with 10% of channels scaled x10."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=gen)
    outliers = torch.randperm(channels, generator=gen)[: channels // 10]
    x[:, outliers] *= 10
    return x


def test_scale_search_beats_rtn_on_outlier_channels():
    x = outlier_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    error = PairError(x, [w], weight_quantizer(CFG.scheme))
    x_mean = x.abs().mean(dim=0)
    w_mean = awq.weight_magnitude([w], CFG.scheme)
    scale, ratio = awq.search_scale(x_mean, w_mean, error, CFG)
    assert ratio is not None  # some scaling was better than none
    assert error(scale) < 0.8 * error(torch.ones(128))
    again, ratio2 = awq.search_scale(x_mean, w_mean, error, CFG)
    assert torch.equal(scale, again) and ratio == ratio2


def test_clip_search_lowers_group_output_error():
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(2))
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    w[0, 5] = 12.0  # one large weight stretches its group's grid
    quant = weight_quantizer(CFG.scheme)
    gram = awq.group_gram(x, CFG.scheme)
    clipped = awq.search_clip(w, gram, CFG.scheme, CFG)
    assert not torch.equal(clipped, w)
    err = lambda v: (x @ quant(v).t() - x @ w.t()).pow(2).mean()
    assert err(clipped) < err(w)
    assert torch.equal(clipped, awq.search_clip(w, gram, CFG.scheme, CFG))


def test_group_gram_gives_each_groups_output_error():
    """dᵀ C_g d equals the mean square of x_g · d over the tokens, group by group."""
    gen = torch.Generator().manual_seed(6)
    x, d = torch.randn(300, 128, generator=gen), torch.randn(5, 128, generator=gen)
    gram = awq.GroupGram(CFG.scheme)
    gram.update(x[:100])
    gram.update(x[100:])  # accumulated over micro-batches
    C = gram.result()
    dg = d.reshape(5, 4, 32)
    direct = torch.einsum("ngk,ogk->nog", x.reshape(300, 4, 32), dg).pow(2).mean(dim=0)
    via_gram = torch.einsum("ogk,gkl,ogl->og", dg, C, dg)
    torch.testing.assert_close(via_gram, direct, rtol=1e-4, atol=1e-5)


def _outlier_llama():
    model = make_tiny_model("llama")
    gen = torch.Generator().manual_seed(4)
    for layer in decoder_layers(model, arch_for(model)):
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            idx = torch.randperm(128, generator=gen)[:13]
            norm.weight.data[idx] *= 10  # 10% outlier input channels for q/k/v and gate/up
    return model


def _logit_error(model, reference, ids):
    with torch.no_grad():
        return (model(ids).logits - reference).pow(2).mean().item()


def test_awq_then_rtn_beats_rtn_on_tiny_model_and_is_deterministic():
    ids = torch.randint(3, 512, (4, 32), generator=torch.Generator().manual_seed(5))
    scheme = IntScheme(4, strategy="group", group_size=32)
    plain = _outlier_llama()
    with torch.no_grad():
        reference = plain(ids).logits
    rtn.apply(StepContext(plain, arch_for(plain), ("lm_head",), lambda: ids), rtn.RTNConfig(scheme))
    results, errors, states = [], [], []
    for _ in range(2):
        model = _outlier_llama()
        ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: ids)
        results.append(awq.apply(ctx, awq.AWQConfig(scheme=IntScheme(4, True, "group", 32), grid=8, clip_grid=8)))
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        rtn.apply(ctx, rtn.RTNConfig(scheme))
        errors.append(_logit_error(model, reference, ids))
    assert errors[0] < _logit_error(plain, reference, ids)
    assert results[0] == results[1] and errors[0] == errors[1]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_awq_scaling_without_quantization_keeps_function():
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(6))
    model = make_tiny_model("qwen2")
    with torch.no_grad():
        before = model(ids).logits
    awq.apply(StepContext(model, arch_for(model), ("lm_head",), lambda: ids),
              awq.AWQConfig(scheme=IntScheme(4, True, "group", 32), grid=3, clip=False))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)


def test_awq_composes_with_gptq():
    from lowbit.quantize.steps import gptq
    from lowbit.quantize.runtime.qlinear import QuantLinear

    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(7))
    model = _outlier_llama()
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: ids)
    awq.apply(ctx, awq.AWQConfig(scheme=IntScheme(4, True, "group", 32), grid=3, clip_grid=2))
    gptq.apply(ctx, gptq.GPTQConfig(scheme=IntScheme(4, True, "group", 32)))
    assert isinstance(model.get_submodule("model.layers.1.mlp.down_proj"), QuantLinear)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_leading_sequences_slices_per_sample_kwargs_only():
    from lowbit.calibrate.walker import LayerInputs

    hidden = [torch.randn(4, 8, 16), torch.randn(4, 8, 16)]
    mask = torch.zeros(4, 1, 8, 8)
    shared = (torch.randn(1, 8, 4), torch.arange(8))  # a broadcast rotary table, a 1-d position
    inputs = LayerInputs(hidden, [{"attention_mask": mask, "rot": shared}] * 2, [None, None])
    sample = awq.leading_sequences(inputs, max_tokens=20)  # 20 tokens: three whole sequences
    assert len(sample.hidden) == 1 and torch.equal(sample.hidden[0], hidden[0][:3])
    assert sample.kwargs[0]["attention_mask"].shape[0] == 3
    assert sample.kwargs[0]["rot"][0] is shared[0] and sample.kwargs[0]["rot"][1] is shared[1]
    assert len(awq.leading_sequences(inputs, max_tokens=40).hidden) == 2


def test_scales_are_judged_on_the_block_each_pair_feeds():
    model = make_tiny_model("llama")
    arch = arch_for(model)
    layer = decoder_layers(model, arch)[0]
    targets = {p.prev: awq.block_targets(layer, p) for p in arch.smooth}
    assert targets == {"input_layernorm": ["self_attn"], "self_attn.v_proj": ["self_attn.o_proj"],
                       "post_attention_layernorm": ["mlp"], "mlp.up_proj": ["mlp.down_proj"]}


def test_clip_layer_reads_every_token_or_a_stride_and_shares_one_gram_per_input(monkeypatch):
    from lowbit.calibrate.walker import capture_first_layer_inputs

    ids = torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(8))  # 64 tokens
    model = make_tiny_model("llama")
    arch = arch_for(model)
    inputs = capture_first_layer_inputs(model, arch, ids)
    layer = decoder_layers(model, arch)[0]
    rows_seen = []
    update = awq.GroupGram.update

    def counting_update(self, x2d):
        rows_seen.append(x2d.shape[0])
        update(self, x2d)

    monkeypatch.setattr(awq.GroupGram, "update", counting_update)
    for clip_tokens, rows in ((None, 64), (16, 16)):
        rows_seen.clear()
        cfg = awq.AWQConfig(scheme=IntScheme(4, True, "group", 32), clip_tokens=clip_tokens)
        clipped = awq.clip_layer(layer, arch, "model.layers.0", inputs, None, cfg, ())
        assert "mlp.down_proj" in clipped and "self_attn.q_proj" not in clipped
        # inputs of v_proj, o_proj, gate+up (one tensor, one Gram) and down_proj
        assert rows_seen == [rows] * 4


def test_group_gram_is_float32_inside_a_bf16_autocast():
    """GroupGram is fed from hooks inside the layer forwards' bf16 autocast: its sums stay float32."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(7))
    plain, cast = awq.GroupGram(CFG.scheme), awq.GroupGram(CFG.scheme)
    plain.update(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast.update(x)
    assert torch.equal(cast.result(), plain.result())
