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


def test_held_out_texts_are_scored_as_the_protocols_text_is_and_rendered_as_rows(tmp_path, monkeypatch):
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    import results_tables

    model_dir = save_tiny_llama(tmp_path / "tiny")
    run_dir, eval_dir = tmp_path / "run", tmp_path / "eval"
    held_out = ["--set", "evaluate.held_out=[news, wiki, reviews]"]  # wiki is the protocol's own text: once
    assert main(["run", "w4a16-rtn", "--model", str(model_dir), "--output", str(run_dir),
                 "--set", "calibration.samples=4", *QUICK_EVAL, *held_out]) == 0
    assert main(["eval", str(run_dir), "--output", str(eval_dir), *QUICK_EVAL, *held_out]) == 0
    ran = json.loads((run_dir / "results.json").read_text())
    evaluated = json.loads((eval_dir / "results.json").read_text())
    scored = ran["quality"]["held_out"]
    assert set(scored) == {"news", "reviews"} and ran["quality"]["dataset"] == "wiki"
    for text, scores in scored.items():
        assert scores["perplexity"] > 1 and scores["baseline_perplexity"] > 1 and scores["kl"]["kl_mean"] > 0
        assert scores["perplexity"] != ran["quality"]["perplexity"], text  # another text, another figure
    assert evaluated["quality"]["held_out"] == scored
    assert "held_out" in (run_dir / "recipe.yaml").read_text()  # said where asked for (pins: absent otherwise)
    page = results_tables.render_all([run_dir / "results.json"], tmp_path)[tmp_path / "run.md"]
    news = scored["news"]
    assert f"| news | {news['perplexity']:.3f} | {news['baseline_perplexity']:.3f} |" in page
    assert "| wiki |" in page and "| reviews |" in page


def test_a_held_out_text_listed_twice_is_refused_by_key(tmp_path):
    assert main(["run", "w4a16-rtn", "--dry-run", "--output", str(tmp_path / "x"),
                 "--set", "evaluate.held_out=[news, news]"]) == 2
