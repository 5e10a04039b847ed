"""The built wheel holds every subpackage and shipped recipe, under `lowbit` only."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["calibrate", "quantize", "export", "evaluate", "recipes", "app"]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True)
    wheel = next(out.glob("lowbit-*.whl"))
    return set(zipfile.ZipFile(wheel).namelist())


def test_wheel_holds_every_subpackage_and_module(wheel_names):
    for sub in SUBPACKAGES:
        for source in (ROOT / sub).glob("*.py"):
            assert f"lowbit/{sub}/{source.name}" in wheel_names, source


def test_wheel_holds_every_shipped_recipe(wheel_names):
    recipes = list((ROOT / "recipes").glob("*.yaml"))
    assert recipes
    for recipe in recipes:
        assert f"lowbit/recipes/{recipe.name}" in wheel_names


def test_nothing_is_installed_under_a_top_level_name(wheel_names):
    top = {name.split("/")[0] for name in wheel_names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"lowbit"}


def test_import_evaluate_is_hugging_face_not_ours():
    import evaluate

    ours = ROOT / "evaluate"  # a venv inside the checkout is fine: only our folder must not be `evaluate`
    assert not Path(evaluate.__file__).resolve().is_relative_to(ours)
    import lowbit.evaluate

    assert Path(lowbit.evaluate.__file__).resolve().is_relative_to(ours)


def test_guard_explains_shadowing_when_the_root_is_on_sys_path():
    code = "import sys; sys.path.insert(0, sys.argv[1]); import evaluate"
    result = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "lowbit's evaluation stage" in result.stderr and "lowbit.evaluate" in result.stderr
