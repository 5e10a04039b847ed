"""Model-loading trust: lowbit never invents a weight (a missing, unexpected or reshaped tensor is
refused in one line), refuses encoders, encoder-decoders and headless models before reading any
weight, runs a model's own code only when asked and then carries it into every checkpoint, says in
one fast line why a hub id cannot be found offline, and opens no shard an index names outside its
folder. Every folder here is real: built by transformers, then edited on disk."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import yaml

from model_folders import copy_folder, looks_like_checkpoint
from tiny_models import SMALL_RUN, make_tiny_model
from trust_models import AUTO_MAP, CODE_FILES, edit_weights, save_non_causal, save_remote_code_model
from lowbit.calibrate.model_config import check_decoder_lm
from lowbit.calibrate.models import load_model
from lowbit.calibrate.streaming import ShardedWeights, check_weights_match, empty_model
from lowbit.export.formats.hf_folder import read_safetensors
from lowbit.export.reader import load
from lowbit.recipes.schema import shipped_recipes
from lowbit.app.cli import main

DOWN = "model.layers.1.mlp.down_proj.weight"  # (hidden 128, intermediate 256) in the tiny llama
SETS = [f"--set={s}" for s in SMALL_RUN]
SETS_EVAL = [s for s in SMALL_RUN if s.startswith("evaluate.")]
CLI = "import sys; from lowbit.app.cli import main; sys.exit(main(sys.argv[1:]))"


def error_line(stderr: str) -> str:
    """The one `lowbit: error:` line a refusal prints, with no traceback."""
    lines = [line for line in stderr.splitlines() if line.startswith("lowbit: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def refused(args, capsys) -> str:
    """Run `lowbit …`, expect exit 2 before any calibration; its error line."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "calibration data:" not in err  # printed when the first calibration batch is built
    return error_line(err)


# --- 1. no invented weights ---

WEIGHT_DAMAGE = {
    "removed": (lambda t: t.pop(DOWN), f"missing: {DOWN}"),
    "unexpected": (lambda t: t.__setitem__("model.layers.1.mlp.extra_proj.weight", torch.zeros(4, 4)),
                   "unexpected: model.layers.1.mlp.extra_proj.weight"),
    "reshaped": (lambda t: t.__setitem__(DOWN, torch.zeros(128, 128)),
                 f"another shape: {DOWN} [128, 128] (expected [128, 256])"),
}


@pytest.mark.parametrize("damage", sorted(WEIGHT_DAMAGE))
def test_resident_load_refuses_weights_config_json_does_not_describe(model_copy, damage):
    change, expected = WEIGHT_DAMAGE[damage]
    edit_weights(model_copy, change)
    with pytest.raises(ValueError) as err:
        load_model(str(model_copy))
    message = str(err.value)
    assert str(model_copy) in message and expected in message and "\n" not in message


@pytest.mark.parametrize("damage", sorted(WEIGHT_DAMAGE))
def test_streamed_skeleton_refuses_them_from_the_shard_headers(model_copy, damage):
    change, expected = WEIGHT_DAMAGE[damage]
    edit_weights(model_copy, change)
    with pytest.raises(ValueError) as err:
        check_weights_match(empty_model(model_copy), ShardedWeights(model_copy))
    assert str(model_copy) in str(err.value) and expected in str(err.value)


@pytest.mark.parametrize("streaming", ["false", "true"])
def test_run_on_a_removed_tensor_exits_2_before_calibrating(model_copy, tmp_path, capsys, streaming):
    edit_weights(model_copy, lambda t: t.pop(DOWN))
    out = tmp_path / "out"
    line = refused(["run", "w4a16-rtn", "--model", str(model_copy), "--output", str(out),
                    f"--set=calibration.streaming={streaming}", *SETS], capsys)
    assert str(model_copy) in line and f"missing: {DOWN}" in line
    assert not looks_like_checkpoint(out)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "opt", "gemma3_text", "qwen3"])
def test_whole_checkpoints_load_and_stream_without_a_refusal(model_type, tmp_path, tiny_tokenizer_dir):
    """Tied heads saved once (gpt2), untied heads, non-persistent buffers: nothing is refused, and
    every tensor loaded is the one saved."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    folder = tmp_path / model_type
    make_tiny_model(model_type).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(folder)
    model, _, _ = load_model(str(folder))
    check_weights_match(empty_model(folder), ShardedWeights(folder))
    state = model.state_dict()
    for name, saved in load_file(str(folder / "model.safetensors")).items():
        assert torch.equal(state[name], saved), name


# --- 2. encoders, encoder-decoders, headless models: refused before any weight is read ---

NON_CAUSAL = {
    "t5": "config.json's is_encoder_decoder is true (model_type 't5'), an encoder-decoder model",
    "bert-mlm": "config.json's architectures is ['BertForMaskedLM'], a masked language model (an encoder)",
    "bert": "config.json's architectures is ['BertModel'], an encoder",
    "llama-headless": "config.json's architectures is ['LlamaModel'], a base model without its LM head",
}


@pytest.mark.parametrize("streaming", ["false", "true"])
@pytest.mark.parametrize("kind", sorted(NON_CAUSAL))
def test_non_causal_and_headless_models_are_refused_before_loading(kind, streaming, tmp_path, capsys):
    folder = save_non_causal(kind, tmp_path / kind)  # no tokenizer in it: the refusal comes before it is read
    line = refused(["run", "w4a16-rtn", "--model", str(folder), "--output", str(tmp_path / "out"),
                    f"--set=calibration.streaming={streaming}", *SETS], capsys)
    assert f"{folder}: {NON_CAUSAL[kind]}" in line
    assert "lowbit quantizes decoder-only causal language models" in line


@pytest.mark.parametrize("architectures,model_type", [
    (["LlamaForCausalLM"], "llama"), (["GPT2LMHeadModel"], "gpt2"),
    (["Gemma3ForConditionalGeneration"], "gemma3"), (["Llama4ForConditionalGeneration"], "llama4"),
])
def test_causal_lms_and_their_wrapper_classes_pass_the_config_check(architectures, model_type):
    config = {"architectures": architectures, "model_type": model_type, "tie_word_embeddings": False}
    check_decoder_lm(config, "m")  # raises for an encoder, as the test above shows
    with pytest.raises(ValueError, match="an encoder"):
        check_decoder_lm({**config, "architectures": ["BertForMaskedLM"], "model_type": "bert"}, "m")


# --- 3. a model with its own code: refused unless asked, then carried into every checkpoint ---

def trusting_recipe(root, folder):
    """The shipped w4a16-rtn recipe, with the model and `trust_remote_code: true`."""
    recipe = yaml.safe_load(shipped_recipes()["w4a16-rtn"].read_text())
    path = root / "w4a16-rtn-trusted.yaml"
    path.write_text(yaml.safe_dump({**recipe, "model": str(folder), "trust_remote_code": True}))
    return path


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """(model folder, checkpoint, exit code) of `lowbit run` on a tiny model with its own code."""
    root = tmp_path_factory.mktemp("remote")
    folder = save_remote_code_model(root / "tinycustom")
    out = root / "run"
    return folder, out, main(["run", str(trusting_recipe(root, folder)), "--output", str(out), *SETS])


def test_remote_code_model_runs_and_its_checkpoint_carries_the_code(remote):
    folder, out, code = remote
    assert code == 0
    for name, text in CODE_FILES.items():  # the auto_map modules and the file modeling_* imports
        assert (out / name).read_text() == text
    assert json.loads((out / "config.json").read_text())["auto_map"] == AUTO_MAP
    card = (out / "README.md").read_text()
    assert "| Model code | its own, carried beside config.json: `configuration_tinycustom.py`, " \
           "`modeling_tinycustom.py`" in card


def test_its_checkpoint_reloads_in_a_fresh_process_from_elsewhere(remote, tmp_path):
    _, out, code = remote
    assert code == 0
    moved = shutil.copytree(out, tmp_path / "elsewhere" / "checkpoint")  # nothing of the source folder needed
    script = ("import sys; from lowbit.export.reader import load; "
              "from lowbit.quantize.runtime.modules import is_quantized_linear; "
              "m, _ = load(sys.argv[1], trust_remote_code=True); "
              "print(type(m).__name__, sum(map(is_quantized_linear, m.modules())))")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}  # no code cached from the run
    result = subprocess.run([sys.executable, "-c", script, str(moved)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    name, quantized = result.stdout.split()[-2:]
    assert name == "TinyCustomForCausalLM" and int(quantized) == 14  # 2 layers x 7 linears


def test_without_the_recipe_key_the_model_is_refused_before_loading(remote, tmp_path, capsys):
    folder, _, _ = remote
    out = tmp_path / "out"
    line = refused(["run", "w4a16-rtn", "--model", str(folder), "--output", str(out), *SETS], capsys)
    assert (f"{folder}: config.json's auto_map needs the model's own code (configuration_tinycustom.py, "
            "modeling_tinycustom.py)") in line and "`trust_remote_code: true`" in line
    assert not looks_like_checkpoint(out)


def test_code_that_cannot_be_found_is_refused_before_calibrating(remote, tmp_path, capsys):
    folder = copy_folder(remote[0], tmp_path / "tinycustom")
    (folder / "tinycustom_scale.py").unlink()
    line = refused(["run", str(trusting_recipe(tmp_path, folder)), "--output", str(tmp_path / "out"), *SETS], capsys)
    assert f"{folder / 'tinycustom_scale.py'}: missing; modeling_tinycustom.py needs it" in line


def test_a_streamed_run_carries_the_code_too(remote, tmp_path):
    folder = remote[0]
    out = tmp_path / "streamed"
    assert main(["run", str(trusting_recipe(tmp_path, folder)), "--output", str(out),
                 "--set=calibration.streaming=true", *SETS]) == 0
    assert all((out / name).read_text() == text for name, text in CODE_FILES.items())


def test_lowbit_export_carries_the_code_only_when_asked(remote, tmp_path, capsys):
    _, out, code = remote
    assert code == 0
    dense = tmp_path / "dense"
    line = refused(["export", str(out), "--format", "dense", "--output", str(dense)], capsys)
    assert "config.json's auto_map needs the model's own code" in line and "--trust-remote-code" in line
    assert main(["export", str(out), "--format", "dense", "--output", str(dense), "--trust-remote-code"]) == 0
    assert all((dense / name).read_text() == text for name, text in CODE_FILES.items())


def test_audit_and_eval_of_its_checkpoint_run_the_code_only_when_asked(remote, tmp_path, capsys):
    _, out, code = remote
    assert code == 0
    capsys.readouterr()
    line = refused(["audit", str(out)], capsys)
    assert "config.json's auto_map needs the model's own code" in line and "--trust-remote-code" in line
    assert main(["audit", str(out), "--trust-remote-code"]) == 0
    assert "passed" in capsys.readouterr().out
    evals = [f"--set={s}" for s in SETS_EVAL]
    assert main(["eval", str(out), "--trust-remote-code", "--output", str(tmp_path / "eval"), *evals]) == 0
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["audit"]["passed"] is True


def test_reader_refuses_a_checkpoint_with_a_removed_tensor(remote, tmp_path):
    _, out, code = remote
    assert code == 0
    damaged = edit_weights(copy_folder(out, tmp_path / "damaged"), lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError) as err:
        load(damaged, trust_remote_code=True)
    assert f"{damaged}: its weights do not match" in str(err.value) and "missing: model.norm.weight" in str(err.value)


# --- 4. a hub id that is nowhere: one line, fast ---

@pytest.mark.parametrize("setting,reason", [
    ({"HF_HUB_OFFLINE": "1"}, "the hub is not asked (HF_HUB_OFFLINE is set)"),
    ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "the hub http://127.0.0.1:9 could not be reached"),  # nothing listens
])
def test_unknown_hub_model_offline_is_one_fast_line(tmp_path, setting, reason):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")}
    env.update(setting, HF_HUB_CACHE=str(tmp_path / "hub"))  # an empty cache: the model is in none
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", CLI, "run", "w4a16-rtn", "--model", "someorg/nosuchmodel",
                             "--output", str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and time.monotonic() - start < 60
    line = error_line(result.stderr)
    assert ("'someorg/nosuchmodel': not a built-in model (built-ins: smollm2-135m); not a local folder; "
            f"not in the Hugging Face cache at {tmp_path / 'hub'}; {reason}") in line
    assert "Retrying" not in result.stderr and not looks_like_checkpoint(tmp_path / "out")


# --- 5. an index's shard names stay inside the model folder ---

@pytest.mark.parametrize("shard", ["absolute", "../outside.safetensors", "sub/model.safetensors", ".."])
def test_index_naming_a_shard_outside_the_folder_is_refused(model_copy, tmp_path, shard):
    outside = shutil.copy(model_copy / "model.safetensors", tmp_path / "outside.safetensors")  # whole, readable
    (model_copy / "sub").mkdir()
    shutil.copy(outside, model_copy / "sub" / "model.safetensors")
    shard = str(outside) if shard == "absolute" else shard
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00001.safetensors")
    weight_map = {name: "model-00001-of-00001.safetensors" for name in ShardedWeights(model_copy).shard_of}
    index = model_copy / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {**weight_map, DOWN: shard}}))
    for read in (lambda: load_model(str(model_copy)), lambda: ShardedWeights(model_copy),
                 lambda: read_safetensors(model_copy)):
        with pytest.raises(ValueError) as err:
            read()
        assert f"{index}: weight_map[{DOWN!r}] is {shard!r}; a shard must be a plain file name" in str(err.value)
