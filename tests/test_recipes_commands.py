"""`lowbit report` / `lowbit eval` option handling (the heavy paths run in the sweep check)."""
import json

import pytest

from lowbit.recipes.validate import RecipeError
from lowbit.app.cli import main
from lowbit.app.commands import _evaluate_config


def test_report_command_writes_html_and_md(tmp_path, capsys):
    for name, ppl in (("a", 11.0), ("b", 12.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({
            "model": {"id": "m"}, "recipe": {"name": "same"},
            "quality": {"perplexity": ppl, "baseline_perplexity": 10.0},
            "memory": {"weight_bytes": 1000, "baseline_weight_bytes": 4000}}))
    out = tmp_path / "cmp.html"
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out)]) == 0
    assert out.exists() and (tmp_path / "cmp.md").exists()
    assert "same (a)" in out.read_text() and "same (b)" in out.read_text()  # same recipe name told apart


def test_report_command_error_names_the_folder(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_eval_options_are_validated_like_a_recipe():
    cfg = _evaluate_config(["evaluate.speed.enabled=true", "evaluate.kl.max_tokens=1024"])
    assert cfg.speed.enabled and cfg.kl.max_tokens == 1024
    with pytest.raises(RecipeError, match="valid keys"):
        _evaluate_config(["evaluate.speed.fast=true"])
    with pytest.raises(RecipeError, match="evaluate"):
        _evaluate_config(["calibration.samples=4"])
