"""MXFP4 (`scheme: {mx: fp4}`): the grid, checked against compressed-tensors' own MX code, rounded by
rtn and gptq, audited, exported, and loaded back by lowbit and by plain transformers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from export_helpers import compare_logits, load_without_tokenizer, token_ids
from tiny_models import PINNED_RUN, save_tiny_llama
from lowbit.app.audit import audit_run
from lowbit.app.cli import main
from lowbit.calibrate.arch import arch_for
from lowbit.quantize.grids.mxfp4 import (MXScheme, block_exponents, e2m1_codes, e2m1_values, element_scales,
                                         pack_codes, unpack_codes)
from lowbit.quantize.runtime.mxfp4_linear import MXFP4Linear
from lowbit.quantize.steps import gptq, rtn
from lowbit.quantize.steps.context import StepContext
from lowbit.recipes.schema import parse_recipe



def _weight(rows=64, cols=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 1, rows).unsqueeze(1)
    w[3, 17] = 40.0  # an outlier: its block's scale, not the row's, grows
    w[5, :32] = 0.0  # an all-zero block
    return w


def test_scales_and_packing_are_compressed_tensors_own():
    ct_mx = pytest.importorskip("compressed_tensors.quantization.utils.mxfp_utils")
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

    w = _weight()
    exponents = block_exponents(w)
    amax = w.abs().reshape(64, -1, 32).amax(dim=-1)
    nonzero = amax > 0
    assert torch.equal(ct_mx.generate_mx_scales(amax[nonzero]).to(torch.uint8), exponents[nonzero])
    codes = MXScheme().round(w).codes
    values = e2m1_values(codes)
    assert torch.equal(pack_codes(codes), pack_fp4_to_uint8(values))
    assert torch.equal(unpack_fp4_from_uint8(pack_codes(codes), 64, 256, torch.float32), values)
    assert torch.equal(unpack_codes(pack_codes(codes)), codes)


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 100.0, -0.2, -0.3, -2.9])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 0.0, -0.5, -3.0])
    got = e2m1_values(e2m1_codes(v))
    assert torch.equal(got, expected)
    assert not torch.signbit(got[10])  # no negative zero code


def test_rounding_error_is_within_a_scale_and_an_outlier_stays_in_its_block():
    w = _weight()
    mw = MXScheme().round(w)
    scale = element_scales(mw.exponents)
    assert ((mw.dequantize() - w).abs() <= scale).all()  # half the widest step (4 -> 6), or a saturated 6..7
    assert torch.equal(mw.dequantize()[5, :32], torch.zeros(32))
    assert scale[3, 17] > 8 * scale[3, 40]  # the outlier's block only
    assert mw.dequantize()[3, 17] == 32.0  # scale 8: 40 / 8 = 5, a tie between 4 and 6 goes to the even code, 4
    assert MXScheme().bits_per_weight == 4.25


def test_rows_that_do_not_split_into_blocks_of_32_are_refused_by_name():
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj: rows of 48 .* blocks of 32"):
        MXScheme().round(torch.randn(8, 48), "model.layers.0.mlp.down_proj")
    w = torch.randn(8, 64)
    w[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj: 1 NaN or inf weights"):
        MXScheme().round(w, "model.layers.0.mlp.up_proj")
    with pytest.raises(ValueError, match=r"'fp6' is not valid; choose one of \['fp4'\]"):
        parse_recipe({"scheme": {"mx": "fp6"}, "steps": ["rtn"]}, "test")


def _ctx(model):
    ids = torch.randint(3, 500, (8, 32), generator=torch.Generator().manual_seed(0))
    return StepContext(model, arch_for(model), ("lm_head",), lambda: ids)


def test_gptq_beats_rtn_on_the_outputs_and_both_pass_the_audit(tiny_llama):
    import copy

    twin = copy.deepcopy(tiny_llama)
    ids = token_ids()
    with torch.no_grad():
        reference = tiny_llama(ids).logits
    gptq.apply(_ctx(tiny_llama), gptq.GPTQConfig(MXScheme(), actorder="static", dampening_frac=0.1,
                                                 true_sequential=False))
    rtn.apply(_ctx(twin), rtn.RTNConfig(MXScheme()))
    with torch.no_grad():
        err_gptq = float((tiny_llama(ids).logits - reference).square().mean())
        err_rtn = float((twin(ids).logits - reference).square().mean())
    assert err_gptq < err_rtn
    for model, step in ((tiny_llama, {"gptq": {"true_sequential": False}}), (twin, "rtn")):
        assert sum(isinstance(m, MXFP4Linear) for m in model.modules()) == 14
        recipe = parse_recipe({"scheme": {"mx": "fp4"}, "steps": [step]}, "test")
        report = audit_run(model, recipe, arch_for(model), [])
        assert report.passed, report.problems


@pytest.mark.parametrize("recipe_text", [
    "scheme: {mx: fp4}\nsteps:\n  - rtn\n",
    "scheme: {mx: fp4}\nsteps:\n  - gptq: {actorder: static, true_sequential: false, dampening_frac: 0.1}\n",
], ids=["rtn", "gptq"])
def test_a_run_exports_what_lowbit_and_plain_transformers_load(tmp_path, monkeypatch, capsys, recipe_text):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    save_tiny_llama(tmp_path / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mx.yaml").write_text(recipe_text)
    out = Path("runs") / "mx"
    sets = [f"--set={s}" for s in PINNED_RUN]
    assert main(["run", "mx.yaml", "--model", "tiny-llama", "--output", str(out), *sets]) == 0, capsys.readouterr().err
    assert main(["audit", str(out)]) == 0, capsys.readouterr().out
    ours = load_without_tokenizer(out)
    ours = ours[0] if isinstance(ours, tuple) else ours
    assert isinstance(ours.get_submodule("model.layers.1.mlp.down_proj"), MXFP4Linear)
    ids = token_ids()
    dequantized = CompressedTensorsConfig(dequantize=True)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, quantization_config=dequantized).eval()
    agree, diff = compare_logits(ours.float(), hf, ids)
    assert agree >= 0.999 and diff < 1e-4
    compressed = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()  # kept packed, decoded per call
    assert compressed.get_submodule("model.layers.0.mlp.down_proj").weight_packed.dtype == torch.uint8
    agree, _ = compare_logits(ours.to(torch.bfloat16), compressed, ids)
    assert agree >= 0.95


def test_the_audit_names_mxfp4_tensors_the_config_does_not_describe():
    from lowbit.export.formats.compressed_tensors import agreement, mxfp4
    from lowbit.export.formats.tensor_table import TensorTable

    module = MXFP4Linear.from_weight(MXScheme().round(torch.randn(8, 64)), None)
    tensors = mxfp4.module_tensors("m", module, torch.bfloat16)
    qconfig = {"config_groups": {"group_0": {"targets": ["Linear"], **mxfp4.scheme_entry("m", module)}},
               "format": mxfp4.FORMAT}
    assert agreement.config_problems(qconfig, TensorTable(tensors)) == []
    short = {**tensors, "m.weight_scale": tensors["m.weight_scale"][:, :1]}
    assert agreement.config_problems(qconfig, TensorTable(short)) == [
        "m.weight_scale: shape (8, 1), but quantization_config.config_groups.group_0.weights (group_size 32) "
        "needs (8, 2)"]
    as_int = {"group_0": {"targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "group_size": 32,
                                                             "strategy": "group", "symmetric": True}}}
    problems = agreement.config_problems({"config_groups": as_int, "format": "pack-quantized"}, TensorTable(tensors))
    assert len(problems) == 1 and problems[0].startswith("m.weight_packed: E2M1 codes")
    as_int16 = {**tensors, "m.weight_packed": tensors["m.weight_packed"].to(torch.int16)}
    assert agreement.config_problems(qconfig, TensorTable(as_int16)) == [
        "m.weight_packed: dtype I16, but a quantized weight there is stored as I32 or U8"]


def test_awq_searches_on_mxfp4_blocks_then_rtn_passes_the_audit(tiny_llama):
    from lowbit.quantize.steps import awq

    record = awq.apply(_ctx(tiny_llama), awq.AWQConfig(MXScheme(), grid=4, clip_grid=4))
    assert record["clipped"]
    rtn.apply(_ctx(tiny_llama), rtn.RTNConfig(MXScheme()))
    recipe = parse_recipe({"scheme": {"mx": "fp4"}, "steps": [{"awq": {"grid": 4, "clip_grid": 4}}, "rtn"]}, "test")
    assert audit_run(tiny_llama, recipe, arch_for(tiny_llama), []).passed
