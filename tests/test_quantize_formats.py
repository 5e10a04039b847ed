"""A format per linear (scheme.formats): names, bytes, runs, export and audit; integer, FP8 and MXFP4 mixed."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from tiny_models import run_on_tiny_llama
from lowbit.quantize.grids.formats import LinearFormats, fits_columns, format_bytes, grid_named
from lowbit.quantize.grids.fp8 import FP8Scheme
from lowbit.quantize.grids.mxfp4 import MXScheme
from lowbit.quantize.grids.integer import IntScheme

PLAN = {"re:.*layers[.]0[.]mlp[.].*": "int8", "v_proj": "f16", "down_proj": "int3_g64", "o_proj": "int4"}


def test_format_names_round_trip_and_bad_names_say_what_is_valid():
    assert grid_named("int4_g128") == IntScheme(4, True, "group", 128)
    assert grid_named("int8") == IntScheme(8, True, "channel") and grid_named("f16") is None
    with pytest.raises(ValueError, match=r"int<bits>_g<group>"):
        grid_named("int4-g128")
    with pytest.raises(ValueError, match="formats\\['o_proj'\\]"):
        LinearFormats({"o_proj": "q4_0"})
    assert grid_named("fp8_e4m3") == FP8Scheme("e4m3", "channel") and grid_named("mxfp4") == MXScheme()
    with pytest.raises(ValueError, match=r"'fp8' is not a weight format; valid: int<bits>.*fp8_e4m3.*mxfp4; or f16"):
        grid_named("fp8")


def test_format_bytes_count_packed_codes_and_16_bit_scales():
    # 4 bits x 576 columns = 72 int32 words a row; 9 groups of 64 a row, 2 bytes each
    assert format_bytes("int4_g64", 10, 576) == 10 * 72 * 4 + 10 * 9 * 2 + 16
    assert format_bytes("int3_g64", 1, 64) == 6 * 4 + 2 + 16  # 192 bits: 6 words
    assert format_bytes("f16", 3, 5) == 30
    assert format_bytes("fp8_e4m3", 10, 576) == 10 * 576 + 10 * 2  # a byte a weight, a bf16 scale a row
    assert format_bytes("mxfp4", 10, 576) == 10 * 288 + 10 * 18  # two codes a byte, an exponent per 32
    assert fits_columns("mxfp4", 576) and not fits_columns("mxfp4", 48) and not fits_columns("int4_g128", 576)


def test_first_matching_pattern_wins_then_the_default():
    types = LinearFormats(PLAN, default="int4_g64")
    assert types.format_of("model.layers.0.mlp.down_proj") == "int8"
    assert types.format_of("model.layers.1.mlp.down_proj") == "int3_g64"
    assert types.grid_of("model.layers.1.self_attn.v_proj") is None
    assert types.format_of("model.layers.1.self_attn.q_proj") == "int4_g64"


@pytest.mark.parametrize("step", ["rtn", "gptq"])
def test_a_run_quantizes_each_linear_to_its_format_and_the_checkpoint_says_so(step, tmp_path):
    code, out = run_on_tiny_llama(tmp_path, {"scheme": {"formats": PLAN, "default": "int4_g64"}, "steps": [{step: {}}]})
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["audit"]["passed"] and results["audit"]["checked"] == 12  # 14 linears less 2 v_proj
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    formats = {}
    for group in config["config_groups"].values():
        w = group["weights"]
        name = f"int{w['num_bits']}" + (f"_g{w['group_size']}" if w["strategy"] == "group" else "")
        for target in group["targets"]:
            formats[target] = name
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    for layer in (0, 1):
        prefix = f"model.layers.{layer}"
        assert f"{prefix}.self_attn.v_proj.weight" in keys  # 16-bit, as planned
        expected = {"mlp.down_proj": "int8" if layer == 0 else "int3_g64", "self_attn.o_proj": "int4",
                    "mlp.up_proj": "int8" if layer == 0 else "int4_g64", "self_attn.q_proj": "int4_g64"}
        for short, kind in expected.items():
            scale = f"{prefix}.{short}.weight_scale"
            assert scale in keys
            matched = [v for t, v in formats.items() if t == f"{prefix}.{short}" or
                       (t.startswith("re:") and __import__("re").fullmatch(t[3:], f"{prefix}.{short}"))]
            assert matched and matched[0] == kind, (short, formats)


def test_gptq_format_refuses_a_mixture_naming_the_format_that_takes_it(tmp_path, capsys):
    code, out = run_on_tiny_llama(tmp_path, {"scheme": {"formats": PLAN, "default": "int4_g64"},
                                             "steps": [{"rtn": {}}], "export": {"format": "gptq"}})
    assert code != 0
    assert "one bit-width and group size per model" in capsys.readouterr().err
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()


MIXED = {"down_proj": "mxfp4", "o_proj": "fp8_e4m3", "v_proj": "f16"}  # the rest: the default, int4_g32
MODULES = {"mlp.down_proj": "MXFP4Linear", "self_attn.o_proj": "FP8Linear", "self_attn.q_proj": "QuantLinear"}


@pytest.mark.parametrize("steps", [[{"rtn": {}}], [{"gptq": {"true_sequential": False}}],
                                   [{"awq": {"grid": 4, "clip_grid": 4}}, {"rtn": {}}]], ids=["rtn", "gptq", "awq"])
def test_integer_fp8_and_mxfp4_linears_mix_in_one_plan_and_one_checkpoint(tmp_path, steps):
    from export_helpers import load_without_tokenizer
    from lowbit.app.audit import audit_checkpoint

    code, out = run_on_tiny_llama(tmp_path, {"scheme": {"formats": MIXED, "default": "int4_g32"}, "steps": steps})
    assert code == 0
    assert audit_checkpoint(out).passed
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    assert {g["format"] for g in config["config_groups"].values()} == {"pack-quantized", "float-quantized",
                                                                       "mxfp4-pack-quantized"}
    model = load_without_tokenizer(out)
    model = model[0] if isinstance(model, tuple) else model
    for name, kind in MODULES.items():
        assert type(model.get_submodule(f"model.layers.1.{name}")).__name__ == kind, name
    assert type(model.get_submodule("model.layers.1.self_attn.v_proj")).__name__ == "Linear"


def test_the_audit_checks_each_linear_against_its_planned_format(tmp_path):
    import yaml

    from lowbit.app.audit import audit_checkpoint

    code, out = run_on_tiny_llama(tmp_path, {"scheme": {"formats": PLAN, "default": "int4_g64"}, "steps": [{"rtn": {}}]})
    assert code == 0 and audit_checkpoint(out).passed
    written = yaml.safe_load((out / "recipe.yaml").read_text())
    scheme = written["steps"][0]["rtn"]["scheme"]  # what the step was to write
    scheme["formats"] = {"model.layers.1.self_attn.q_proj": "int8", **scheme["formats"]}
    scheme["formats"]["v_proj"] = "int4_g64"  # the checkpoint keeps v_proj 16-bit
    (out / "recipe.yaml").write_text(yaml.safe_dump(written, sort_keys=False))  # first match wins: keep the order
    problems = audit_checkpoint(out).problems
    assert any(p.startswith("model.layers.1.self_attn.q_proj") and "int8" in p for p in problems), problems
    assert any(p.startswith("model.layers.0.self_attn.v_proj") for p in problems), problems
