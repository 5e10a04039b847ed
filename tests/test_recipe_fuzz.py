"""Recipes cannot blow up: YAML aliases and nesting are bounded at load, a user's value is quoted
short in any error, and a fuzz run of hostile recipes and --set items through `lowbit run
--dry-run` (tests/recipe_fuzz_child.py, in a child process) ends every example in exit 0, or exit 2
with one error line, within 1 GB."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lowbit.calibrate.messages import short_repr
from lowbit.recipes.schema import load_recipe
from lowbit.recipes.validate import RecipeError
from lowbit.app.cli import main

CHILD = Path(__file__).with_name("recipe_fuzz_child.py")
FUZZ_EXAMPLES = 500
# the classic 1.3 KB "billion laughs": nine levels of ten aliases each, 10^9 strings once expanded
BILLION_LAUGHS = "".join(
    ['lol0: &lol0 "lol"\n']
    + [f"lol{i}: &lol{i} [{', '.join([f'*lol{i - 1}'] * 10)}]\n" for i in range(1, 10)]
    + ["description: *lol9\n"])


def dry_run_error(capsys, recipe: Path, *items: str) -> str:
    """`lowbit run RECIPE --dry-run`, expected to refuse: its one stderr line."""
    out = recipe.parent / "out"
    code = main(["run", str(recipe), "--dry-run", "--output", str(out), *[f"--set={i}" for i in items]])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("lowbit: error: ") and err.count("\n") == 1, err[:2000]
    assert not out.exists()
    return err


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_fuzzed_recipes_and_overrides_exit_0_or_2_in_one_line_within_1gb(tmp_path):
    env = {**os.environ, "LOWBIT_FUZZ_EXAMPLES": str(FUZZ_EXAMPLES), "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)}
    child = subprocess.run([sys.executable, str(CHILD)], capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=300)
    assert child.returncode == 0, (child.stdout + child.stderr)[-6000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["examples"] >= FUZZ_EXAMPLES
    assert report["peak_rss_bytes"] <= 2**30, report


def test_a_billion_laughs_is_refused_at_load_in_one_line_naming_the_file(tmp_path, capsys):
    recipe = write(tmp_path, BILLION_LAUGHS)
    assert len(BILLION_LAUGHS) < 1400
    err = dry_run_error(capsys, recipe)
    assert re.search(f"{re.escape(str(recipe))}: refused before loading: aliases expand it to [0-9]{{10}} values "
                     r"\(at most 200000\)", err)
    assert len(err) < 300
    err = dry_run_error(capsys, write(tmp_path, "description: x\n"), "description=" + BILLION_LAUGHS.replace(
        "\n", ", ").join("{}"))
    assert "--set: 'description={lol0: &lol0" in err and "aliases expand it to" in err and len(err) < 400


def test_a_value_that_contains_itself_or_nests_absurdly_deep_is_refused(tmp_path, capsys):
    err = dry_run_error(capsys, write(tmp_path, "scheme: &s {bits: [*s]}\n"))
    assert "refused before loading: the value at line 1, column 9 contains an alias to itself" in err
    for depth in (65, 100_000):  # flow and block nesting; the deep one in the time of a shallow one
        err = dry_run_error(capsys, write(tmp_path, "scheme: " + "[" * depth + "]" * depth + "\n"))
        assert "refused before loading: values nested more than 64 levels deep (line 1)" in err
    block = "steps:\n" + "".join("  " * i + "-\n" for i in range(200))
    assert "values nested more than 64 levels deep" in dry_run_error(capsys, write(tmp_path, block))


def test_a_per_linear_plan_shared_through_an_anchor_loads(tmp_path):
    # what `lowbit fit --write` writes for a large model, ~1,000 per-linear entries, given once and
    # shared by the recipe and a step through an anchor: the bound is far above real recipes
    formats = [f"    model.layers.{i // 7}.proj_{i % 7}: int4_g64\n" for i in range(1000)]
    text = "scheme: &plan\n  default: f16\n  formats:\n" + "".join(formats) + "steps:\n- rtn: {scheme: *plan}\n"
    assert len(load_recipe(str(write(tmp_path, text))).steps[0].config.scheme.formats) == 1000


def test_yaml_errors_are_one_line_with_line_and_column(tmp_path, capsys):
    err = dry_run_error(capsys, write(tmp_path, "name: x\ndescription: *nowhere\n"))
    assert "not valid YAML: found undefined alias 'nowhere' at line 2, column 14" in err
    err = dry_run_error(capsys, write(tmp_path, "description: 2024-02-30\n"))
    assert "!!timestamp cannot read '2024-02-30' (ValueError: day is out of range for month) at line 1" in err
    err = dry_run_error(capsys, write(tmp_path, "trust_remote_code: !!bool maybe\n"))  # was a KeyError
    assert "not valid YAML: !!bool cannot read 'maybe' (KeyError: 'maybe') at line 1, column 20" in err
    err = dry_run_error(capsys, write(tmp_path, "calibration: {samples: " + "9" * 5000 + "}\n"))
    assert "not valid YAML: an integer of 5000 digits (at most 4000) at line 1, column 24" in err


def test_a_users_long_value_or_key_is_quoted_short_in_the_error(tmp_path, capsys):
    err = dry_run_error(capsys, write(tmp_path, f"calibration: {{samples: '{'x' * 100_000}'}}\n"))
    assert "calibration.samples: expected int, got a string 'xxxx" in err and "… (100000 characters)" in err
    assert len(err) < 300
    err = dry_run_error(capsys, write(tmp_path, "calibration: {samples: " + "9" * 3000 + "}\n"))
    assert "calibration.samples: <an integer of 3000 digits> is out of range" in err
    err = dry_run_error(capsys, write(tmp_path, 'calibration: {"a\\nb": 1}\n'))
    assert "calibration.a\\nb': unknown key" in err  # the key quoted, its line break escaped
    err = dry_run_error(capsys, write(tmp_path, f"export: {{format: {'y' * 5000}}}\n"))
    assert "export.format: 'yyy" in err and "(5000 characters) is not valid; choose one of" in err
    err = dry_run_error(capsys, write(tmp_path, "steps: [rtn]\n"), "steps.²=gptq")  # was int()'s own ValueError
    assert "--set: steps.²: list index must be 0..0, got '²'" in err
    err = dry_run_error(capsys, write(tmp_path, "name: x\n"), "=" + "z" * 10_000)
    assert "--set: '=zzz" in err and "(10001 characters): expected key.path=value" in err


def test_a_step_given_a_list_instead_of_its_options_is_refused_naming_it(tmp_path):
    # with a shared scheme, a list in the options' place reached a dict merge (TypeError)
    path = write(tmp_path, "scheme: {bits: 4}\nsteps: [rtn: [1, 2]]\n")
    with pytest.raises(RecipeError, match=r"steps\[0\]\.rtn: expected a mapping of RTNConfig options, got a list"):
        load_recipe(str(path))


def test_short_repr_bounds_any_value():
    assert short_repr("abc") == "'abc'" and short_repr([1, 2]) == "[1, 2]"
    assert short_repr("é" * 1000) == "'" + "é" * 78 + "… (1000 characters)"
    assert short_repr(10**5000) == "<an integer of 5001 digits>"  # repr() itself refuses one this long
    assert short_repr(list(range(10**6))) == "[0, 1, 2, 3, 4, 5, ...] (1000000 items)"
    loop: list = []
    loop.append(loop)
    assert short_repr(loop) == "[[[[...]]]]"
    assert "\n" not in short_repr("a\nb" * 1000) and len(short_repr({"k" * 500: "v" * 500})) < 100
