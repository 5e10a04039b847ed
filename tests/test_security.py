"""Security: safetensors only unless --allow-pickle (then weights_only unpickling), no remote code
unless asked, recipes never execute code, and no user-given name writes outside its folder."""
import json
from pathlib import Path

import pytest
import torch

from model_folders import copy_folder, looks_like_checkpoint, save_tiny_folder, to_pickle_weights
from tiny_models import make_tiny_model
from lowbit.calibrate.models import load_model
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.recipes.schema import Recipe, load_recipe, shipped_recipes
from lowbit.recipes.validate import RecipeError
from lowbit.app.cli import main

FAST = ["--set", "evaluate.baseline=false", "--set", "evaluate.kl.enabled=false",
        "--set", "evaluate.perplexity.max_tokens=256", "--set", "evaluate.perplexity.context_len=128",
        "--set", "evaluate.perplexity.stride=128", "--set", "evaluate.memory.measure_peak=false"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_folder(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def pickle_folder(tiny_folder, tmp_path):
    return to_pickle_weights(copy_folder(tiny_folder, tmp_path / "pickled"))


class Planted:
    """Unpickling this creates a file: what an attacker's code could do instead."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


# --- pickle-based weights ---

def test_pickle_weights_are_refused_without_the_flag(pickle_folder):
    with pytest.raises(FileNotFoundError, match=r"pytorch_model.bin.*--allow-pickle"):
        load_model(str(pickle_folder))


def test_allow_pickle_loads_through_weights_only(pickle_folder, tiny_folder, monkeypatch):
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k.get("weights_only")) or real_load(*a, **k))
    model, _, _ = load_model(str(pickle_folder), allow_pickle=True)
    assert calls == [True]
    reference, _, _ = load_model(str(tiny_folder))
    for (name, p), (_, q) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(p, q), name


def test_a_pickle_holding_an_arbitrary_object_fails_even_with_the_flag(tiny_folder, tmp_path):
    planted = tmp_path / "planted"
    folder = to_pickle_weights(copy_folder(tiny_folder, tmp_path / "evil"), {"extra": Planted(planted)})
    with pytest.raises(ValueError, match="objects other than tensors; refused even with allow_pickle"):
        load_model(str(folder), allow_pickle=True)
    assert not planted.exists()


def test_cli_run_and_eval_take_allow_pickle(pickle_folder, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "w8a16-rtn", "--model", str(pickle_folder), "--output", str(out), *FAST]) == 2
    assert "--allow-pickle" in capsys.readouterr().err and not out.exists()
    assert main(["run", "w8a16-rtn", "--model", str(pickle_folder), "--output", str(out), "--allow-pickle",
                 *FAST]) == 0
    assert looks_like_checkpoint(out) and not list(out.glob("*.bin"))  # the export is safetensors
    assert json.loads((out / "results.json").read_text())["recipe"]["allow_pickle"] is True
    ev = tmp_path / "eval"
    assert main(["eval", str(pickle_folder), "--output", str(ev), *FAST]) == 2
    assert "--allow-pickle" in capsys.readouterr().err
    assert main(["eval", str(pickle_folder), "--output", str(ev), "--allow-pickle", *FAST]) == 0
    assert json.loads((ev / "results.json").read_text())["quality"]["perplexity"] > 1


# --- trust_remote_code ---

def test_trust_remote_code_is_off_unless_asked(tiny_folder, monkeypatch):
    import transformers

    seen = []

    def spy(cls):
        real = cls.from_pretrained
        return lambda *a, **k: seen.append((cls.__name__, k.get("trust_remote_code"))) or real(*a, **k)

    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", spy(cls))
    load_model(str(tiny_folder))
    assert seen == [("AutoTokenizer", False), ("AutoModelForCausalLM", False)]
    seen.clear()
    load_model(str(tiny_folder), trust_remote_code=True)
    assert [flag for _, flag in seen] == [True, True]


def test_defaults_and_shipped_recipes_keep_remote_code_and_pickle_off():
    assert Recipe().trust_remote_code is False and Recipe().allow_pickle is False
    for name in shipped_recipes():
        recipe = load_recipe(name)
        assert recipe.trust_remote_code is False and recipe.allow_pickle is False, name


# --- recipes never execute code ---

@pytest.mark.parametrize("tag", ["!!python/object/apply:os.mkdir", "!!python/object/new:os.mkdir"])
def test_python_tags_in_a_recipe_or_override_never_run(tmp_path, tag):
    planted = tmp_path / "planted"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: {tag} ['{planted}']\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(str(recipe))
    with pytest.raises(RecipeError, match=r"--set: .*not valid YAML"):
        load_recipe("w8a16-rtn", (f"description={tag} ['{planted}']",))
    assert not planted.exists()


# --- output paths stay inside the output folder ---

@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".", ".hidden", "", "a\\\\b", "tab\\there", "x" * 201])
def test_recipe_names_that_are_not_plain_file_names_are_refused(tmp_path, name):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f'name: "{name}"\n')
    with pytest.raises(RecipeError) as err:
        load_recipe(str(recipe))
    assert err.value.key == "name" and "recipe name" in str(err.value)
    with pytest.raises(RecipeError, match="name: recipe name"):
        load_recipe("w8a16-rtn", (f'name="{name}"',))


def test_sweep_cannot_write_outside_its_folder(tiny_folder, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: ../../escaped\nsteps: [{rtn: {scheme: {bits: 8}}}]\n")
    root = tmp_path / "deep" / "sweep"
    assert main(["sweep", str(recipe), "--model", str(tiny_folder), "--output", str(root), *FAST]) == 2
    assert "name: recipe name '../../escaped'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


@pytest.mark.parametrize("name", ["../evil.txt", "/tmp/evil.txt", ".manifest.json", "sub/x.txt"])
def test_export_extra_file_names_cannot_escape(tmp_path, name):
    out = tmp_path / "ckpt"
    with pytest.raises(ValueError, match="extra file name"):
        checkpoint.save(make_tiny_model("llama"), None, out, ExportConfig(), extra_files={name: "x"})
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_baseline_cache_file_name_does_not_come_from_the_model_name(tmp_path, monkeypatch):
    from lowbit.evaluate.baseline import cached_baseline
    from lowbit.evaluate.config import PerplexityProtocol

    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    result = cached_baseline("../../../outside", PerplexityProtocol(), lambda: {"perplexity": 2.0})
    assert result["perplexity"] == 2.0
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(p.parent == tmp_path / "cache" / "baselines" for p in written)
