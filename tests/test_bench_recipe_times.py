"""bench/recipe_times.py runs recipes back to back and prints each one's quantize time as a multiple of
the first's, as JSON."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import recipe_times  # noqa: E402


def test_each_recipe_is_timed_against_the_first(tmp_path, capsys):
    model = save_tiny_llama(tmp_path / "tiny")
    sets = [a for s in ("calibration.samples=2", "calibration.seq_len=32", "evaluate.perplexity.context_len=64",
                        "evaluate.perplexity.stride=64") for a in ("--set", s)]
    record = recipe_times.main(["w4a16-rtn", "w4a16-gptq", "--model", str(model), *sets, "--json"])
    printed = json.loads(capsys.readouterr().out)  # nothing but the record on stdout
    assert printed == record and printed["unit"] == "w4a16-rtn"
    rtn, gptq = printed["recipes"]
    assert rtn["recipe"] == "w4a16-rtn" and rtn["times_unit"] == 1.0
    assert gptq["quantize_s"] > 0
    assert gptq["times_unit"] == pytest.approx(gptq["quantize_s"] / rtn["quantize_s"], abs=0.01)


def test_a_recipe_that_fails_stops_the_bench_naming_it(tmp_path):
    with pytest.raises(SystemExit, match="recipe_times: `lowbit run no-such-recipe` failed"):
        recipe_times.main(["no-such-recipe", "--model", str(save_tiny_llama(tmp_path / "tiny"))])
