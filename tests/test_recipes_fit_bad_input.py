"""`lowbit fit` refuses a budget it cannot meet before it measures anything: non-finite,
non-positive or above-16-bit budgets and other flags out of range (naming the flag), and budgets
below the cheapest plan it could make (said in bits per weight); KV formats that cannot hold the
model's heads are left out with a note. Nothing measured shows as no entry in the sensitivity cache
(LOWBIT_CACHE, a fresh one per test)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tiny_models import save_tiny_llama
from lowbit.app.cli import main

SMALL_FIT = ["--samples", "2", "--seq-len", "32", "--overhead", "0MiB"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("fit-bad") / "tiny-llama", seed=3))


@pytest.fixture(scope="module")
def head_dim_24_dir(tmp_path_factory):
    """A tiny llama whose heads are 24 wide: int4 KV groups of 32 cannot divide them."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lowbit.calibrate.models import resolve_model_path

    folder = tmp_path_factory.mktemp("fit-head-dim") / "tiny-llama-hd24"
    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    cfg = LlamaConfig(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh LOWBIT_CACHE whose sensitivity folder is its own; the built-in models and corpora
    are the real cache's (linked), so nothing is fetched."""
    from lowbit.calibrate.cache import cache_dir

    real = cache_dir()
    fresh = tmp_path / "cache"
    fresh.mkdir()
    for entry in real.iterdir():
        if entry.name != "sensitivity":
            (fresh / entry.name).symlink_to(entry)
    monkeypatch.setenv("LOWBIT_CACHE", str(fresh))
    return fresh


def measured(cache: Path) -> list[str]:
    folder = cache / "sensitivity"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def refused(capsys, *args) -> str:
    """`lowbit fit ...` exits 2 with one error line, the last on stderr (after the model's loading
    progress, where the model was loaded); returns it."""
    assert main(["fit", *args]) == 2
    err = capsys.readouterr().err
    last = err.rstrip("\n").rsplit("\n", 1)[-1]
    assert last.startswith("lowbit: error: ") and err.count("lowbit: error:") == 1, err
    return last


@pytest.mark.parametrize("budget", ["nan", "inf", "-inf", "0", "-3"])
def test_a_non_finite_or_non_positive_bits_budget_is_refused(model_dir, cache, capsys, budget):
    err = refused(capsys, model_dir, *SMALL_FIT, f"--budget-bits-per-weight={budget}")
    assert f"--budget-bits-per-weight must be a positive number, got {float(budget)}" in err
    assert measured(cache) == []


@pytest.mark.parametrize("args, expected", [
    (["--budget-bits-per-weight", "100"], "--budget-bits-per-weight 100 is above 16, the bits per weight of the "
     "widest candidate (f16); valid budgets are above 0 and at most 16"),
    (["--budget-bits-per-weight", "16.5"], "--budget-bits-per-weight 16.5 is above 16"),
    (["--memory", "1GB", "--context", "0"], "--context must be a whole number of at least 1, got 0"),
    (["--memory", "1GB", "--batch", "-2"], "--batch must be a whole number of at least 1, got -2"),
    (["--memory", "1GB", "--overhead", "lots"], "--overhead 'lots': give a size such as 8GB"),
])
def test_a_flag_out_of_range_is_refused_naming_it_before_the_model_loads(model_dir, cache, capsys, args, expected):
    # the flags are checked first: the refusal is the only line (no model loading progress before it)
    assert main(["fit", model_dir, *SMALL_FIT, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowbit: error: ") and err.count("\n") == 1, err
    assert expected in err
    assert measured(cache) == []


def test_a_bits_budget_below_the_cheapest_plan_is_refused_before_measuring(model_dir, cache, capsys):
    err = refused(capsys, model_dir, *SMALL_FIT, "--budget-bits-per-weight", "1")
    assert re.search(r"budget 1 bits per weight is below the cheapest plan lowbit can make for this model, "
                     r"3\.[0-9]{3} bits per weight \(every decoder-layer linear at its smallest candidate: int3_g64\)",
                     err), err
    err = refused(capsys, model_dir, *SMALL_FIT, "--format", "gguf", "--budget-bits-per-weight", "4.4")
    assert "budget 4.4 bits per weight is below the cheapest plan" in err and "4.500 bits per weight" in err
    assert "smallest candidate: q4_0)" in err
    err = refused(capsys, model_dir, *SMALL_FIT, "--types", "int8,f16", "--budget-bits-per-weight", "5")
    assert re.search(r"8\.[0-9]{3} bits per weight \(every decoder-layer linear at its smallest candidate: int8\)", err)
    assert measured(cache) == []


def test_a_memory_budget_below_the_cheapest_plan_is_refused_before_measuring(model_dir, cache, capsys):
    err = refused(capsys, model_dir, *SMALL_FIT, "--memory", "1MB", "--context", "4096")
    assert "memory 1MB: nothing fits" in err and "the smallest KV cache (int4, " in err
    assert re.search(r"leave -[0-9.]+ MiB, -[0-9.]+ bits per weight for the decoder-layer linears; the cheapest "
                     r"plan needs 3\.[0-9]{3} bits per weight", err), err
    for size, expected in (("0MB", "memory must be positive, got '0MB'"),
                           ("9" * 400 + "GB", "give a size such as 8GB"),  # float() makes it inf
                           ("1.2.3GB", "memory '1.2.3GB': give a size such as 8GB")):
        assert expected in refused(capsys, model_dir, *SMALL_FIT, "--memory", size)
    assert measured(cache) == []


def test_kv_formats_that_cannot_hold_the_heads_are_left_out_with_a_note(head_dim_24_dir, cache, capsys):
    err = refused(capsys, head_dim_24_dir, *SMALL_FIT, "--memory", "200MiB", "--kv-formats", "int4")
    assert "kv_formats int4: none can hold this model's heads (head_dim 24); add int8, fp8 or f16" in err
    assert measured(cache) == []
    args = ["fit", head_dim_24_dir, *SMALL_FIT, "--json", "--memory", "200MiB", "--context", "64"]
    assert main([*args, "--kv-formats", "int4,int8"]) == 0
    out, err = capsys.readouterr()
    assert "KV format int4 left out: its groups of 32 do not divide the model's head_dim 24" in err
    plan = json.loads(out.strip().splitlines()[0])
    assert [t["kv_format"] for t in plan["kv_formats_tried"]] == ["int8"]
    assert len(measured(cache)) == 2  # linears and KV measured: the cache folder is the one watched


def test_a_recipe_with_a_non_finite_budget_is_refused_at_load(tmp_path, capsys):
    recipe = tmp_path / "fit.yaml"
    recipe.write_text("fit: {bits_per_weight: .nan}\nsteps: [rtn]\n")
    assert main(["run", str(recipe), "--dry-run", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{recipe}: fit: bits_per_weight must be a positive number, got nan" in err and err.count("\n") == 1
