"""Faults that used to end in a misleading or bare message (#61), reproduced for real (a folder, a
symlink, an unusable cache path, an outsize weight in a saved model): each now ends in one line
naming what the user gave and what would be valid, before the work it would have wasted."""
from __future__ import annotations

import pytest

from lowbit.app.cli import main


def one_error_line(capsys, args) -> str:
    """`lowbit ARGS` exits 2 with exactly one error line and no traceback; returns that line."""
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("lowbit: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_recipe_path_that_is_a_folder_is_said_to_be_one(tmp_path, capsys):
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "w4.yaml").write_text("steps: [rtn]\n")
    line = one_error_line(capsys, ["run", str(folder), "--dry-run"])
    assert line == (f"lowbit: error: {folder}: is a directory, not a recipe file; a recipe is a YAML file or a "
                    "shipped recipe's name (`lowbit recipes` lists them); it holds w4.yaml")
