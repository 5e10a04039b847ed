"""The rotate step: Hadamard matrices as built, a rotated float model computing the original's
logits (norms folded, a tied head untied), refusal of what it cannot rotate, and rotated runs that
export a checkpoint plain transformers loads to lowbit's logits."""
from __future__ import annotations

import json
import re

import pytest
import torch

from export_helpers import compare_logits, load_without_tokenizer, token_ids
from test_export_dense import assert_plain_transformers_agrees
from tiny_models import make_tiny_model, run_on_tiny_llama
from lowbit.calibrate.arch import arch_for, linear_weight
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.rotation import hadamard, hadamard_factors, orthogonal
from lowbit.quantize.steps import rotate, rtn
from lowbit.quantize.steps.context import StepContext


@pytest.mark.parametrize("n", [2, 4, 12, 20, 64, 576, 896, 2880])
def test_hadamard_rows_are_orthogonal_and_plus_or_minus_one(n):
    h = hadamard(n)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


def test_sizes_without_a_construction_are_refused_naming_the_way_out():
    assert hadamard_factors(36) is None and hadamard(9) is None and hadamard_factors(6) is None
    with pytest.raises(ValueError, match="no Hadamard matrix of order 36.*rotate: {kind: random}"):
        orthogonal(36, "hadamard", 0)


@pytest.mark.parametrize("kind", ["hadamard", "random"])
def test_rotations_are_orthogonal_and_fixed_by_the_seed(kind):
    q = orthogonal(64, kind, 3)
    assert torch.allclose(q @ q.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, orthogonal(64, kind, 3)) and not torch.equal(q, orthogonal(64, kind, 4))


def with_norm_weights(model, seed: int = 0):
    """Random norm weights (q/k norms too, which the rotation must leave alone): a rotation that forgot to
    fold one would change the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            if name.endswith("o_proj.weight"):  # one large input column, as trained models have
                param[:, 3] *= 20
    return model


def context(model, ignore=("lm_head",)):
    batches = token_ids(batch=2, length=32)
    return StepContext(model, arch_for(model), ignore, lambda: batches)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("tied", [True, False])
def test_the_rotated_float_model_computes_the_same_logits(model_type, tied):
    model = make_tiny_model(model_type)
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
        model.config.tie_word_embeddings = True
    model = with_norm_weights(model)
    original = make_tiny_model(model_type)
    original.load_state_dict(model.state_dict())
    record = rotate.apply(context(model), rotate.RotateConfig())
    ids = token_ids(batch=2, length=48, seed=5)
    agree, error = compare_logits(original, model, ids)
    assert agree == 1.0 and error < 1e-5 and record["logits_relative_error"] < 1e-5
    assert record["untied_head"] is tied and model.config.tie_word_embeddings is False
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    norms = [p for n, p in model.named_parameters() if n.endswith("layernorm.weight") or n == "model.norm.weight"]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)  # folded forward
    assert not torch.allclose(model.get_input_embeddings().weight, original.get_input_embeddings().weight)


def test_rotation_spreads_an_outlier_column_so_4_bit_rounding_loses_less():
    """A reader whose column 3 is 20x the rest: unrotated, W4 g32 spends the step of that column's
    group on it; rotated, the column's weight is spread over all columns and each group's step fits
    its weights. The function's error on isotropic inputs is the Frobenius norm of the weight error
    (the rotation keeps norms), measured against the weight as the model computes with it (norm folded)."""
    grid = IntScheme(bits=4, symmetric=True, strategy="group", group_size=32)
    model = with_norm_weights(make_tiny_model("llama"))
    names = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.gate_proj")
    norms = ("model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm")
    with torch.no_grad():
        for name in names:
            linear_weight(model.get_submodule(name))[:, 3] *= 20
    computed = {n: linear_weight(model.get_submodule(n)) * model.get_submodule(m).weight for n, m in zip(names, norms)}
    plain = {n: ((grid.round(linear_weight(model.get_submodule(n)), n).dequantize() - linear_weight(model.get_submodule(n)))
                 * model.get_submodule(m).weight).norm() for n, m in zip(names, norms)}
    rotate.apply(context(model), rotate.RotateConfig())
    for name in names:
        weight = linear_weight(model.get_submodule(name))
        rotated = (grid.round(weight, name).dequantize() - weight).norm()
        assert rotated < 0.5 * plain[name], (name, rotated, plain[name])
        assert torch.allclose(weight.norm(), computed[name].norm(), rtol=1e-5)  # the same weight, rotated


@pytest.mark.parametrize("model_type", ["gemma3_text", "opt"])
def test_a_model_type_it_cannot_rotate_is_refused_by_name(model_type):
    model = make_tiny_model(model_type)
    with pytest.raises(ValueError, match=f"rotate: supports the model types llama.*this model is '{model_type}'"):
        rotate.apply(context(model), rotate.RotateConfig())


def test_rotating_after_a_weight_step_is_refused():
    model = make_tiny_model("llama")
    ctx = context(model)
    rtn.apply(ctx, rtn.RTNConfig(IntScheme(bits=4, symmetric=True, strategy="group", group_size=32)))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj is already quantized; list rotate before"):
        rotate.apply(ctx, rotate.RotateConfig())


def test_a_rotation_that_changes_the_logits_stops_the_step(monkeypatch):
    model = with_norm_weights(make_tiny_model("llama"))
    monkeypatch.setattr(rotate, "READERS", {"input_layernorm": rotate.READERS["input_layernorm"]})  # MLP forgotten
    with pytest.raises(ValueError, match="rotated float model's logits differ from the original's"):
        rotate.apply(context(model), rotate.RotateConfig())


@pytest.mark.parametrize("steps", [[{"rotate": {}}, {"rtn": {}}], [{"rotate": {"seed": 1}}, {"gptq": {}}]])
def test_a_rotated_run_exports_a_checkpoint_plain_transformers_loads_to_lowbits_logits(tmp_path, steps):
    recipe = {"scheme": {"bits": 4, "strategy": "group", "group_size": 32}, "steps": steps, "export": {"format": "dense"}}
    code, out = run_on_tiny_llama(tmp_path, recipe)
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # the tiny llama was tied: its head is its own now
    results = json.loads((out / "results.json").read_text())
    rotated = results["steps"][0]
    assert rotated["name"] == "rotate" and rotated["untied_head"] is True and rotated["logits_relative_error"] < 1e-5
    assert results["audit"]["passed"] is True
    assert_plain_transformers_agrees(out, tmp_path)
    lowbit_model, _ = load_without_tokenizer(out)
    assert linear_weight(lowbit_model.lm_head).shape == lowbit_model.get_input_embeddings().weight.shape


@pytest.mark.parametrize("steps, where", [([{"rtn": {}}, {"rotate": {}}], "steps[1].rotate"),
                                          ([{"rotate": {}}, {"rotate": {"seed": 2}}], "steps[1].rotate")])
def test_a_recipe_that_rotates_after_another_step_is_refused_on_load(steps, where):
    from lowbit.recipes.schema import parse_recipe
    from lowbit.recipes.validate import RecipeError
    with pytest.raises(RecipeError, match=rf"{re.escape(where)}: must be the recipe's first step"):
        parse_recipe({"scheme": {"bits": 4, "strategy": "group", "group_size": 32}, "steps": steps}, "mine.yaml")


def test_a_recipe_that_rotates_cannot_stream():
    from lowbit.app.streamed import streaming_folder
    from lowbit.recipes.schema import parse_recipe
    recipe = parse_recipe({"model": "smollm2-135m", "calibration": {"streaming": True},
                           "scheme": {"bits": 4, "strategy": "group", "group_size": 32},
                           "steps": [{"rotate": {}}, {"rtn": {}}]}, "mine.yaml")
    with pytest.raises(ValueError, match=r"steps\[0\].rotate cannot run streamed: rotate changes the embedding"):
        streaming_folder(recipe)


def test_rotating_a_slice_of_rows_at_a_time_gives_the_whole_products_bits(monkeypatch):
    weight = torch.randn(50, 64)
    q = orthogonal(64, "hadamard", 0)
    whole = (weight.double() @ q).float()
    monkeypatch.setattr(rotate, "ROWS_AT_ONCE", 7)  # 8 slices, the last one short
    rotate.rotate_columns(weight, q)
    assert torch.equal(weight, whole)


def test_a_run_that_quantizes_the_lm_head_writes_and_audits_it(tmp_path):
    """A quantized head holds its codes as buffers, no parameters: the export's and the audit's
    portions must still count it as a module outside the layers (they once missed it)."""
    from safetensors import safe_open
    recipe = {"ignore": [], "scheme": {"formats": {"lm_head": "int8"}, "default": "int4_g32"},
              "steps": [{"rotate": {}}, {"rtn": {}}]}
    code, out = run_on_tiny_llama(tmp_path, recipe)
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    audit = results["audit"]
    assert audit["passed"] is True and audit["checked"] == 15 and audit["schemes"]["int8 sym channel"] == 1
    with safe_open(out / "model.safetensors", "pt") as f:
        head = [k for k in f.keys() if k.startswith("lm_head.")]
    assert head and "lm_head.weight" not in head  # codes and scales, not a float weight
    lowbit_model, _ = load_without_tokenizer(out)
    assert type(lowbit_model.lm_head).__name__ != "Linear"
