"""The same recipe, model and seed give byte-identical checkpoints.

Every file of the checkpoint is compared except those that hold timings or measured memory
(results.json, report.*) and the manifest's entries for them. The GPTQ run is repeated in a
fresh process with another string-hash seed and one thread, so neither set/dict ordering nor
the thread count can hide in the comparison.
"""
import json
import os
import subprocess
import sys

import pytest
import yaml

from tiny_models import save_tiny_llama
from lowbit.app.cli import main

TIMED = {"results.json", "report.html", "report.md"}  # wall times, measured memory
MANIFEST = "manifest.json"
W4 = {"bits": 4, "symmetric": True, "strategy": "group", "group_size": 32}
RECIPES = {
    "rtn": [{"rtn": {"scheme": W4}}],
    "gptq-kv8": [{"gptq": {"scheme": W4, "actorder": "static", "scale_search": "mse"}},
                 {"kv_cache": {"format": "int8", "strategy": "head"}}],
    "awq-rtn": [{"awq": {"scheme": W4, "grid": 4, "clip_grid": 4, "max_tokens": 256}},
                {"rtn": {"scheme": W4}}],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def write_recipe(folder, name: str):
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "calibration": {"samples": 8, "seq_len": 128, "seed": 3},
        "steps": RECIPES[name],
        "evaluate": {"baseline": False, "kl": {"enabled": False}, "memory": {"measure_peak": False},
                     "perplexity": {"max_tokens": 512, "context_len": 256, "stride": 256}},
    }))
    return path


def run_args(recipe, model_dir, out):
    return ["run", str(recipe), "--model", str(model_dir), "--output", str(out)]


def assert_same_checkpoint(a, b):
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert "model.safetensors" in names and "config.json" in names
    for name in names:
        if name not in TIMED | {MANIFEST}:
            assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs between runs"
    entries = [{k: v for k, v in json.loads((d / MANIFEST).read_text())["files"].items() if k not in TIMED}
               for d in (a, b)]
    assert entries[0] == entries[1]


@pytest.mark.parametrize("name", ["rtn", "awq-rtn"])
def test_same_recipe_twice_gives_identical_checkpoints(name, model_dir, tmp_path):
    recipe = write_recipe(tmp_path, name)
    for side in ("a", "b"):  # same folder name on both sides: the model card's title is the folder name
        assert main(run_args(recipe, model_dir, tmp_path / side / "run")) == 0
    assert_same_checkpoint(tmp_path / "a" / "run", tmp_path / "b" / "run")
    # nor does the checkpoint depend on where the source model sat (config.json's _name_or_path)
    assert str(model_dir) not in (tmp_path / "a" / "run" / "config.json").read_text()


def test_gptq_in_another_process_with_other_hash_seed_and_one_thread(model_dir, tmp_path):
    recipe = write_recipe(tmp_path, "gptq-kv8")
    assert main(run_args(recipe, model_dir, tmp_path / "a" / "run")) == 0
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "lowbit.app.cli",
                           *run_args(recipe, model_dir, tmp_path / "b" / "run")],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_checkpoint(tmp_path / "a" / "run", tmp_path / "b" / "run")
    a = json.loads((tmp_path / "a" / "run" / "results.json").read_text())
    b = json.loads((tmp_path / "b" / "run" / "results.json").read_text())
    assert a["quality"]["perplexity"] == b["quality"]["perplexity"]

