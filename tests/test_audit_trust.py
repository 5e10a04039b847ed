"""The audit means what it says: a checkpoint whose files were altered, a float model, a MoE whose
experts stayed float, a config.json that contradicts its tensors all fail, one line per problem
naming the file, tensor or key; `lowbit eval` warns about them and goes on."""
import json
import shutil

import pytest
import torch
import yaml

from tiny_models import SMALL_RUN, save_tiny_llama, save_tiny_qwen3_moe
from tiny_moe import save_tiny_moe
from lowbit.calibrate.arch import arch_for, decoder_layers
from lowbit.calibrate.models import load_model
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.export.manifest import write_manifest
from lowbit.export.portions import only_layers
from lowbit.quantize.audit import AuditError
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.registry import STEPS
from lowbit.recipes.schema import parse_recipe
from lowbit.app.audit import RunAudit, audit_run
from lowbit.app.cli import main
from lowbit.calibrate.layer_source import Portion

RUN_SETS = [f"--set={s}" for s in SMALL_RUN]
EVAL_SETS = [s for s in RUN_SETS if s.startswith("--set=evaluate.")]
PACKED = "model.layers.1.mlp.down_proj.weight_packed"
EXPERTS = [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")]
# the same experts, read back from a checkpoint into lowbit's per-expert linears
EXPERT_LINEARS = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (0, 1) for e in range(4)
                  for p in ("gate_proj", "up_proj", "down_proj")]
W4_G64 = {"bits": 4, "symmetric": True, "strategy": "group", "group_size": 64}


@pytest.fixture(scope="module")
def w4_run(tmp_path_factory):
    """A real `lowbit run w4a16-rtn` checkpoint of a tiny llama (group 64)."""
    root = tmp_path_factory.mktemp("trust")
    out = root / "run"
    assert main(["run", "w4a16-rtn", "--model", str(save_tiny_llama(root / "tiny")), "--output", str(out),
                 *RUN_SETS]) == 0
    return out


def copy_of(run, tmp_path, name="copy"):
    return shutil.copytree(run, tmp_path / name)


def flip_bytes_inside(path, tensor: str, count: int = 16) -> None:
    """XOR `count` bytes in the middle of one tensor's data: the header and every shape stay valid."""
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    start, end = json.loads(raw[8:8 + header_len])[tensor]["data_offsets"]
    middle = 8 + header_len + (start + end) // 2 - count // 2
    for i in range(middle, middle + count):
        raw[i] ^= 0xFF
    path.write_bytes(raw)


def edit_config(folder, rerecord_manifest: bool = True, **weights) -> None:
    """Change config_groups.group_0.weights (and re-record manifest.json, as a tool that rewrote
    the folder would: the disagreement, not the edit, is what fails)."""
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    (folder / "config.json").write_text(json.dumps(config))
    if rerecord_manifest:
        write_manifest(folder)


def problems_printed(out: str) -> list[str]:
    return [line.strip().removeprefix("PROBLEM").strip() for line in out.splitlines() if "PROBLEM" in line]


# --- 1. integrity --------------------------------------------------------------------------

def test_flipped_packed_weight_bytes_fail_naming_the_file(w4_run, tmp_path, capsys):
    broken = copy_of(w4_run, tmp_path)
    flip_bytes_inside(broken / "model.safetensors", PACKED)
    assert main(["audit", str(broken)]) == 1
    out = capsys.readouterr().out
    # the codes are still valid 4-bit codes: only the manifest tells the file was altered
    assert problems_printed(out) == [f"{broken / 'model.safetensors'}: differs from manifest.json (size or sha256)"]
    assert "integrity FAILED" in out


def test_clean_checkpoint_passes_with_its_files_verified(w4_run, capsys):
    assert main(["audit", str(w4_run)]) == 0
    out = capsys.readouterr().out
    assert "integrity every file matches manifest.json" in out
    assert "passed: 14 linears checked, 100.0% of decoder-layer matrix parameters quantized" in out


def test_lowbit_checkpoint_without_manifest_fails_another_tools_is_only_noted(w4_run, tmp_path, capsys):
    ours = copy_of(w4_run, tmp_path, "ours")
    (ours / "manifest.json").unlink()
    assert main(["audit", str(ours)]) == 1
    assert problems_printed(capsys.readouterr().out)[0].startswith(f"{ours / 'manifest.json'}: missing")
    (ours / "recipe.yaml").unlink()  # now it looks like another tool's checkpoint
    assert main(["audit", str(ours)]) == 0
    assert "integrity not checked: no manifest.json (a checkpoint from another tool)" in capsys.readouterr().out


# --- 3. a float model ------------------------------------------------------------------------

def test_float_model_folder_is_not_a_quantized_checkpoint(tmp_path, capsys):
    folder = save_tiny_llama(tmp_path / "float")
    assert main(["audit", str(folder)]) == 1
    out = capsys.readouterr().out
    assert problems_printed(out) == [f"{folder}: not a quantized checkpoint (no quantized module, no "
                                     "quantization_config in config.json)"]


# --- 2. parameters, not linears: a Qwen3-MoE whose experts stay float ------------------------

@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(float model folder, a checkpoint of it with RTN on every linear and float experts, written
    by checkpoint.save without the run's audit)."""
    root = tmp_path_factory.mktemp("moe")
    folder = save_tiny_qwen3_moe(root / "moe")
    recipe = parse_recipe({"model": str(folder), "scheme": W4_G64, "steps": ["rtn"], "ignore": ["lm_head"]}, "test")
    model, tokenizer, _ = quantized_moe(folder, recipe)
    out = checkpoint.save(model, tokenizer, root / "ckpt", ExportConfig(),
                          extra_files={"recipe.yaml": yaml.safe_dump(recipe.to_dict(), sort_keys=False)})
    return folder, out


def quantized_moe(folder, recipe):
    """(model, tokenizer, arch): the model as transformers loads it, experts fused into 3-D
    parameters that no linear-by-linear step reaches (lowbit before #32): its table row then lists
    attention only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = load_model(str(folder))[1]
    arch = arch_for(model)
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    ctx = StepContext(model, arch, recipe.ignore, lambda: ids)
    for step in recipe.steps:
        STEPS[step.name].apply(ctx, step.config)
    return model, tokenizer, arch


def test_moe_checkpoint_with_float_experts_fails_naming_them(moe, capsys):
    assert main(["audit", str(moe[1])]) == 1
    out = capsys.readouterr().out
    float_experts = [p for p in problems_printed(out) if ".mlp.experts." in p]
    assert len(problems_printed(out)) == len(float_experts) == 24  # 2 layers x 4 experts x 3 projections
    assert all(any(p.startswith(f"{name}: is float Linear") for p in float_experts) for name in EXPERT_LINEARS)
    assert "model.layers.0.mlp.experts.0.gate_proj: is float Linear, the recipe asks for int4 sym group 64" in out
    assert "model.layers.0.mlp.gate: router: kept float" in out  # the routers: float on purpose
    # per layer: q, o 64x64 and k, v 32x64 quantized; experts 4x128x64 + 4x64x64 and the 4x64 router float
    assert "19.9% of decoder-layer matrix parameters quantized" in out


def test_moe_without_recipe_is_judged_by_its_config_and_fails_the_same(moe, tmp_path, capsys):
    bare = copy_of(moe[1], tmp_path)
    for name in ("recipe.yaml", "manifest.json"):
        (bare / name).unlink()
    assert main(["audit", str(bare)]) == 1
    problems = problems_printed(capsys.readouterr().out)
    assert sorted(p.split(":")[0] for p in problems) == sorted(f"{name}.weight" for name in EXPERT_LINEARS)


def test_moe_audit_records_the_share_and_ignored_experts_pass(moe):
    folder = moe[0]
    recipe = parse_recipe({"scheme": W4_G64, "steps": ["rtn"], "ignore": ["lm_head"]}, "test")
    model, _, arch = quantized_moe(folder, recipe)
    report = audit_run(model, recipe, arch, [])
    counts = report.to_dict()
    assert not report.passed and counts["decoder_matrix_params"] == {"quantized": 2 * 12288, "float": 2 * 49408}
    assert counts["quantized_share"] == round(12288 / (12288 + 49408), 6)
    ignoring = parse_recipe({"scheme": W4_G64, "steps": ["rtn"], "ignore": ["lm_head", "mlp.experts"]}, "test")
    report = audit_run(model, ignoring, arch, [])
    assert report.passed, report.problems
    assert report.ignored["model.layers.1.mlp.experts"] == "matches the ignore list"


def test_run_on_a_moe_lowbit_cannot_split_stops_before_export_naming_the_float_experts(tmp_path, capsys):
    """Phi-3.5-MoE is not in lowbit's table and its experts class is not split into linears (yet):
    the run quantizes the linears it finds and its audit refuses to publish."""
    model = save_tiny_moe(tmp_path / "models" / "phimoe", "phimoe")
    out = tmp_path / "run"
    assert main(["run", "w4a16-rtn", "--model", str(model), "--output", str(out), *RUN_SETS]) == 2
    err = capsys.readouterr().err
    fused = [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")]
    assert "coverage audit failed: 4 problem(s)" in err and all(f"{name}: float" in err for name in fused)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # nothing published


def test_streamed_portions_fail_on_the_layer_with_float_experts(moe):
    recipe = parse_recipe({"scheme": W4_G64, "steps": ["rtn"], "ignore": ["lm_head"]}, "test")
    model, _, arch = quantized_moe(moe[0], recipe)
    audit = RunAudit(recipe, model, arch)
    layers = decoder_layers(model, arch)
    with only_layers(model, arch, layers, []):
        audit(model, Portion([], ["model.embed_tokens", "model.norm", "lm_head"]))  # nothing of a layer
    with only_layers(model, arch, layers, [1]), pytest.raises(AuditError) as failed:
        audit(model, Portion([1], []))
    assert "model.layers.1.mlp.experts.gate_up_proj: float" in str(failed.value)
    assert "model.layers.0" not in str(failed.value)
    assert audit.report.matrices.quantized == 12288 and audit.report.matrices.float == 49408


# --- 4. config.json agrees with the tensors --------------------------------------------------

def test_config_group_size_that_the_scales_contradict_fails_naming_the_tensor(w4_run, tmp_path, capsys):
    edited = copy_of(w4_run, tmp_path)
    edit_config(edited, group_size=32)
    assert main(["audit", str(edited)]) == 1
    problems = problems_printed(capsys.readouterr().out)
    assert len(problems) == 14  # one per quantized linear, and nothing about the files
    assert ("model.layers.0.mlp.down_proj.weight_scale: shape (128, 4), but quantization_config.config_groups."
            "group_0.weights (strategy group, group_size 32) needs (128, 8)") in problems


def test_config_num_bits_the_load_cannot_build_raises_one_line_naming_tensor_and_key(w4_run, tmp_path, capsys):
    edited = copy_of(w4_run, tmp_path)
    edit_config(edited, num_bits=8)
    with pytest.raises(ValueError) as raised:
        checkpoint.load(edited)
    message = str(raised.value)
    assert "\n" not in message and "model.layers.0.mlp.down_proj.weight_packed: shape (128, 32)" in message
    assert "quantization_config.config_groups.group_0.weights.num_bits 8" in message
    assert main(["audit", str(edited)]) == 1  # the audit reports it rather than stopping on it
    assert "weights.num_bits 8 packs 256 columns into 64 words" in capsys.readouterr().out


def test_config_symmetric_false_without_zero_points_fails(w4_run, tmp_path, capsys):
    edited = copy_of(w4_run, tmp_path)
    edit_config(edited, symmetric=False)  # loads silently: the zero points would all be 0
    assert main(["audit", str(edited)]) == 1
    assert ("model.layers.1.self_attn.q_proj.weight_zero_point: missing, but quantization_config.config_groups."
            "group_0.weights.symmetric is false") in problems_printed(capsys.readouterr().out)


def test_gptq_config_bits_that_the_tensors_contradict_fail(w4_run, tmp_path, capsys):
    gptq = tmp_path / "gptq"
    assert main(["export", str(w4_run), "--format", "gptq", "--output", str(gptq)]) == 0
    assert main(["audit", str(gptq)]) == 0
    capsys.readouterr()
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"]["bits"] = 2  # loads silently: 2-bit codes read from 4-bit words
    (gptq / "config.json").write_text(json.dumps(config))
    write_manifest(gptq)
    assert main(["audit", str(gptq)]) == 1
    assert ("model.layers.0.mlp.down_proj.qweight: shape (32, 128), but quantization_config.bits 2 and group_size "
            "64 make (16, 128) for in 256, out 128") in problems_printed(capsys.readouterr().out)


# --- 5. lowbit eval ----------------------------------------------------------------------------

def test_eval_of_an_altered_checkpoint_warns_and_goes_on(w4_run, tmp_path, capsys):
    broken = copy_of(w4_run, tmp_path)
    flip_bytes_inside(broken / "model.safetensors", PACKED)
    out = tmp_path / "eval"
    assert main(["eval", str(broken), "--output", str(out), *EVAL_SETS]) == 0
    printed = capsys.readouterr().out
    warning = next(line for line in printed.splitlines() if line.startswith("warning"))
    assert "failed its audit" in warning and "model.safetensors" in warning
    results = json.loads((out / "results.json").read_text())
    assert results["quality"]["perplexity"] > 0  # evaluated all the same
    assert results["audit"]["passed"] is False and results["audit"]["integrity"].startswith("FAILED")


def test_eval_of_a_clean_checkpoint_records_a_passed_audit(w4_run, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", str(w4_run), "--output", str(out), *EVAL_SETS]) == 0
    assert "warning" not in capsys.readouterr().out
    audit = json.loads((out / "results.json").read_text())["audit"]
    assert audit["passed"] and audit["quantized_share"] == 1.0 and audit["problems"] == []
