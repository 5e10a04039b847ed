"""GPTQ: the pure core against RTN, act-order round trips, Hessian masking, damping, apply()."""
from __future__ import annotations

import pytest
import torch

from lowbit.quantize.grids.integer import IntScheme, fake_quantize, quantize_rtn
from lowbit.calibrate.arch import arch_for, decoder_layers
from lowbit.calibrate.hardware import cpu_info
from lowbit.calibrate.walker import capture_first_layer_inputs, record_linear_inputs
from lowbit.quantize.steps import gptq, gptq_solver
from lowbit.quantize.grids.scale_search import search_scale_zero
from lowbit.quantize.steps.gptq import GPTQConfig
from lowbit.quantize.steps.gptq_solver import HessianAccumulator, gptq_solve, quantize_weight
from lowbit.quantize.steps.layerwise import resolve_forward_dtype
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.quantize.steps.context import StepContext
from tiny_models import make_tiny_model


def _correlated(tokens=2048, cols=128, rows=64, seed=0):
    """Inputs with correlated features and a few loud channels, as real activations have."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=gen) / cols**0.5
    X = torch.randn(tokens, cols, generator=gen) @ mix + 0.05 * torch.randn(tokens, cols, generator=gen)
    X[:, :4] *= 8
    W = torch.randn(rows, cols, generator=gen)
    acc = HessianAccumulator(cols)
    acc.add(X)
    return X, W, acc.take()


def _output_error(X, W, Q):
    return float(((X @ (W - Q).t()) ** 2).mean())


@pytest.mark.parametrize("cfg", [
    GPTQConfig(scheme=IntScheme(4, True, "group", 32), actorder="none"),
    GPTQConfig(scheme=IntScheme(4, False, "group", 32), actorder="static"),
    GPTQConfig(scheme=IntScheme(3, True, "channel", None), actorder="group"),
    GPTQConfig(scheme=IntScheme(4, True, "group", 32), actorder="group", batch_columns=32),
    GPTQConfig(scheme=IntScheme(4, True, "group", 32), actorder="static", scale_search="mse"),
    GPTQConfig(scheme=IntScheme(4, False, "group", 32), actorder="none", scale_search="mse"),
])
def test_gptq_beats_rtn_on_output_error(cfg):
    X, W, H = _correlated()
    gptq_error = _output_error(X, W, quantize_weight(W, H, cfg).dequantize())
    rtn_error = _output_error(X, W, quantize_rtn(W, cfg.scheme).dequantize())
    assert gptq_error < 0.6 * rtn_error


def test_mse_scale_search_clips_an_outlier():
    gen = torch.Generator().manual_seed(0)
    groups = torch.rand(16, 4, 32, generator=gen) * 2 - 1
    groups[:, :, 0] = -4.0  # one outlier per group: min/max scales spend the grid on it
    weight = torch.ones(4, 32)
    scheme = GPTQConfig(scheme=IntScheme(4, True, "group", 32)).scheme
    scale, zero = search_scale_zero(groups, weight, scheme)
    minmax = groups.abs().amax(dim=-1) / 7.5
    assert zero is None and bool((scale < minmax).all())

    def error(s):
        return float((fake_quantize(groups, s[..., None], None, scheme.qmin, scheme.qmax) - groups).square().sum())
    assert error(scale) < error(minmax)


@pytest.mark.parametrize("actorder", ["static", "group"])
def test_act_order_with_groups_round_trips(actorder):
    X, W, H = _correlated(cols=96)
    cfg = GPTQConfig(scheme=IntScheme(4, False, "group", 32), actorder=actorder)
    qw = quantize_weight(W, H, cfg)
    assert (qw.g_idx is not None) == (actorder == "group")  # static needs no runtime permutation
    if qw.g_idx is not None:
        assert torch.bincount(qw.g_idx).tolist() == [32, 32, 32]  # each group holds group_size columns
        assert not torch.equal(qw.g_idx, torch.arange(96) // 32)  # loud columns moved groups
    scale = qw.scale[:, qw.g_idx] if qw.g_idx is not None else qw.scale.repeat_interleave(32, dim=1)
    zero = qw.zero[:, qw.g_idx] if qw.g_idx is not None else qw.zero.repeat_interleave(32, dim=1)
    dequant = qw.dequantize()
    assert torch.equal(fake_quantize(dequant, scale, zero, qw.scheme.qmin, qw.scheme.qmax), dequant)
    # and through the runtime module and back
    module = QuantLinear.from_quantized(qw, None)
    assert torch.equal(module.dequantized_weight(), dequant)
    assert int(qw.codes.min()) >= qw.scheme.qmin and int(qw.codes.max()) <= qw.scheme.qmax


def test_padded_tokens_leave_hessian_unchanged(tiny_llama):
    arch = arch_for(tiny_llama)
    layer = decoder_layers(tiny_llama, arch)[0]
    gen = torch.Generator().manual_seed(0)
    short, long = torch.randint(3, 512, (1, 7), generator=gen), torch.randint(3, 512, (1, 12), generator=gen)

    def hessian(batches):
        acc = HessianAccumulator(256)  # down_proj reads the intermediate size
        for ids, mask in batches:
            inputs = capture_first_layer_inputs(tiny_llama, arch, ids, attention_mask=mask)
            record_linear_inputs(layer, ["mlp.down_proj"], inputs, None, lambda n, x: acc.add(x))
        return acc.take(), acc.tokens

    padded = torch.cat([torch.cat([short, torch.zeros(1, 5, dtype=torch.long)], 1), long])
    mask = torch.ones_like(padded)
    mask[0, 7:] = 0  # right padding after the short sample
    H_padded, n_padded = hessian([(padded, mask)])
    H_alone, n_alone = hessian([(short, None), (long, None)])
    assert n_padded == n_alone == 19
    torch.testing.assert_close(H_padded, H_alone, rtol=1e-4, atol=1e-5)


def test_damping_retry_on_singular_hessian():
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(8, 64, generator=gen)  # 8 tokens, 64 features: rank 8
    H = 2 * X.t() @ X / 8
    H -= 2e-3 * H.diagonal().mean() * torch.eye(64)  # slightly indefinite, as rounding can leave it
    W = torch.randn(16, 64, generator=gen)
    result = gptq_solve(W, H, GPTQConfig(scheme=IntScheme(4, True, "channel", None), dampening_frac=1e-4))
    assert result.retries >= 1 and result.dampening_frac > 2e-3
    assert torch.isfinite(result.weight.dequantize()).all()


def test_dead_inputs_are_zeroed():
    X, W, H = _correlated(cols=64)
    H[5, :], H[:, 5] = 0, 0  # an input feature that is always zero
    qw = quantize_weight(W, H, GPTQConfig(scheme=IntScheme(4, True, "group", 32)))
    assert torch.all(qw.dequantize()[:, 5] == 0)


def test_config_rejects_bad_options():
    with pytest.raises(ValueError, match="group_size"):
        GPTQConfig(scheme=IntScheme(4, True, "group", None))
    with pytest.raises(ValueError, match="bits"):
        GPTQConfig(scheme=IntScheme(9, True, "group", 128))


def test_apply_on_tiny_model(tiny_llama):
    model = tiny_llama
    ids = torch.randint(3, 512, (8, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: ids)
    cfg = GPTQConfig(scheme=IntScheme(4, True, "group", 32), actorder="group", micro_batch=3)
    result = gptq.apply(ctx, cfg)
    arch = ctx.arch
    expected = [f"{arch.layers}.{i}.{n}" for i in range(2) for n in arch.linears]
    assert result["quantized"] == expected
    assert all(isinstance(model.get_submodule(n), QuantLinear) for n in expected)
    assert [layer["layer"] for layer in result["layers"]] == [f"{arch.layers}.{i}" for i in range(2)]
    losses = {n: s["loss"] for layer in result["layers"] for n, s in layer["linears"].items()}
    assert sorted(losses) == sorted(expected) and all(v >= 0 for v in losses.values())
    with torch.no_grad():
        quantized = model(input_ids=ids).logits
    assert torch.isfinite(quantized).all()
    assert not torch.equal(quantized, reference)
    assert float((quantized - reference).abs().mean()) < 0.5 * float(reference.abs().mean())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_apply_on_cuda_matches_cpu():
    import copy

    from lowbit.calibrate.arch import arch_for as _arch_for
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    twin = copy.deepcopy(model)
    ids = torch.randint(3, 512, (6, 32), generator=torch.Generator().manual_seed(6))
    cfg = GPTQConfig(scheme=IntScheme(4, True, "group", 32), actorder="group")
    gptq.apply(StepContext(model, _arch_for(model), ("lm_head",), lambda: ids), cfg)
    gptq.apply(StepContext(twin, _arch_for(twin), ("lm_head",), lambda: ids, device=torch.device("cuda")), cfg)
    assert {t.device.type for t in [*twin.parameters(), *twin.buffers()]} == {"cpu"}
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, twin(input_ids=ids).logits
    # rounding differs between devices for a few codes; the models must still agree closely
    assert float((a - b).abs().mean()) < 0.05 * float(a.abs().mean())


def test_bf16_forwards_quantize_about_as_well_as_float32(tiny_llama):
    """The bf16 calibration forwards (the default where bf16 matmuls are fast) solve the same
    float32 weights against nearly the same Hessians: the quantized model is about as close to
    the float one (rounding choices differ, so the two quantized models differ like any two)."""
    import copy

    ids = torch.randint(3, 512, (8, 32), generator=torch.Generator().manual_seed(4))
    twin = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        reference = tiny_llama(input_ids=ids).logits
    for model, dtype in ((tiny_llama, "float32"), (twin, "bfloat16")):
        cfg = GPTQConfig(scheme=IntScheme(4, True, "group", 32), forward_dtype=dtype)
        result = gptq.apply(StepContext(model, arch_for(model), ("lm_head",), lambda: ids), cfg)
        assert result["forward_dtype"] == dtype
    with torch.no_grad():
        a, b = tiny_llama(input_ids=ids).logits, twin(input_ids=ids).logits
    error_fp32, error_bf16 = float((a - reference).abs().mean()), float((b - reference).abs().mean())
    assert error_bf16 < 1.25 * error_fp32


@pytest.mark.parametrize("env, expected", [
    ({"LOWBIT_CPU_BF16": "native"}, torch.bfloat16),
    ({"LOWBIT_CPU_BF16": "emulated"}, torch.float32),
    ({"LOWBIT_CPU_ISA": "none"}, torch.float32),  # a forced lesser CPU has no bf16 (ARM-like, pre-AVX2)
])
def test_forward_dtype_auto_follows_the_cpu_description(monkeypatch, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cpu_info().bf16_native == (expected == torch.bfloat16)
    assert resolve_forward_dtype("auto", "cpu") == expected
    # an explicit dtype is taken as written, whatever the CPU
    assert resolve_forward_dtype("float32", "cpu") == torch.float32
    assert resolve_forward_dtype("bfloat16", "cpu") == torch.bfloat16


def test_forward_dtype_auto_is_recorded_and_printed(monkeypatch, tiny_llama, capsys):
    monkeypatch.setenv("LOWBIT_CPU_BF16", "emulated")
    ids = torch.randint(0, tiny_llama.config.vocab_size, (2, 16))
    cfg = GPTQConfig(scheme=IntScheme(4, True, "group", 32))
    result = gptq.apply(StepContext(tiny_llama, arch_for(tiny_llama), ("lm_head",), lambda: ids), cfg)
    assert result["forward_dtype"] == "float32"
    assert "forward dtype float32 (auto on CPU:" in capsys.readouterr().err
    with pytest.raises(ValueError, match="forward_dtype"):
        GPTQConfig(forward_dtype="fp16")


@pytest.mark.parametrize("true_sequential", [False, True])
def test_down_proj_is_solved_last_with_the_rest_of_its_layer_let_go(monkeypatch, true_sequential):
    """The step's peak is down_proj's solve: by then (no true_sequential) the layer's other linears
    are quantized modules and their Hessians gone, and the solve's weight copy is the only float one
    left. With true_sequential the float linears stay until the layer is done (later groups read them)."""
    model = make_tiny_model("llama")
    layer = decoder_layers(model, arch_for(model))[0]
    real, seen = gptq_solver.gptq_solve, []

    def watched(W, H, cfg):
        first_down = H.columns == model.config.intermediate_size and not seen  # layer 0's down_proj
        if first_down:
            seen.append(sorted(n for n, m in layer.named_modules() if isinstance(m, QuantLinear)))
        result = real(W, H, cfg)
        if first_down:
            seen.append(layer.mlp.down_proj.weight.is_meta)
        return result

    monkeypatch.setattr(gptq_solver, "gptq_solve", watched)
    ids = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    cfg = GPTQConfig(scheme=IntScheme(4, True, "group", 32), true_sequential=true_sequential)
    gptq.apply(StepContext(model, arch_for(model), ["lm_head"], lambda: ids), cfg)
    others = sorted([f"self_attn.{c}_proj" for c in "qkvo"] + ["mlp.gate_proj", "mlp.up_proj"])
    assert seen == ([others, True] if not true_sequential else [[], False])
    assert isinstance(layer.mlp.down_proj, QuantLinear)
