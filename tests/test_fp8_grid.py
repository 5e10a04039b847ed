"""FP8 as a grid: `rtn`, `gptq` and `awq` round onto an fp8 scheme like onto any grid (FP8 weights,
16-bit inputs), and the `fp8` step then quantizes only the inputs of what they left."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tiny_models import PINNED_RUN, save_tiny_llama
from lowbit.app.audit import audit_run
from lowbit.app.cli import main
from lowbit.calibrate.arch import arch_for
from lowbit.quantize.grids.fp8 import FP8Scheme, quantize_weight_fp8
from lowbit.quantize.runtime.fp8_linear import FP8Linear
from lowbit.quantize.steps import awq, fp8 as fp8_step, gptq, rtn
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.gptq import by_grid
from lowbit.quantize.steps.gptq_solver import gptq_solve_fp8, solve_onto
from lowbit.recipes.schema import parse_recipe



def _ctx(model):
    ids = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    return StepContext(model, arch_for(model), ("lm_head",), lambda: ids)


def _fp8_linears(model) -> dict[str, FP8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}


def test_rtn_onto_fp8_is_the_nearest_rounding_with_16_bit_inputs(tiny_llama):
    float_w = tiny_llama.get_submodule("model.layers.0.mlp.down_proj").weight.detach().clone()
    result = rtn.apply(_ctx(tiny_llama), rtn.RTNConfig(FP8Scheme("e4m3", "channel")))
    linears = _fp8_linears(tiny_llama)
    assert len(result["quantized"]) == len(linears) == 14
    assert all(m.activations == "none" and m.input_scale is None for m in linears.values())
    down = linears["model.layers.0.mlp.down_proj"]
    assert torch.equal(down.weight, quantize_weight_fp8(float_w, "channel", "e4m3").data)
    recipe = parse_recipe({"scheme": {"format": "e4m3", "strategy": "channel"}, "steps": ["rtn"]}, "test")
    report = audit_run(tiny_llama, recipe, arch_for(tiny_llama), [])
    assert report.passed, report.problems


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_fp8_step_after_rtn_quantizes_only_the_inputs(tiny_llama, activations):
    rtn.apply(_ctx(tiny_llama), rtn.RTNConfig(FP8Scheme("e4m3", "channel")))
    codes = {n: m.weight.clone() for n, m in _fp8_linears(tiny_llama).items()}
    cfg = fp8_step.FP8Config(scheme=FP8Scheme("e4m3", "channel"), activations=activations)
    result = fp8_step.apply(_ctx(tiny_llama), cfg)
    assert result["quantized"] == [] and sorted(result["inputs_quantized"]) == sorted(codes)
    assert "model.layers.0.self_attn.q_proj" not in result["ignored"]  # it was quantized, not left alone
    for name, module in _fp8_linears(tiny_llama).items():
        assert torch.equal(module.weight, codes[name])  # weights as rtn left them
        assert module.activations == activations
        assert (module.input_scale is not None) == (activations == "static")
    recipe = parse_recipe({"scheme": {"format": "e4m3", "strategy": "channel"},
                           "steps": ["rtn", {"fp8": {"activations": activations}}]}, "test")
    assert audit_run(tiny_llama, recipe, arch_for(tiny_llama), []).passed


def test_the_audit_fails_a_model_whose_inputs_the_recipe_quantizes_but_were_not(tiny_llama):
    rtn.apply(_ctx(tiny_llama), rtn.RTNConfig(FP8Scheme("e4m3", "channel")))
    recipe = parse_recipe({"scheme": {"format": "e4m3", "strategy": "channel"},
                           "steps": ["rtn", {"fp8": {"activations": "dynamic"}}]}, "test")
    report = audit_run(tiny_llama, recipe, arch_for(tiny_llama), [])
    assert not report.passed
    assert any("model.layers.1.mlp.up_proj" in p for p in report.problems)


def test_gptq_onto_fp8_is_the_fp8_solver_and_solves_alone_unless_per_channel():
    gen = torch.Generator().manual_seed(0)
    W, X = torch.randn(48, 64, generator=gen), torch.randn(512, 64, generator=gen)
    H = 2 * X.t() @ X / X.shape[0]
    cfg = gptq.GPTQConfig(dampening_frac=0.1, actorder="static", true_sequential=False)
    for strategy in ("channel", "block"):
        grid = FP8Scheme("e4m3", strategy, 32)
        by_registry = solve_onto(grid, lambda: W, H.clone(), cfg).weight
        direct = gptq_solve_fp8(W, H.clone(), cfg, strategy, "e4m3", 32)[0]
        assert torch.equal(by_registry.data.view(torch.uint8), direct.data.view(torch.uint8))
        assert torch.equal(by_registry.scale, direct.scale)
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    grids = {f"L.{n}": FP8Scheme("e4m3", "block") for n in names}
    assert [members for _, members in by_grid("L", names, grids)] == [[n] for n in names]
    grids = {f"L.{n}": FP8Scheme("e4m3", "channel") for n in names}
    assert [members for _, members in by_grid("L", names, grids)] == [names]


def test_gptq_refuses_a_per_tensor_fp8_scheme():
    with pytest.raises(ValueError, match="strategy tensor"):
        gptq.GPTQConfig(scheme=FP8Scheme("e4m3", "tensor"))


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_gptq_onto_fp8_walks_the_layers_and_passes_the_audit(tiny_llama, strategy):
    batches = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = tiny_llama(input_ids=batches).logits
    scheme = FP8Scheme("e4m3", strategy, 32)
    result = gptq.apply(_ctx(tiny_llama), gptq.GPTQConfig(scheme, actorder="static", dampening_frac=0.1,
                                                          true_sequential=False))
    losses = {n: s["loss"] for layer in result["layers"] for n, s in layer["linears"].items()}
    assert len(losses) == 14 and all(v >= 0 for v in losses.values())
    assert all(m.activations == "none" and m.weight_strategy == strategy for m in _fp8_linears(tiny_llama).values())
    with torch.no_grad():
        out = tiny_llama(input_ids=batches).logits
    assert (out - reference).norm() / reference.norm() < 0.05
    recipe = parse_recipe({"scheme": {"format": "e4m3", "strategy": strategy, "block_size": 32},
                           "steps": [{"gptq": {"true_sequential": False}}]}, "test")
    assert audit_run(tiny_llama, recipe, arch_for(tiny_llama), []).passed


def test_awq_then_rtn_onto_fp8_runs_and_passes_the_audit(tiny_llama):
    scheme = FP8Scheme("e4m3", "channel")
    record = awq.apply(_ctx(tiny_llama), awq.AWQConfig(scheme, grid=4, clip_grid=4))
    assert record["clipped"]
    rtn.apply(_ctx(tiny_llama), rtn.RTNConfig(scheme))
    recipe = parse_recipe({"scheme": {"format": "e4m3", "strategy": "channel"},
                           "steps": [{"awq": {"grid": 4, "clip_grid": 4}}, "rtn"]}, "test")
    assert audit_run(tiny_llama, recipe, arch_for(tiny_llama), []).passed


def test_rtn_then_fp8_dynamic_writes_the_checkpoint_fp8_dynamic_writes(tmp_path, monkeypatch, capsys):
    """The same model file from the split recipe (a weight step, then the inputs) as from the
    shipped one-step recipe; both pass `lowbit audit`."""
    save_tiny_llama(tmp_path / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    split = tmp_path / "fp8-split.yaml"
    split.write_text("scheme: {format: e4m3, strategy: channel}\nsteps:\n  - rtn\n  - fp8: {activations: dynamic}\n")
    outputs = {}
    for recipe in ("fp8-dynamic", str(split)):
        out = Path("runs") / Path(recipe).stem
        sets = [f"--set={s}" for s in PINNED_RUN]
        assert main(["run", recipe, "--model", "tiny-llama", "--output", str(out), *sets]) == 0, capsys.readouterr().err
        assert main(["audit", str(out)]) == 0, capsys.readouterr().out
        outputs[recipe] = load_file(out / "model.safetensors")
    one_step, two_steps = outputs.values()
    assert one_step.keys() == two_steps.keys()
    for key in one_step:
        assert torch.equal(one_step[key].view(torch.uint8), two_steps[key].view(torch.uint8)), key
