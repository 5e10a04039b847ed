"""`lowbit fit`: measured sensitivities, cached; a plan within the budget; a recipe that runs it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFReader

from tiny_models import save_tiny_llama
from lowbit.recipes.fit_config import parse_size
from lowbit.recipes.schema import load_recipe
from lowbit.recipes.validate import RecipeError
from lowbit.app.cli import main

SMALL_FIT = ["--samples", "2", "--seq-len", "32", "--overhead", "0MiB"]  # tiny models: no runtime overhead
SMALL_RUN = ["calibration.samples=2", "calibration.seq_len=32", "evaluate.baseline=false",
             "evaluate.kl.enabled=false", "evaluate.memory.measure_peak=false",
             "evaluate.perplexity.max_tokens=128", "evaluate.perplexity.context_len=64",
             "evaluate.perplexity.stride=64"]
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a folder of its own per session: the sensitivity cache is keyed by the model's path too
    return str(save_tiny_llama(tmp_path_factory.mktemp("fit") / "tiny-llama", seed=3))


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory):
    # 16 layers: enough that the KV cache, not one layer's dequantized history, decides the budget
    return str(save_tiny_llama(tmp_path_factory.mktemp("fit-deep") / "tiny-llama-16", seed=3, layers=16))


def fit(capsys, model_dir, *args) -> dict:
    assert main(["fit", model_dir, *SMALL_FIT, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[0])


def fit_gguf(capsys, model_dir, *args) -> dict:
    assert main(["fit", model_dir, *SMALL_FIT, "--json", "--format", "gguf", "--step", "rtn", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[0])


def test_a_plan_fits_its_budget_and_a_second_budget_reuses_the_sensitivities(model_dir, capsys):
    tight = fit_gguf(capsys, model_dir, "--budget-bits-per-weight", "5")
    loose = fit_gguf(capsys, model_dir, "--budget-bits-per-weight", "7")
    assert not tight["sensitivities_cached"] and loose["sensitivities_cached"]
    assert tight["bits_per_weight"] <= 5 and loose["bits_per_weight"] <= 7
    assert tight["plan_bytes"] <= tight["budget_bytes"]
    assert loose["predicted_kl_sum"] < tight["predicted_kl_sum"]
    assert len(tight["types"]) == 14 and set(tight["types"].values()) <= {"q4_0", "q4_k", "q5_0", "q6_k", "q8_0", "f16"}
    everything = fit_gguf(capsys, model_dir, "--budget-bits-per-weight", "16")  # the widest budget: all f16
    assert everything["predicted_kl_sum"] == 0.0 and set(everything["types"].values()) == {"f16"}


def test_the_written_recipe_quantizes_each_linear_to_its_planned_type(model_dir, tmp_path, capsys):
    plan_file = tmp_path / "plan.yaml"
    plan = fit_gguf(capsys, model_dir, "--budget-bits-per-weight", "5.5", "--write", str(plan_file))
    out = tmp_path / "run"
    assert main(["run", str(plan_file), "--output", str(out), *[f"--set={s}" for s in SMALL_RUN]]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["audit"]["passed"] and results["audit"]["checked"] == sum(
        1 for k in plan["types"].values() if k != "f16")
    written = {t.name: t.tensor_type.name.lower() for t in GGUFReader(out / "model.gguf").tensors}
    for name, kind in plan["types"].items():
        layer, short = name.split(".")[2], name.split(".", 3)[3]
        expected = "f16" if kind == "f16" else kind
        assert written[f"blk.{layer}.{GGUF_NAMES[short]}.weight"] in (expected, "bf16" if kind == "f16" else expected)


def test_a_memory_budget_takes_the_kv_cache_off_first(model_dir, capsys):
    # the tiny llama's tied 49152 x 128 embedding alone is 6.4 MiB at Q8_0: 8.9 MiB leaves the
    # linears (0.56 MiB at f16, 0.16 at Q4_0) room for f16 at 64 tokens, ~0.3 MiB at 512
    short = fit_gguf(capsys, model_dir, "--memory", "8.9MiB", "--context", "64")
    longer = fit_gguf(capsys, model_dir, "--memory", "8.9MiB", "--context", "512")
    assert short["memory_split"]["kv_cache"] == 2 * 2 * 64 * 64 * 2  # K+V x layers x kv width x tokens x 2 B
    assert short["kv_format"] == longer["kv_format"] == "f16"  # llama.cpp sets its own cache type
    assert set(short["types"].values()) == {"f16"} and longer["plan_bytes"] < short["plan_bytes"] / 1.5
    assert longer["budget_bytes"] < short["budget_bytes"]
    assert longer["predicted_kl_sum"] >= short["predicted_kl_sum"]
    for plan in (short, longer):
        split = plan["memory_split"]
        assert plan["plan_bytes"] + split["kv_cache"] + split["workspace"] + split["other_weights"] <= 8.9 * 2**20


def test_a_memory_budget_nothing_fits_says_what_took_it(model_dir, capsys):
    code = main(["fit", model_dir, *SMALL_FIT, "--memory", "1MB", "--context", "4096"])
    assert code == 2
    err = capsys.readouterr().err
    assert "nothing fits" in err and "the smallest KV cache (int4, " in err and "weights outside the linears (12.0 MiB)" in err


def test_sizes_parse_in_both_units_and_bad_ones_say_what_is_valid():
    assert parse_size("8GB") == 8 * 10**9 and parse_size("1.5 GiB") == 3 * 2**29
    with pytest.raises(ValueError, match="such as 8GB"):
        parse_size("8 gigs")


def test_bad_candidate_types_are_refused(model_dir, capsys):
    assert main(["fit", model_dir, "--format", "gguf", "--budget-bits-per-weight", "5", "--types", "q4_0,q3_k"]) == 2
    assert "'q3_k' is not a GGML type; valid: iq4_nl, iq4_xs, q4_0, q4_1, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0, f16" in capsys.readouterr().err
    assert main(["fit", model_dir, "--budget-bits-per-weight", "5", "--types", "int4_g64,q4_0"]) == 2
    assert "'q4_0' is not a weight format; valid: int<bits>" in capsys.readouterr().err
    assert main(["fit", model_dir, "--format", "gguf", "--memory", "9MiB", "--kv-formats", "int8"]) == 2
    assert "the GGUF export keeps a 16-bit KV cache" in capsys.readouterr().err


def test_scheme_types_are_validated_and_f16_leaves_a_linear_float_with_the_reason(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheme: {gguf: q4_0, types: {o_proj: q3_k}}\nsteps: [rtn: {}]\n")
    with pytest.raises(RecipeError, match="'q3_k' is not a GGML type"):
        load_recipe(str(bad))
    from lowbit.quantize.grids.gguf_plan import GGUFTypes, linear_type, sixteen_bit_reason

    types = GGUFTypes("q4_0", types={"o_proj": "f16", "re:.*layers[.]1[.].*": "q8_0", "down_proj": "q6_k"})
    assert linear_type(types, "model.layers.0.self_attn.o_proj", 0, 2, 128) is None
    assert "scheme.types" in sixteen_bit_reason(types, "model.layers.0.self_attn.o_proj")
    assert linear_type(types, "model.layers.1.mlp.down_proj", 1, 2, 256) == "q8_0"  # first match wins
    assert linear_type(types, "model.layers.0.mlp.down_proj", 0, 2, 256) == "q6_k"
    assert linear_type(types, "model.layers.0.mlp.down_proj", 0, 2, 128) == "q8_0"  # q6_k falls back
    assert linear_type(types, "model.layers.0.mlp.up_proj", 0, 2, 128) == "q4_0"  # the file type's rule


def test_integer_plans_fit_the_budget_and_choose_from_the_measured_formats(model_dir, capsys):
    plan = fit(capsys, model_dir, "--budget-bits-per-weight", "5")
    assert plan["bits_per_weight"] <= 5 and plan["kv_format"] == "f16"
    assert set(plan["types"].values()) <= {"int3_g64", "int4_g64", "int4_g128", "int8", "f16"}
    assert len(set(plan["types"].values())) > 1  # 5 bits sits between the formats: a mixture


def test_a_memory_budget_chooses_the_kv_format_with_the_weights(deep_model_dir, capsys):
    # the 16-layer tiny llama: a tied 12 MiB embedding; 16 layers x 64 KV channels x 2 x 2 B = 4 KiB a
    # token, so at 4096 tokens a 16-bit cache takes 16 MiB and an int4 one 5; its linears 4.5 MiB at
    # 16 bits. 28 MiB holds no 16-bit (or 8-bit) cache beside the smallest linears: both must give
    roomy = fit(capsys, deep_model_dir, "--memory", "60MiB", "--context", "4096")
    tight = fit(capsys, deep_model_dir, "--memory", "28MiB", "--context", "4096")
    assert roomy["kv_format"] == "f16" and set(roomy["types"].values()) == {"f16"}
    # the largest prefill chunk at which a plan fits: a tight budget prefills in smaller ones
    assert roomy["memory_split"]["prefill_chunk"] == 512 > tight["memory_split"]["prefill_chunk"]
    assert tight["kv_format"] == "int4" and tight["plan_bytes"] < roomy["plan_bytes"] / 1.5  # both gave
    tried = {t["kv_format"]: t for t in tight["kv_formats_tried"]}
    assert set(tried) == {"int4", "int8", "fp8", "f16"}
    chosen = tried[tight["kv_format"]]
    # the plan is the best of the solves, one per KV format, and each spends exactly what the KV left
    assert chosen["predicted_kl_sum"] == min(t.get("predicted_kl_sum", float("inf")) for t in tried.values())
    split = tight["memory_split"]
    assert split["kv_cache"] == chosen["kv_cache_bytes"] and tight["budget_bytes"] == chosen["linears_budget"]
    assert tight["plan_bytes"] + split["kv_cache"] + split["workspace"] + split["other_weights"] <= 28 * 2**20
    assert tried["int4"]["kv_cache_bytes"] < tried["int8"]["kv_cache_bytes"] < tried["f16"]["kv_cache_bytes"]
    # a quantized cache's history comes back dequantized: it needs more workspace than a 16-bit one
    assert tried["int4"]["workspace"] > tried["f16"]["workspace"]


def test_a_recipe_with_a_budget_plans_then_runs_the_plan(deep_model_dir, tmp_path, capsys):
    fit(capsys, deep_model_dir, "--memory", "28MiB", "--context", "4096")  # fills the cache: the run measures nothing
    recipe = tmp_path / "budget.yaml"
    recipe.write_text(f"model: {deep_model_dir}\nfit: {{memory: 28MiB, context: 4096, samples: 2, seq_len: 32, overhead: 0MiB}}\n"
                      "steps: [rtn: {}]\n")
    out = tmp_path / "run"
    assert main(["run", str(recipe), "--output", str(out), *[f"--set={s}" for s in SMALL_RUN]]) == 0
    err = capsys.readouterr().err
    assert "linears sensitivities from the cache" in err and "kv sensitivities from the cache" in err
    written = load_recipe(str(out / "recipe.yaml"))
    assert written.fit is None and written.scheme["default"] == "f16" and len(written.scheme["formats"]) == 112
    kv_steps = [s for s in written.steps if s.name == "kv_cache"]
    assert len(kv_steps) == 1 and kv_steps[0].config.strategy == "token"
    results = json.loads((out / "results.json").read_text())
    assert results["audit"]["passed"]
    assert results["audit"]["checked"] == sum(1 for k in written.scheme["formats"].values() if k != "f16")
    report = (out / "report.md").read_text()
    assert "## Budget plans (lowbit fit) against uniform recipes" in report
    section = report.split("## Budget plans (lowbit fit) against uniform recipes")[1]
    row = next(line for line in section.splitlines() if line.startswith("| budget |"))
    assert f"| {kv_steps[0].config.format} |" in row  # the plan's KV format, beside its formats


def test_a_model_with_sliding_window_layers_keeps_a_16_bit_cache_in_its_plans(capsys):
    from tiny_models import make_tiny_model
    from lowbit.app.fit_checks import kv_kinds
    from lowbit.recipes.fit_config import FitConfig

    budget = FitConfig(memory="1GB", context=4096)
    assert kv_kinds(make_tiny_model("llama"), budget) == ["f16", "fp8", "int4", "int8"]
    assert kv_kinds(make_tiny_model("gemma3_text"), budget) == ["f16"]  # its sliding layers: no quantized cache
    assert "sliding_attention" in capsys.readouterr().err


def test_fp8_and_mxfp4_are_candidates_a_plan_can_choose_and_a_run_writes(model_dir, tmp_path, capsys):
    plan = fit(capsys, model_dir, "--budget-bits-per-weight", "6.5", "--types", "mxfp4,fp8_e4m3,f16")
    assert plan["bits_per_weight"] <= 6.5
    assert set(plan["types"].values()) <= {"mxfp4", "fp8_e4m3", "f16"} and "mxfp4" in plan["types"].values()
    recipe = tmp_path / "planned.yaml"
    formats = {name: kind for name, kind in plan["types"].items()}
    recipe.write_text(json.dumps({"model": model_dir, "scheme": {"formats": formats, "default": "f16"},
                                  "steps": ["rtn"]}))
    out = tmp_path / "run"
    assert main(["run", str(recipe), "--output", str(out), *[f"--set={s}" for s in SMALL_RUN]]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["audit"]["passed"]
    assert results["audit"]["checked"] == sum(1 for k in plan["types"].values() if k != "f16")
