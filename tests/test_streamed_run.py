"""Streamed runs (calibration.streaming): the model is never resident, each decoder layer is read
from the shards (or the step before) when reached and written out when done; the checkpoint is the
resident run's, byte for byte."""
from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from faults import kill_run_after_layer
from streaming_models import save_sharded_tiny
from tiny_models import PINNED_RUN, save_tiny_llama
from lowbit.calibrate.arch import arch_for, decoder_layers
from lowbit.calibrate.streaming import is_resident
from lowbit.export.safetensors_join import join_safetensors
from lowbit.app import resume, resume_files
from lowbit.app.cli import main
from lowbit.app.streamed import StreamedLayers, load_skeleton

WEIGHTS_AND_CONFIG = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("streamed") / "tiny", layers=3)


def lowbit_run(recipe: str, model: Path, out: Path, *settings: str, extra=()) -> int:
    args = ["run", recipe, "--model", str(model), "--output", str(out), *extra]
    for item in (*PINNED_RUN, *settings):
        args += ["--set", item]
    return main(args)


def test_join_writes_what_save_file_writes(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.{n}": torch.randn(shape, generator=gen).to(dtype) for i in range(3)
               for n, shape, dtype in [("w", (5, 7), torch.float32), ("codes", (4, 3), torch.int32),
                                       ("scale", (9,), torch.bfloat16), ("q", (3,), torch.uint8),
                                       ("h", (2, 2), torch.float16), ("f8", (6,), torch.float8_e4m3fn)]}
    tensors["mask"] = torch.ones(3, dtype=torch.bool)
    save_file(tensors, str(tmp_path / "whole.safetensors"), metadata={"format": "pt"})
    names = list(tensors)
    parts = []
    for k in range(4):  # names spread over the parts in another order than the file's
        parts.append(tmp_path / f"part{k}.safetensors")
        save_file({n: tensors[n] for n in names[k::4]}, str(parts[-1]))
    join_safetensors(parts, tmp_path / "joined.safetensors", {"format": "pt"})
    assert (tmp_path / "joined.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    with pytest.raises(ValueError, match="in both"):
        join_safetensors(parts + parts[:1], tmp_path / "twice.safetensors")


STATIC_INT8_INPUTS = "steps.1.quantize_inputs.dynamic=false"
A_FORMAT_PER_LINEAR = "scheme={formats: {down_proj: int3_g64, o_proj: int8, v_proj: f16}, default: int4_g64}"
MIXED_FAMILIES = "scheme={formats: {down_proj: mxfp4, o_proj: fp8_e4m3, v_proj: f16}, default: int4_g32}"
FP8_GRID_THEN_STATIC_INPUTS = ["scheme={format: e4m3, strategy: channel}", "steps=[rtn, {fp8: {activations: static}}]"]


@pytest.mark.parametrize("recipe, settings", [
    ("w4a16-gptq", []), ("w4a16-rtn", []), ("w4a16-awq-gptq", []), ("w8a8-smoothquant", []),
    ("fp8-dynamic", []), ("fp8-static", []), ("w8a8-int8", []), ("w8a8-int8", [STATIC_INT8_INPUTS]),
    ("w4a16-gptq-kv8", []), ("w4a16-gptq", [A_FORMAT_PER_LINEAR]), ("w4a16-gptq", ["scheme={mx: fp4}"]),
    ("w4a16-gptq", [MIXED_FAMILIES]), ("w4a16-rtn", FP8_GRID_THEN_STATIC_INPUTS),
    ("w4a16-signround", ["steps.0.signround.iterations=6", "steps.0.signround.batch=2"]),
    ("w4a16-signround", ["steps.0.signround.iterations=6", "steps.0.signround.batch=2",
                         "steps.0.signround.target=model"]),
])
def test_streamed_checkpoint_is_the_resident_one(recipe, settings, tiny, tmp_path):
    """Every kind of step: walks (gptq, awq, smoothquant, signround), data-free ones applied a layer at a time
    (rtn, fp8, dynamic inputs), and those observing whole forwards resident (static input scales,
    KV-cache scales), observed by a layer walk when streamed."""
    assert lowbit_run(recipe, tiny, tmp_path / "resident", "calibration.streaming=false", *settings) == 0
    assert lowbit_run(recipe, tiny, tmp_path / "streamed", "calibration.streaming=true", *settings) == 0
    for name in WEIGHTS_AND_CONFIG:
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "resident" / name).read_bytes(), name
    resident = json.loads((tmp_path / "resident" / "results.json").read_text())
    streamed = json.loads((tmp_path / "streamed" / "results.json").read_text())
    assert streamed["quality"]["perplexity"] == resident["quality"]["perplexity"]
    assert streamed["audit"]["checked"] == resident["audit"]["checked"] > 0
    assert streamed["audit"]["ignored"] == resident["audit"]["ignored"]


@pytest.mark.parametrize("recipe", ["gguf-q4_0", "gguf-q4_k-gptq"])
def test_streamed_gguf_is_the_resident_one(recipe, tiny, tmp_path):
    """model.gguf written a layer at a time from its parts holds every tensor where the resident
    run's file does: the same bytes."""
    assert lowbit_run(recipe, tiny, tmp_path / "resident", "calibration.streaming=false") == 0
    assert lowbit_run(recipe, tiny, tmp_path / "streamed", "calibration.streaming=true") == 0
    for name in ("model.gguf", "config.json"):
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "resident" / name).read_bytes(), name
    resident = json.loads((tmp_path / "resident" / "results.json").read_text())
    streamed = json.loads((tmp_path / "streamed" / "results.json").read_text())
    assert streamed["quality"]["perplexity"] == resident["quality"]["perplexity"]
    assert streamed["audit"]["checked"] == resident["audit"]["checked"] > 0


@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text", "phi3", "opt"])
def test_streamed_equals_resident_across_architectures(model_type, tmp_path, tiny_tokenizer_dir):
    """Sharded folders (several files and an index), tied and untied heads, fused projections,
    per-layer masks: the streamed checkpoint is still the resident one."""
    folder = save_sharded_tiny(tmp_path / model_type, model_type, tiny_tokenizer_dir)
    for mode in ("false", "true"):
        assert lowbit_run("w4a16-gptq", folder, tmp_path / mode, f"calibration.streaming={mode}") == 0
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "true" / name).read_bytes() == (tmp_path / "false" / name).read_bytes(), name


def test_streamed_gguf_of_an_untied_sharded_model_is_the_resident_one(tmp_path, tiny_tokenizer_dir):
    """An untied head read from its own shard, the output tensor beside token_embd: model.gguf
    is still the resident run's."""
    folder = save_sharded_tiny(tmp_path / "qwen2", "qwen2", tiny_tokenizer_dir)
    for mode in ("false", "true"):
        assert lowbit_run("gguf-q4_0", folder, tmp_path / mode, f"calibration.streaming={mode}") == 0
    assert (tmp_path / "true" / "model.gguf").read_bytes() == (tmp_path / "false" / "model.gguf").read_bytes()


def test_a_streamed_walk_holds_one_layer(tmp_path, tiny_tokenizer_dir):
    """Sharded folder (several files and an index): during a step's walk only the layer being
    calibrated has weights; the rest of the model stays on the meta device."""
    from lowbit.calibrate.walker import walk
    from lowbit.recipes.schema import load_recipe

    folder = save_sharded_tiny(tmp_path / "llama", "llama", tiny_tokenizer_dir)
    model, tokenizer, weights, _ = load_skeleton(load_recipe("w4a16-rtn"), str(folder))
    arch = arch_for(model)
    source = StreamedLayers(model, arch, weights, [])
    seen = []

    def on_layer(i, prefix, layer, inputs):
        seen.append([is_resident(other) for other in decoder_layers(model, arch)])

    batches = torch.randint(0, 1000, (2, 16))
    walk(model, arch, batches, on_layer, source=source)
    layers = len(decoder_layers(model, arch))
    assert seen == [[j == i for j in range(layers)] for i in range(layers)]
    assert not any(is_resident(layer) for layer in decoder_layers(model, arch))
    assert not is_resident(model.get_input_embeddings())  # resident only while inputs were captured


def test_streamed_run_never_loads_the_model(tiny, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from lowbit.app import run

    def refuse(*args, **kwargs):
        raise AssertionError("a streamed run loaded the whole model")

    monkeypatch.setattr(run, "load_model", refuse)
    original = AutoModelForCausalLM.from_pretrained

    def only_the_checkpoint(path, *args, **kwargs):  # the evaluation reloads what was written
        if Path(path).resolve() == tiny.resolve():
            refuse()
        return original(path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", only_the_checkpoint)
    assert lowbit_run("w4a16-gptq", tiny, tmp_path / "out", "calibration.streaming=true",
                      "evaluate.baseline=true") == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["quality"]["baseline_perplexity"] > 0  # measured streamed


def test_killed_streamed_run_resumes_to_the_same_checkpoint(tiny, tmp_path):
    settings = [x for item in (*PINNED_RUN, "calibration.streaming=true") for x in ("--set", item)]
    assert main(["run", "w4a16-gptq", "--model", str(tiny), "--output", str(tmp_path / "whole"), *settings]) == 0
    out = tmp_path / "killed"
    code = kill_run_after_layer(["run", "w4a16-gptq", "--model", str(tiny), "--output", str(out), *settings], 1)
    assert code == -signal.SIGKILL and not out.exists()
    assert resume_files.finished_layers(resume.resume_dir(out)) == 2
    damaged = tmp_path / "damaged"  # the same kill's folder with layer 1 cut short and the outputs gone
    shutil.copytree(resume.resume_dir(out), resume.resume_dir(damaged))
    (resume.resume_dir(damaged) / "step0" / "hidden1.safetensors").unlink()
    layer1 = resume.resume_dir(damaged) / "step0" / "layer1.safetensors"
    layer1.write_bytes(layer1.read_bytes()[:1000])
    start = time.perf_counter()
    assert main(["run", "w4a16-gptq", "--model", str(tiny), "--output", str(out), "--resume", *settings]) == 0
    assert time.perf_counter() - start < 600
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()
    assert not resume.resume_dir(out).exists()
    # the streamed store is the only copy of its layers: layer 1 is computed again from the shards, on
    # layer 0's outputs recomputed from its saved state
    assert main(["run", "w4a16-gptq", "--model", str(tiny), "--output", str(damaged), "--resume", *settings]) == 0
    assert (damaged / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("recipe, settings, why", [
    ("w4a16-rtn", ["ignore=[]"], "keep lm_head in `ignore`"),
])
def test_what_cannot_stream_is_refused_before_any_work(recipe, settings, why, tiny, tmp_path, capsys):
    assert lowbit_run(recipe, tiny, tmp_path / "out", "calibration.streaming=true", *settings) == 2
    err = capsys.readouterr().err
    assert "calibration.streaming" in err and why in err
    assert not (tmp_path / "out").exists() and not resume.resume_dir(tmp_path / "out").exists()


def test_streaming_needs_a_local_folder(tmp_path, capsys):
    assert lowbit_run("w4a16-rtn", Path("some-org/not-here"), tmp_path / "out", "calibration.streaming=true") == 2
    assert "is not a local folder" in capsys.readouterr().err


def test_auto_streams_only_what_does_not_fit(tiny, monkeypatch):
    from lowbit.app import streamed
    from lowbit.recipes.schema import load_recipe

    recipe = load_recipe("w4a16-rtn", (f"model={tiny}",))
    assert recipe.calibration.streaming == "auto"
    monkeypatch.setattr(streamed, "available_memory_bytes", lambda: 2**40)
    assert streamed.streaming_folder(recipe) is None
    monkeypatch.setattr(streamed, "available_memory_bytes", lambda: 2**20)  # less than the tiny model
    assert streamed.streaming_folder(recipe) == str(tiny)
    gguf = load_recipe("gguf-q4_0", (f"model={tiny}",))
    assert streamed.streaming_folder(gguf) == str(tiny)  # one model.gguf, written from its parts


def test_device_names_are_checked(tiny, tmp_path, capsys):
    from lowbit.calibrate.hardware import resolve_device

    assert lowbit_run("w4a16-rtn", tiny, tmp_path / "out", extra=["--device", "gpu"]) == 2
    assert "calibration.device must be auto, cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
        return
    assert resolve_device("auto") == torch.device("cpu")
    assert lowbit_run("w4a16-rtn", tiny, tmp_path / "out", extra=["--device", "cuda:1"]) == 2
    assert "torch sees 0 CUDA device(s)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
