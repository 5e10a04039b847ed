"""A run that quantizes nothing publishes nothing as quantized, and the run's audit and `lowbit
audit` of its folder agree on hostile cases (every shipped recipe: tests/test_recipe_pins.py).

A recipe whose plan quantizes no weight is refused before the model is loaded (no step, steps that
write no weight grid) or before any step (an ignore list matching every linear); a float export is
asked for with `export: {format: dense}`, and its audit and model card say "not quantized". A
checkpoint with one expert turned back to float counts it as float in the audit's summary."""
import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from audit_agreement import assert_audits_agree
from tiny_models import SMALL_RUN, save_tiny_llama, save_tiny_qwen3_moe
from lowbit.app.cli import main
from lowbit.export.manifest import write_manifest
from lowbit.export.reader import load

RUN_SETS = [f"--set={s}" for s in SMALL_RUN]
HINT = ("add a weight step (gptq, signround, rtn, rtn_mse, fp8; `lowbit recipes` lists the shipped recipes) or set "
        "export.format: dense for a float export")
EXPERT = "model.layers.0.mlp.experts.3.up_proj"


def refused(args, capsys) -> str:
    """The one line an exit-2 refusal ends with (progress lines of loading the model may precede it)."""
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line for line in lines if line.startswith("lowbit:")] == lines[-1:], lines
    return lines[-1]


def test_a_recipe_without_a_weight_step_is_refused_before_the_model_is_loaded(tmp_path, capsys):
    """The model named does not exist: the recipe is refused before anything looks for it."""
    absent, out = str(tmp_path / "no-model-here"), str(tmp_path / "run")
    (tmp_path / "empty.yaml").write_text("")
    line = refused(["run", str(tmp_path / "empty.yaml"), "--model", absent, "--output", out], capsys)
    assert line == f"lowbit: error: recipe empty: steps: quantizes no linear: steps is empty; {HINT}"
    line = refused(["run", "w4a16-rtn", "--set", "steps=[]", "--model", absent, "--output", out], capsys)
    assert line.startswith("lowbit: error: recipe w4a16-rtn: steps: quantizes no linear: steps is empty")
    (tmp_path / "kv.yaml").write_text("steps:\n  - kv_cache: {format: fp8, strategy: tensor}\n")
    line = refused(["run", str(tmp_path / "kv.yaml"), "--model", absent, "--output", out], capsys)
    assert line == f"lowbit: error: recipe kv: steps: quantizes no linear: none of its steps (kv_cache) writes a " \
                   f"weight grid; {HINT}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.yaml", "kv.yaml"]  # nothing written


def test_an_ignore_list_matching_every_linear_is_refused_before_any_step(tmp_path, capsys):
    model = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "run"
    line = refused(["run", "w4a16-rtn", "--model", str(model), "--output", str(out), "--set", "ignore=['re:.*']",
                    *RUN_SETS], capsys)
    assert line == (f"lowbit: error: recipe w4a16-rtn: ignore: quantizes no linear of {model}: all 15 of its linears "
                    "stay float (matches the recipe's ignore pattern 're:.*'); narrow ignore so that a linear is "
                    "quantized, or set export.format: dense for a float export")
    assert not out.exists() and not (tmp_path / ".run.resume").exists()


def test_a_float_export_asked_for_is_published_as_not_quantized(tmp_path, capsys):
    model = save_tiny_llama(tmp_path / "tiny")
    (tmp_path / "float.yaml").write_text("export: {format: dense}\n")
    out = tmp_path / "run"
    assert main(["run", str(tmp_path / "float.yaml"), "--model", str(model), "--output", str(out), *RUN_SETS]) == 0
    said = capsys.readouterr().out
    audit = assert_audits_agree(out, said, capsys)
    note = "a float export (export.format dense), no weight step"
    assert audit["passed"] and audit["float_export"] == note and audit["checked"] == 0
    assert f"audit       not quantized: {note}" in said and "perplexity  float" in said
    card = (out / "README.md").read_text()
    assert "**not quantized**, written by lowbit" in card and "quantized with lowbit" not in card
    assert f"| Audit | not quantized: {note}" in card
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_one_expert_turned_back_to_float_is_counted_as_float_and_named(tmp_path, capsys):
    model = save_tiny_qwen3_moe(tmp_path / "moe")
    out = tmp_path / "run"
    assert main(["run", "w4a16-rtn", "--model", str(model), "--output", str(out), *RUN_SETS]) == 0
    clean = assert_audits_agree(out, capsys.readouterr().out, capsys)
    assert clean["schemes"] == {"int4 sym group 64": 32}
    edited = shutil.copytree(out, tmp_path / "edited")
    float_expert(edited, EXPERT)
    assert main(["audit", str(edited)]) == 1
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"audit       {edited}: FAILED (1 problems): 32 linears checked")
    assert f"  linears   31 int4 sym group 64, 1 float (FAILED: {EXPERT})" in printed
    assert [p for p in printed if "PROBLEM" in p] == [
        f"  PROBLEM   {EXPERT}: is float Linear, the recipe asks for int4 sym group 64"]


def float_expert(folder, name: str) -> None:
    """Rewrite the checkpoint with one expert projection dequantized into a plain bf16 weight (its
    codes, scales and shape dropped) and manifest.json re-recorded, as a tool that rewrote the
    folder would: the files are consistent, the expert is float."""
    weight = load(folder)[0].get_submodule(name).dequantized_weight().to(torch.bfloat16)
    path = folder / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if not k.startswith(name + ".")}
    save_file({**tensors, f"{name}.weight": weight}, path, metadata={"format": "pt"})
    write_manifest(folder)
