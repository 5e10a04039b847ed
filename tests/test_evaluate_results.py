"""results.json has one schema: `lowbit run` and `lowbit eval CHECKPOINT` write the same key tree
and, for the same checkpoint and protocol, the same figures."""
import datetime
import json
from pathlib import Path

from tiny_models import save_tiny_llama

from lowbit.app.cli import main

QUICK_EVAL = ["--set", "evaluate.perplexity.max_tokens=512", "--set", "evaluate.perplexity.context_len=128",
              "--set", "evaluate.perplexity.stride=128", "--set", "evaluate.kl.max_tokens=256"]
ROOT = Path(__file__).resolve().parents[1]
RUN_ONLY = {"timing": {}, "steps": []}  # what eval leaves empty
SAME_FIGURES = {"quality": ("perplexity", "baseline_perplexity", "dataset", "protocol", "kl"),
                "memory": ("weight_bytes", "baseline_weight_bytes", "predicted", "fit", "model_max_context",
                           "baseline_predicted", "baseline_fit")}


def key_tree(value):
    """The nested keys of a JSON value; a list stands for the key tree of its first item."""
    if isinstance(value, dict):
        return {k: key_tree(v) for k, v in value.items()}
    if isinstance(value, list) and value:
        return [key_tree(value[0])]
    return None


def test_run_and_eval_of_its_checkpoint_write_one_schema_and_the_same_figures(tmp_path, monkeypatch, capsys):
    model_dir = save_tiny_llama(tmp_path / "tiny")
    run_dir, eval_dir = tmp_path / "run", tmp_path / "eval"
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache-run"))
    assert main(["run", "w4a16-rtn-kv8", "--model", str(model_dir), "--output", str(run_dir),
                 "--set", "calibration.samples=4", *QUICK_EVAL]) == 0
    # a cache of its own: eval measures the baseline itself instead of reading the run's figure
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache-eval"))
    assert main(["eval", str(run_dir), "--output", str(eval_dir), *QUICK_EVAL]) == 0
    ran = json.loads((run_dir / "results.json").read_text())
    evaluated = json.loads((eval_dir / "results.json").read_text())

    assert set(ran) == set(evaluated)
    for section in ("model", "hardware", "quality", "memory"):
        assert key_tree(ran[section]) == key_tree(evaluated[section]), section
    assert {k: evaluated[k] for k in RUN_ONLY} == RUN_ONLY
    assert ran["timing"] and ran["steps"] and ran["audit"]["passed"]
    for results in (ran, evaluated):  # when and where, as bench/results_tables.py shows beside each figure
        datetime.date.fromisoformat(results["measured"]["date"])
        assert "cores" in results["measured"]["cpu"]
        assert bool(results["measured"].get("commit")) == (ROOT / ".git").exists()
    # eval audits a lowbit checkpoint too: its files, structure and config.json, not the run's steps
    assert evaluated["audit"]["passed"] and evaluated["audit"]["integrity"].startswith("every file matches")
    assert evaluated["audit"]["quantized_share"] == ran["audit"]["quantized_share"] == 1.0
    assert ran["recipe"]["evaluate"] == evaluated["recipe"]["evaluate"]  # the same protocol and options

    for section, keys in SAME_FIGURES.items():
        for key in keys:
            assert ran[section][key] == evaluated[section][key], f"{section}.{key}"
    assert ran["quality"]["kl"]["kl_mean"] > 0 and ran["quality"]["baseline_perplexity"] > 1
    assert ran["model"]["reference"] == evaluated["model"]["reference"] == str(model_dir)
    # the int8 KV cache the checkpoint holds, read from the reloaded model: 1 byte per element
    assert evaluated["memory"]["predicted"]["kv_bytes_per_element"] == 1.0
    assert evaluated["memory"]["baseline_predicted"]["kv_bytes_per_element"] == 2.0
