"""The coverage audit: on tiny quantized models in memory, on written checkpoints (`lowbit audit`),
and inside a run (a failed audit publishes no checkpoint)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tiny_models import make_tiny_model, save_tiny_llama
from lowbit.calibrate.arch import arch_for
from lowbit.quantize.grids import integer
from lowbit.quantize.audit import AuditError, audit_model
from lowbit.quantize.steps.context import StepContext
from lowbit.recipes.schema import parse_recipe
from lowbit.app.audit import audit_run, expected_schemes
from lowbit.app.cli import main

W4 = {"bits": 4, "symmetric": True, "strategy": "group", "group_size": 32}
QUICK = ["--set", "evaluate.baseline=false", "--set", "evaluate.kl.enabled=false",
         "--set", "evaluate.memory.measure_peak=false", "--set", "evaluate.perplexity.max_tokens=512",
         "--set", "evaluate.perplexity.context_len=256", "--set", "evaluate.perplexity.stride=256"]
DOWN = "model.layers.1.mlp.down_proj"
ATTN = "model.layers.1.self_attn"


def recipe(*steps, ignore=("lm_head",)):
    return parse_recipe({"steps": list(steps), "ignore": list(ignore)}, "test")


def quantized(r, model=None):
    """Apply the recipe's steps to a tiny llama, calibrating on random tokens."""
    from lowbit.quantize.steps.registry import STEPS

    model = model or make_tiny_model("llama")
    ids = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    ctx = StepContext(model, arch_for(model), r.ignore, lambda: ids)
    steps = [STEPS[s.name].apply(ctx, s.config) for s in r.steps]
    return model, steps


def audit(model, r, steps=()):
    return audit_run(model, r, arch_for(model), list(steps))


@pytest.fixture(scope="module")
def w4():
    r = recipe({"rtn": {"scheme": W4}})
    return r, quantized(r)[0]


def test_clean_w4_rtn_passes_and_lists_the_float_head(w4):
    r, model = w4
    report = audit(model, r)
    report.raise_if_failed()
    assert report.passed and len(report.checked) == 14
    assert report.counts() == {"int4 sym group 32": 14}
    assert "lm_head" in report.ignored["lm_head"]
    assert report.to_dict()["passed"] is True


@pytest.mark.parametrize("value, kind", [(float("nan"), "NaN"), (0.0, "zero"), (float("inf"), "inf"),
                                         (-1.0, "negative")])
def test_bad_scale_fails_naming_the_module(w4, value, kind):
    r, model = w4
    scale = model.get_submodule(DOWN).weight_scale
    saved = scale.clone()
    scale[3, 1] = value
    try:
        report = audit(model, r)
    finally:
        scale.copy_(saved)
    assert report.problems == [f"{DOWN}.weight_scale: 1 {kind} of {scale.numel()} values"]
    with pytest.raises(AuditError, match=f"{DOWN}.weight_scale"):
        report.raise_if_failed()


def test_scale_that_underflows_in_the_export_dtype_fails(w4):
    r, model = w4
    scale = model.get_submodule(DOWN).weight_scale
    saved = scale.clone()
    scale[0, 0] = 1e-9  # positive in float32, 0 in float16, fine in bfloat16
    try:
        expected, ignored, _ = expected_schemes(r, model, arch_for(model))
        f16 = audit_model(model, expected, ignored, storage_dtype=torch.float16)
        bf16 = audit_model(model, expected, ignored, storage_dtype=torch.bfloat16)
    finally:
        scale.copy_(saved)
    assert len(f16.problems) == 1 and f"{DOWN}.weight_scale" in f16.problems[0] and "float16" in f16.problems[0]
    assert bf16.passed


def test_targeted_linear_left_float_fails():
    r = recipe({"rtn": {"scheme": W4}})
    model, _ = quantized(r)
    model.set_submodule(DOWN, nn.Linear(256, 128, bias=False))
    report = audit(model, r)
    assert len(report.problems) == 1
    assert report.problems[0].startswith(f"{DOWN}: is float Linear") and "int4 sym group 32" in report.problems[0]


def test_linear_quantized_with_another_scheme_fails(w4):
    _, model = w4
    report = audit(model, recipe({"rtn": {"scheme": {**W4, "bits": 8}}}))
    assert len(report.problems) == 14
    assert any(p.startswith(f"{DOWN}: quantized as int4") and "int8" in p for p in report.problems)


def test_ignored_linear_that_was_quantized_fails():
    model, _ = quantized(recipe({"rtn": {"scheme": W4}}, ignore=()))  # lm_head quantized too
    report = audit(model, recipe({"rtn": {"scheme": W4}}))  # ... although the recipe ignores it
    assert len(report.problems) == 1 and report.problems[0].startswith("lm_head: quantized")


def test_zero_point_outside_the_code_range_fails():
    r = recipe({"rtn": {"scheme": {**W4, "symmetric": False}}})
    model, _ = quantized(r)
    assert audit(model, r).passed
    model.get_submodule(DOWN).weight_zero[0, 0] = 9  # int4 codes run -8..7
    report = audit(model, r)
    assert report.problems == [f"{DOWN}.weight_zero: 1 values outside [-8, 7]"]


def test_codes_outside_the_grid_fail(w4):
    r, model = w4
    codes = model.get_submodule(DOWN).weight_codes
    codes[5, 7] += 100  # int4 codes lie in -8..7; int8 storage holds more
    try:
        report = audit(model, r)
    finally:
        codes[5, 7] -= 100
    assert report.problems == [f"{DOWN}.weight_codes: 1 values outside [-8, 7]"]


def test_missing_or_zero_kv_scale_fails_naming_the_layer():
    r = recipe({"rtn": {"scheme": W4}}, {"kv_cache": {"format": "int8", "strategy": "head"}})
    model, _ = quantized(r)
    report = audit(model, r)
    assert report.passed and report.kv == "int8 head"
    attn = model.get_submodule(ATTN)
    v_scale = attn.v_scale
    attn.v_scale = torch.zeros_like(v_scale)
    del attn.k_scale
    report = audit(model, r)
    assert any(p.startswith(f"{ATTN}.k_scale: missing") for p in report.problems)
    assert f"{ATTN}.v_scale: 2 zero of 2 values" in report.problems
    assert len(report.problems) == 2


def test_kv_cache_missing_altogether_fails():
    r = recipe({"rtn": {"scheme": W4}}, {"kv_cache": {"format": "fp8", "strategy": "tensor"}})
    model, _ = quantized(recipe({"rtn": {"scheme": W4}}))  # the kv_cache step never ran
    report = audit(model, r)
    assert len(report.problems) == 1 and "no quantized KV cache attached" in report.problems[0]


def test_w8a8_static_inputs_are_checked():
    r = recipe({"rtn": {"scheme": {"bits": 8, "strategy": "channel"}}}, {"quantize_inputs": {"dynamic": False}})
    model, _ = quantized(r)
    report = audit(model, r)
    assert report.passed and report.counts() == {"int8 sym channel + int8 static inputs": 14}
    model.get_submodule(DOWN).input_scale[0] = float("nan")
    assert audit(model, r).problems == [f"{DOWN}.input_scale: 1 NaN of 1 values"]


def test_fp8_is_checked():
    r = recipe({"fp8": {"scheme": {"strategy": "channel"}, "activations": "dynamic"}})
    model, _ = quantized(r)
    assert audit(model, r).counts() == {"fp8 e4m3 channel, activations dynamic": 14}
    model.get_submodule(DOWN).weight_scale[0, 0] = 0.0
    assert audit(model, r).problems == [f"{DOWN}.weight_scale: 1 zero of 128 values"]
    assert audit(model, recipe({"fp8": {"scheme": {"strategy": "tensor"}}})).problems[0].startswith(
        "model.layers.0.self_attn.q_proj: quantized as fp8 e4m3 channel")


def test_smoothing_steps_expect_nothing_and_the_weight_step_decides():
    model = make_tiny_model("llama")
    g64 = {"bits": 4, "strategy": "group", "group_size": 64}
    r = recipe({"awq": {"scheme": g64}}, {"gptq": {"scheme": g64}})
    expected, ignored, kv = expected_schemes(r, model, arch_for(model))
    assert {s.describe() for s in expected.values()} == {"int4 sym group 64"} and len(expected) == 14
    assert list(ignored) == ["lm_head"] and kv is None
    _, ignored, _ = expected_schemes(recipe({"awq": {"scheme": {"bits": 4, "strategy": "group", "group_size": 32}}}), model, arch_for(model))
    assert ignored[DOWN] == "no weight step in the recipe quantizes it"


def test_damping_retries_are_named(w4):
    r, model = w4
    steps = [{"name": "gptq", "damping_retries": [{"linear": DOWN, "dampening_frac": 0.1}]}]
    report = audit(model, r, steps)
    assert report.passed and report.damping == [f"{DOWN}: Hessian needed extra damping (dampening_frac 0.1)"]
    assert any(line.startswith("damping") and DOWN in line for line in report.lines())


def test_gptq_layers_that_needed_extra_damping_are_named(monkeypatch):
    from lowbit.quantize.steps import gptq_solver

    real, calls = gptq_solver.inverse_hessian_factor, []

    def retried_once_for_the_third_hessian(H, frac, perm=None):
        calls.append(H.shape)
        U, used, retries = real(H, frac, perm)
        return (U, used * 10, retries + 1) if len(calls) == 3 else (U, used, retries)

    monkeypatch.setattr(gptq_solver, "inverse_hessian_factor", retried_once_for_the_third_hessian)
    r = recipe({"gptq": {"scheme": {"bits": 4, "strategy": "group", "group_size": 32}, "dampening_frac": 0.01}})
    model, steps = quantized(r)
    report = audit(model, r, steps)
    # layer 0's hessians: [q,k,v] (shared), [o], [gate,up] (shared): the third is gate/up's
    assert report.passed and report.damping == [
        f"model.layers.0.mlp.{n}: Hessian needed extra damping (dampening_frac 0.1)" for n in ("gate_proj", "up_proj")]


# --- inside a run, and `lowbit audit CHECKPOINT` ---------------------------------------------

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One clean W4 RTN run of a tiny llama: (model folder, checkpoint folder)."""
    root = tmp_path_factory.mktemp("audit-run")
    model_dir = save_tiny_llama(root / "tiny")
    out = root / "run"
    assert main(["run", "w4a16-rtn", "--model", str(model_dir), "--output", str(out),
                 "--set", "scheme.group_size=32", *QUICK]) == 0
    return model_dir, out


def test_run_records_the_audit(run_dir):
    audit_result = json.loads((run_dir[1] / "results.json").read_text())["audit"]
    assert audit_result["passed"] and audit_result["checked"] == 14 and audit_result["problems"] == []
    assert audit_result["schemes"] == {"int4 sym group 32": 14} and "lm_head" in audit_result["ignored"]


def test_cli_audit_clean_checkpoint_exits_0(run_dir, capsys):
    assert main(["audit", str(run_dir[1])]) == 0
    out = capsys.readouterr().out
    assert "passed: 14 linears checked" in out and "int4 sym group 32" in out


def test_cli_audit_nan_scale_exits_1_naming_the_module(run_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(run_dir[1], broken)
    tensors = load_file(broken / "model.safetensors")
    tensors[f"{DOWN}.weight_scale"][2, 0] = float("nan")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    assert main(["audit", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and f"PROBLEM   {DOWN}.weight_scale: 1 NaN" in out


def test_cli_audit_without_recipe_uses_the_config(run_dir, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(run_dir[1], bare)
    (bare / "recipe.yaml").unlink()
    (bare / "manifest.json").unlink()  # as another tool's checkpoint: no recipe, no manifest
    assert main(["audit", str(bare)]) == 0
    assert "lm_head: in quantization_config.ignore" in capsys.readouterr().out
    config = json.loads((bare / "config.json").read_text())
    config["quantization_config"]["ignore"] = []  # lm_head stays float but the Linear target covers it
    (bare / "config.json").write_text(json.dumps(config))
    assert main(["audit", str(bare)]) == 1
    assert "lm_head: float, but quantization_config targets it" in capsys.readouterr().out


def test_cli_audit_bad_input_exits_2(run_dir, tmp_path, capsys):
    assert main(["audit", str(tmp_path)]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err
    bad = tmp_path / "bad"
    shutil.copytree(run_dir[1], bad)
    (bad / "recipe.yaml").write_text("steps: [{rtn: {scheme: {bits: 99}}}]\n")
    assert main(["audit", str(bad)]) == 2
    assert "recipe.yaml" in capsys.readouterr().err


def test_failed_audit_leaves_no_checkpoint(run_dir, tmp_path, monkeypatch, capsys):
    real = integer.quantize_rtn

    def nan_scales(w, scheme):
        qw = real(w, scheme)
        if w.shape == (128, 256):  # the down projections
            qw.scale[0, 0] = float("nan")
        return qw

    monkeypatch.setattr(integer, "quantize_rtn", nan_scales)
    out = tmp_path / "run"
    code = main(["run", "w4a16-rtn", "--model", str(run_dir[0]), "--output", str(out),
                 "--set", "scheme.group_size=32", *QUICK])
    assert code == 2
    err = capsys.readouterr().err
    assert "coverage audit failed" in err and f"{DOWN}.weight_scale: 1 NaN" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no partial folder either
