"""Weight steps onto GGUF grids: llama.cpp's per-tensor type mixture, round to nearest as its
reference quantizer, GPTQ onto the same blocks, the recipe grid `scheme: {gguf: …}`, the audit."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lowbit.calibrate.arch import arch_for, linear_weight
from lowbit.quantize.grids.gguf import GGUFScheme, quantize_gguf
from lowbit.quantize.grids.gguf_plan import GGUFTypes, fallback_type, linear_type, output_type, use_more_bits
from lowbit.quantize.runtime.gguf_linear import GGUFLinear
from lowbit.quantize.steps import gptq, rtn
from lowbit.quantize.steps.context import StepContext
from lowbit.recipes.schema import parse_recipe
from lowbit.app.audit import audit_run


def _model(layers=8, hidden=256, intermediate=512, seed=0):
    """Rows of 256 (attention, gate/up) and 512 (down): every K-quant fits."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _ctx(model, samples=4, seq=32):
    ids = torch.randint(0, model.config.vocab_size, (samples, seq), generator=torch.Generator().manual_seed(1))
    return StepContext(model, arch_for(model), ("lm_head",), lambda: ids)


def test_more_bits_layers_match_llama_cpp():
    # llama.cpp: i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2; for 32 layers: 0-3, 28-31, 6, 9, ...
    chosen = [i for i in range(32) if use_more_bits(i, 32)]
    assert chosen == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_q4_k_m_mixture_and_fallbacks():
    t = GGUFTypes("q4_k_m")
    assert linear_type(t, "model.layers.0.self_attn.v_proj", 0, 32, 4096) == "q6_k"
    assert linear_type(t, "model.layers.4.self_attn.v_proj", 4, 32, 4096) == "q4_k"
    assert linear_type(t, "model.layers.4.self_attn.q_proj", 4, 32, 4096) == "q4_k"
    assert linear_type(t, "model.layers.6.mlp.down_proj", 6, 32, 14336) == "q6_k"
    assert linear_type(t, "model.layers.0.self_attn.q_proj", 0, 32, 576) == "q5_0"  # 576 % 256
    assert linear_type(t, "model.layers.0.self_attn.v_proj", 0, 32, 576) == "q8_0"
    assert linear_type(GGUFTypes("q4_k_m", pure=True), "model.layers.0.self_attn.v_proj", 0, 32, 4096) == "q4_k"
    assert output_type(t, 4096) == "q6_k" and output_type(t, 576) == "q8_0"
    assert output_type(GGUFTypes("q8_0"), 4096) == "q8_0" and output_type(GGUFTypes("q4_0"), 576) == "q8_0"
    assert fallback_type("q4_0", 48) is None and fallback_type("q4_0", 64) == "q4_0"
    with pytest.raises(ValueError, match="q4_k_m"):
        GGUFTypes("q3_k")


def test_iq4_file_types_give_q5_k_where_llama_cpp_does_without_an_imatrix():
    for file_type in ("iq4_nl", "iq4_xs"):
        t = GGUFTypes(file_type)
        assert linear_type(t, "model.layers.3.mlp.down_proj", 3, 32, 14336) == "q5_k"  # first eighth: 0-3
        assert linear_type(t, "model.layers.4.mlp.down_proj", 4, 32, 14336) == file_type
        assert linear_type(t, "model.layers.9.self_attn.v_proj", 9, 32, 4096, gqa=4) == "q5_k"
        assert linear_type(t, "model.layers.9.self_attn.v_proj", 9, 32, 4096, gqa=3) == file_type
        assert linear_type(t, "model.layers.2.mlp.down_proj", 2, 30, 1536) == "q5_k"  # smollm2: 30 layers, 0-2
        assert linear_type(t, "model.layers.0.mlp.down_proj", 0, 30, 1000) is None  # no 32-block divides 1000
        assert linear_type(t, "model.layers.4.mlp.down_proj", 4, 32, 14336 + 32) == "iq4_nl"  # IQ4_XS falls back
        assert linear_type(GGUFTypes(file_type, pure=True), "model.layers.0.mlp.down_proj", 0, 32, 4096) == file_type
        assert output_type(t, 4096) == "q6_k" and output_type(t, 576) == "q8_0"


def test_slots_carry_the_models_query_heads_per_kv_head():
    from lowbit.quantize.targets import slots

    model = _model(layers=2)  # 4 heads, 2 KV heads
    (slot,) = slots(model, arch_for(model), ["model.layers.1.self_attn.v_proj"])
    assert (slot.layer, slot.layers, slot.gqa) == (1, 2, 2)


def test_rtn_is_llama_cpp_reference_per_planned_type():
    model = _model(intermediate=256)
    checked = ("model.layers.0.self_attn.v_proj", "model.layers.2.self_attn.v_proj",
               "model.layers.2.mlp.down_proj", "model.layers.7.mlp.down_proj", "model.layers.4.self_attn.q_proj")
    originals = {n: linear_weight(model.get_submodule(n)).detach().clone() for n in checked}
    result = rtn.apply(_ctx(model), rtn.RTNConfig(GGUFTypes("q4_k_m")))
    assert result["types"]["model.layers.0.self_attn.v_proj"] == "q6_k"
    assert result["types"]["model.layers.2.self_attn.v_proj"] == "q4_k"
    assert sorted(set(result["types"].values())) == ["q4_k", "q6_k"]
    assert all(isinstance(m, GGUFLinear) for n, m in model.named_modules() if n.endswith("proj"))
    for name, W in originals.items():
        module = model.get_submodule(name)
        assert isinstance(module, GGUFLinear)
        reference = quantize_gguf(W, GGUFScheme(result["types"][name]))
        assert torch.equal(module.dequantized_weight(), reference.dequantize()), name


@pytest.mark.parametrize("file_type", ["q4_0", "q4_k_m"])
def test_gptq_beats_rtn_on_layer_outputs_and_passes_the_audit(file_type):
    model, twin = _model(layers=2), _model(layers=2)
    x = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = _model(layers=2)(x).logits
    gptq.apply(_ctx(model, samples=16, seq=64), gptq.GPTQConfig(GGUFTypes(file_type), actorder="static"))
    rtn.apply(_ctx(twin), rtn.RTNConfig(GGUFTypes(file_type)))
    with torch.no_grad():
        err_gptq = float((model(x).logits - reference).square().mean())
        err_rtn = float((twin(x).logits - reference).square().mean())
    assert err_gptq < err_rtn
    recipe = parse_recipe({"scheme": {"gguf": file_type}, "steps": ["gptq"]}, "test")
    report = audit_run(model, recipe, arch_for(model), [])
    assert report.passed, report.problems
    assert sum(report.counts().values()) == 14


def test_audit_catches_a_wrong_type():
    model = _model(layers=2)
    rtn.apply(_ctx(model), rtn.RTNConfig(GGUFTypes("q4_0")))
    recipe = parse_recipe({"scheme": {"gguf": "q4_k_m"}, "steps": ["rtn"]}, "test")
    report = audit_run(model, recipe, arch_for(model), [])
    assert not report.passed
    assert any("model.layers.1.self_attn.v_proj" in p and "gguf q6_k" in p for p in report.problems)


def test_rows_no_block_fits_stay_float_and_are_listed():
    model = _model(layers=2, hidden=256, intermediate=48 * 8)  # down_proj rows of 384: q4_k -> q5_0
    result = rtn.apply(_ctx(model), rtn.RTNConfig(GGUFTypes("q4_k_m", pure=True)))
    assert result["types"]["model.layers.0.mlp.down_proj"] == "q5_0"
    assert result["types"]["model.layers.0.mlp.up_proj"] == "q4_k"


def test_recipe_grid_is_chosen_by_its_keys():
    r = parse_recipe({"scheme": {"gguf": "q4_0"}, "steps": ["rtn", ]}, "test")
    assert r.steps[0].config.scheme == GGUFTypes("q4_0")
    r = parse_recipe({"scheme": {"bits": 8}, "steps": ["rtn"]}, "test")
    assert r.steps[0].config.scheme.bits == 8
    with pytest.raises(ValueError, match="fit none of the choices"):
        parse_recipe({"scheme": {"gguf": "q4_0", "bits": 4}, "steps": ["rtn"]}, "test")
    with pytest.raises(ValueError, match="gguf file type must be one of"):
        parse_recipe({"scheme": {"gguf": "q2_k"}, "steps": ["rtn"]}, "test")


@pytest.mark.parametrize("kind", ["q4_0", "iq4_nl"])
def test_awq_clip_on_a_gguf_grid_cuts_an_outlier_that_costs_output_error(kind):
    from lowbit.quantize.steps.awq_rounded_clip import search_clip_rounded

    gen = torch.Generator().manual_seed(2)
    w = torch.randn(8, 64, generator=gen) * 0.02
    w[:, 3] = 0.5  # one outlier per row stretches its Q4_0 block's scale
    x = torch.randn(4096, 64, generator=gen)
    x[:, 3] *= 0.01  # ... on an input that barely moves the output
    gram = torch.einsum("ngk,ngl->gkl", x.reshape(-1, 2, 32), x.reshape(-1, 2, 32)) / x.shape[0]
    grid = GGUFScheme(kind)

    def output_error(v):
        return float((x @ (grid.fake_round(v) - w).t()).square().mean())

    clipped = search_clip_rounded(w, gram, grid, "weight", max_shrink=0.5, clip_grid=20)
    assert output_error(clipped) < 0.5 * output_error(w)


@pytest.mark.parametrize("file_type", ["q4_k_m", "iq4_xs"])
def test_awq_then_gptq_on_gguf_grids_runs_and_passes_the_audit(file_type):
    from lowbit.quantize.steps import awq

    model = _model(layers=2)
    ctx = _ctx(model, samples=8, seq=64)
    record = awq.apply(ctx, awq.AWQConfig(GGUFTypes(file_type), grid=4, clip_grid=4))
    assert len(record["clipped"]) > 0
    result = gptq.apply(ctx, gptq.GPTQConfig(GGUFTypes(file_type)))
    recipe = parse_recipe({"scheme": {"gguf": file_type}, "steps": ["awq", "gptq"]}, "test")
    assert audit_run(model, recipe, arch_for(model), []).passed
    if file_type == "iq4_xs":  # rows of 256 take IQ4_XS; the first eighth of 2 layers is none
        assert set(result["types"].values()) == {"iq4_xs"}
    with pytest.raises(ValueError, match="searches scales for gguf q4_0, but steps\\[1\\].gptq quantizes to gguf q4_k_m"):
        parse_recipe({"steps": [{"awq": {"scheme": {"gguf": "q4_0"}}}, {"gptq": {"scheme": {"gguf": "q4_k_m"}}}]}, "t")
