"""The `lowbit` CLI end to end: on a tiny local model folder (fast) and on the real model (slow)."""
import json

import pytest
from tiny_models import save_tiny_llama

from lowbit.app.cli import main

QUICK_EVAL = ["--set", "evaluate.perplexity.max_tokens=1024", "--set", "evaluate.perplexity.context_len=256",
              "--set", "evaluate.perplexity.stride=256"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random llama saved with the smollm2 tokenizer (same vocabulary)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_cli_run_writes_checkpoint_and_results(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    code = main(["run", "w8a16-rtn", "--model", str(tiny_model_dir), "--output", str(out), *QUICK_EVAL])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results) >= {"lowbit_version", "model", "recipe", "quality", "memory", "timing"}
    assert results["model"]["id"] == str(tiny_model_dir)
    assert results["recipe"]["steps"] == [{"rtn": {"scheme": {"bits": 8, "symmetric": True, "strategy": "channel",
                                                              "group_size": None}}}]
    q = results["quality"]
    assert q["protocol"]["context_len"] == 256 and q["protocol"]["tokens_scored"] == 1024
    assert q["perplexity"] > 1 and q["baseline_perplexity"] > 1
    assert set(results["timing"]) == {"load_s", "calibrate_s", "quantize_s", "export_s", "evaluate_s"}
    assert results["memory"]["weight_bytes"] < results["memory"]["baseline_weight_bytes"]
    assert (out / "recipe.yaml").exists() and (out / "model.safetensors").exists()
    printed = capsys.readouterr().out
    assert "perplexity" in printed and str(out) in printed


def test_cli_refuses_existing_output_before_doing_work(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["run", "w8a16-rtn", "--model", str(tiny_model_dir), "--output", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (out / "keep.txt").exists()


def test_cli_bad_recipe_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps:\n  - rtn: {scheme: {bits: 4, strategy: group, group_size: 100}}\n  - smoothy: {}\n")
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "smoothy" in err


def test_cli_group_size_that_does_not_divide_names_layer(tiny_model_dir, tmp_path, capsys):
    code = main(["run", "w4a16-rtn", "--model", str(tiny_model_dir), "--output", str(tmp_path / "o"),
                 "--set", "scheme.group_size=96", *QUICK_EVAL])
    assert code == 2
    err = capsys.readouterr().err
    assert "model.layers.0.self_attn.q_proj" in err and "valid group sizes" in err
    assert not (tmp_path / "o").exists()


def test_cli_lists_models_and_recipes(capsys):
    assert main(["models"]) == 0 and "smollm2-135m" in capsys.readouterr().out
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "w4a16-rtn" in out and "w8a16-rtn" in out


@pytest.mark.slow
def test_real_model_w8_is_close_and_w4_is_worse(tmp_path):
    """The foundation's done-when on smollm2-135m, on a shortened protocol (4096 tokens; the
    default evaluation's KL and peak memory run in CI's main command)."""
    quick = ["--set", "evaluate.perplexity.max_tokens=4096", "--set", "evaluate.kl.enabled=false",
             "--set", "evaluate.memory.measure_peak=false"]
    figures = {}
    for recipe in ("w8a16-rtn", "w4a16-rtn"):
        out = tmp_path / recipe
        assert main(["run", recipe, "--output", str(out), *quick]) == 0
        q = json.loads((out / "results.json").read_text())["quality"]
        figures[recipe] = q["perplexity"] / q["baseline_perplexity"] - 1
    assert abs(figures["w8a16-rtn"]) < 0.01
    assert figures["w4a16-rtn"] > 0.05
