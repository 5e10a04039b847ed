"""Bad input fails early with an error that names the file, key, layer or parameter, and never
leaves a half checkpoint that looks whole. Tiny random models; the CLI where it is the user's path."""
import errno
import json
import os

import pytest
import torch

from model_folders import copy_folder, leftovers, looks_like_checkpoint
from tiny_models import make_tiny_model
from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.checks import check_finite_weights
from lowbit.calibrate.models import load_model
from lowbit.export import checkpoint
from lowbit.quantize.steps import awq
from lowbit.quantize.steps import gptq
from lowbit.quantize.steps import rtn
from lowbit.quantize.grids.integer import IntScheme, check_group_size
from lowbit.quantize.steps.context import StepContext
from lowbit.app.cli import main

FAST = ["--set", "evaluate.baseline=false", "--set", "evaluate.kl.enabled=false",
        "--set", "evaluate.perplexity.max_tokens=256", "--set", "evaluate.perplexity.context_len=128",
        "--set", "evaluate.perplexity.stride=128", "--set", "calibration.samples=2",
        "--set", "calibration.seq_len=32"]


def run_cli(args, out, capsys) -> str:
    """Run `lowbit …`, expect the clear-error exit code, return stderr; nothing whole at `out`."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "lowbit: error:" in err and "Traceback" not in err
    assert not looks_like_checkpoint(out)
    return err.split("lowbit: error:", 1)[1]


# --- the recipe: malformed YAML, unknown keys, wrong types, impossible values ---

@pytest.mark.parametrize("text,expected", [
    ("steps: [rtn: {scheme: {bits: 4\n", "not valid YAML"),
    ("calibration: {samples: 8, sampels: 3}\n", "calibration.sampels: unknown key; valid keys here:"),
    ("steps:\n  - rtn: {scheme: {bits: four}}\n", "steps[0].rtn.scheme.bits: expected int, got a string 'four'"),
    ("calibration: {samples: 0}\n", "calibration needs samples >= 1"),
    ("steps:\n  - rtn: {scheme: {bits: 4, strategy: group}}\n", "steps[0].rtn.scheme: group_size is required"),
    ("steps:\n  - gptq: {scheme: {bits: 12}}\n", "bits"),
    ("steps:\n  - gptq: {bits: 4}\n", "steps[0].gptq.bits: unknown key; the weight grid's options (bits) go under scheme:"),
    ("\xff\xfe", "not a UTF-8 text file"),
    ("ignore: ['re:(']\n", "ignore[0]: 're:(' is not a valid regular expression"),
])
def test_bad_recipe_is_refused_by_the_cli_naming_file_and_key(tmp_path, capsys, text, expected):
    recipe = tmp_path / "bad.yaml"
    recipe.write_bytes(text.encode("latin-1"))
    out = tmp_path / "out"
    err = run_cli(["run", str(recipe), "--output", str(out)], out, capsys)
    assert str(recipe) in err and expected in err
    assert not out.exists()


@pytest.mark.parametrize("step", ["rtn", "gptq", "awq"])
def test_group_size_that_does_not_divide_names_layer_and_valid_sizes(step):
    model = make_tiny_model("llama")  # in_features 128 (attention, gate/up) and 256 (down_proj)
    scheme = dict(bits=4, strategy="group", group_size=96)
    cfg = {"rtn": lambda: rtn.RTNConfig(IntScheme(**scheme)), "gptq": lambda: gptq.GPTQConfig(IntScheme(**scheme)),
           "awq": lambda: awq.AWQConfig(scheme=IntScheme(4, True, "group", 96))}[step]()
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: pytest.fail("needs no data to refuse"))
    with pytest.raises(ValueError) as err:
        {"rtn": rtn, "gptq": gptq, "awq": awq}[step].apply(ctx, cfg)
    msg = str(err.value)
    assert "layer model.layers.0.self_attn.q_proj" in msg and "in_features 128" in msg
    assert "valid group sizes: [16, 32, 64, 128]" in msg


def test_group_size_message_when_no_common_size_divides():
    with pytest.raises(ValueError, match=r"layer x: .* in_features 100; no common group size .* strategy: channel"):
        check_group_size(IntScheme(bits=4, strategy="group", group_size=64), 100, "x")


# --- the model folder: missing or truncated files ---

def _truncate(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _shard_missing(folder):
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


DAMAGE = {
    "truncated weights": (_truncate, ValueError, "model.safetensors: truncated or corrupt"),
    "weights missing": (lambda f: (f / "model.safetensors").unlink(), FileNotFoundError,
                        "no *.safetensors weights"),
    "config missing": (lambda f: (f / "config.json").unlink(), FileNotFoundError, "config.json: missing"),
    "shard missing": (_shard_missing, FileNotFoundError,
                      "model-00002-of-00002.safetensors: weight shard missing"),
    "tokenizer missing": (lambda f: [(f / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
                          ValueError, "could not load its tokenizer"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_model_folder_is_named(model_copy, damage):
    spoil, error, message = DAMAGE[damage]
    spoil(model_copy)
    with pytest.raises(error) as err:
        load_model(str(model_copy))
    assert message in str(err.value) and str(model_copy) in str(err.value)


def test_model_folder_that_does_not_exist_is_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder .*nowhere does not exist"):
        load_model(str(tmp_path / "nowhere"))


def test_cli_run_on_truncated_model_names_the_file(model_copy, tmp_path, capsys):
    _truncate(model_copy)
    out = tmp_path / "out"
    err = run_cli(["run", "w8a16-rtn", "--model", str(model_copy), "--output", str(out), *FAST], out, capsys)
    assert str(model_copy / "model.safetensors") in err and "truncated" in err
    assert leftovers(tmp_path, "out") == []


# --- the tokenizer, the calibration data, the weights ---

def test_tokenizer_without_bos_or_eos_fails_before_any_work(model_copy, tmp_path, capsys):
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    config.update(bos_token=None, eos_token=None)
    (model_copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_model(str(model_copy))[1].bos_token_id is None
    out = tmp_path / "out"
    err = run_cli(["run", "w8a16-rtn", "--model", str(model_copy), "--output", str(out), *FAST], out, capsys)
    assert "bos: true" in err and "evaluate.perplexity.bos=false" in err
    assert leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("text,expected", [("", "has 0 tokens (the text is empty)"),
                                           ("just a few words", "fewer than one sample of seq_len 32")])
def test_empty_or_too_small_calibration_text(tiny_folder, tmp_path, capsys, text, expected):
    data = tmp_path / "calib.txt"
    data.write_text(text)
    out = tmp_path / "out"
    err = run_cli(["run", "w4a16-gptq", "--model", str(tiny_folder), "--output", str(out), *FAST,
                   "--set", f"calibration.dataset={data}"], out, capsys)
    assert str(data) in err and expected in err
    assert leftovers(tmp_path, "out") == []


def test_nan_weight_is_refused_naming_the_parameter(tmp_path, capsys, tiny_folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight has 1 NaN and 0 inf"):
        check_finite_weights(model)
    folder = copy_folder(tiny_folder, tmp_path / "nan-model")
    model.save_pretrained(folder)
    out = tmp_path / "out"
    err = run_cli(["run", "w8a16-rtn", "--model", str(folder), "--output", str(out), *FAST], out, capsys)
    assert "model.layers.1.mlp.down_proj.weight has 1 NaN" in err
    assert leftovers(tmp_path, "out") == []


def test_inf_weight_is_refused_too():
    model = make_tiny_model("qwen2")
    with torch.no_grad():
        model.model.embed_tokens.weight[0, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight has 0 NaN and 1 inf"):
        check_finite_weights(model)
    check_finite_weights(make_tiny_model("qwen2"))  # a sound model passes


# --- the output folder ---

def test_output_that_is_a_file_or_under_a_file(tiny_folder, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    for out, expected in [(blocker, "exists and is not a folder"), (blocker / "run", "cannot create the folder")]:
        err = run_cli(["run", "w8a16-rtn", "--model", str(tiny_folder), "--output", str(out), *FAST], out, capsys)
        assert expected in err and str(blocker) in err
    assert blocker.read_text() == "not a folder"


def test_read_only_parent_is_refused(tiny_folder, tmp_path, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        if os.access(parent, os.W_OK):
            pytest.skip("permissions are not enforced for this user (root)")
        err = run_cli(["run", "w8a16-rtn", "--model", str(tiny_folder), "--output", str(parent / "run"), *FAST],
                      parent / "run", capsys)
        assert f"cannot create files in {parent}" in err
    finally:
        parent.chmod(0o700)


def test_unwritable_parent_is_refused_before_any_work(tiny_folder, tmp_path, capsys, monkeypatch):
    """The same check as above, simulated so that it runs as root too; refused before loading."""
    parent = tmp_path / "ro"
    parent.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(parent) else
                        real_access(p, mode, **kw))
    monkeypatch.setattr("lowbit.app.run.load_model", lambda *a, **k: pytest.fail("loaded the model"))
    err = run_cli(["run", "w8a16-rtn", "--model", str(tiny_folder), "--output", str(parent / "run")], parent / "run",
                  capsys)
    assert f"cannot create files in {parent}" in err and list(parent.iterdir()) == []


# --- a failed publish (real disk-full and file-size faults: test_run_faults.py) ---

def test_failed_publish_puts_the_previous_checkpoint_back(tmp_path, monkeypatch):
    out = checkpoint.save(make_tiny_model("llama"), None, tmp_path / "out", checkpoint.ExportConfig())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_rename = type(out).rename

    def rename(self, target):
        if self.name.startswith(".out.partial-"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(self, target)

    monkeypatch.setattr(type(out), "rename", rename)
    with pytest.raises(OSError, match="cross-device"):
        checkpoint.save(make_tiny_model("llama", seed=1), None, out, checkpoint.ExportConfig(), overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert leftovers(tmp_path, "out") == ["out"]
