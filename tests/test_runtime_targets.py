"""export.target / --target: a plan the named runtime cannot load is refused before any work, in one
line (export/runtimes.py's table, recipes/runtime_targets.py's check); the README's first paragraph
and docs/export-formats.md say what that table says."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from lowbit.app.cli import main
from lowbit.export.formats.registry import FORMATS
from lowbit.export.runtimes import RUNTIMES, YES, markdown
from lowbit.recipes import runtime_targets
from lowbit.recipes.runtime_targets import check_target
from lowbit.recipes.schema import load_recipe, shipped_recipes
from lowbit.recipes.validate import RecipeError

ROOT = Path(__file__).resolve().parents[1]


def refusal(recipe: str, target: str, isa: str = "avx512", sets: tuple = (), monkeypatch=None) -> str | None:
    """The one-line refusal of the shipped recipe under export.target on a CPU of `isa`, or None."""
    monkeypatch.setattr(runtime_targets, "cpu_info", lambda: SimpleNamespace(isa=isa))
    try:
        check_target(load_recipe(recipe, (f"export.target={target}", *sets)))
    except ValueError as err:
        assert "\n" not in str(err)
        return str(err)
    return None


REFUSED = [
    ("w4a16-rtn-kv8", "vllm", "avx512", (), "steps[1].kv_cache is an int8 KV cache"),
    ("w4a16-rtn-kv8", "vllm-cpu", "avx512", (), "reads FP8 KV caches only: use kv_cache: {format: fp8"),
    ("fp8-dynamic-kv-fp8", "vllm", "avx512", ("steps.1.kv_cache.strategy=token",), "static FP8 KV scales only"),
    ("w8a16-rtn", "vllm-cpu", "avx512", (), "steps[0].rtn is int8 sym channel; vLLM 0.32's CPU kernels take 4-bit"),
    ("w4a16-rtn", "vllm-cpu", "avx2", (), "this CPU's kernels: avx2; LOWBIT_CPU_ISA sets them); vLLM 0.32's AVX2 "
                                          "build has no cpu_gemm_wna16 op"),
    ("w4a16-gptq", "vllm-cpu", "avx2", ("export.format=gptq",), "cpu_gemm_wna16"),
    ("w3a16-gptq", "vllm", "avx512", (), "steps[0].gptq is int3 sym group 64; vLLM 0.32's bundled CUDA kernels"),
    ("w3a16-gptq", "vllm", "avx512", ("export.format=gptq",), "GPTQ loader takes 4- and 8-bit symmetric"),
    ("gguf-q4_0", "vllm", "avx512", (), "export.format is gguf; vLLM 0.32 has no GGUF loader: use"),
    ("w4a16-rtn", "llama.cpp", "avx512", (), "llama.cpp reads GGUF files only: use export.format: gguf"),
]
LOADS = [("w4a16-rtn", "vllm", "avx2", ()), ("w4a16-awq", "vllm", "avx512", ()), ("w8a16-rtn", "vllm", "avx2", ()),
         ("w4a16-rtn", "vllm-cpu", "avx512", ()), ("w8a16-gptq", "vllm", "avx512", ("export.format=gptq",)),
         ("w8a8-int8", "vllm", "avx2", ()), ("w8a8-int8", "vllm-cpu", "avx2", ()),
         ("fp8-dynamic", "vllm", "avx2", ()), ("fp8-dynamic", "vllm-cpu", "avx2", ()),
         ("fp8-dynamic-kv-fp8", "vllm", "avx2", ()), ("gguf-q4_0", "llama.cpp", "avx2", ()),
         ("gguf-q4_k-gptq", "transformers", "avx2", ())]


@pytest.mark.parametrize("recipe,target,isa,sets,said", REFUSED, ids=lambda v: v if isinstance(v, str) else None)
def test_the_table_refuses_naming_part_version_and_alternative(recipe, target, isa, sets, said, monkeypatch):
    message = refusal(recipe, target, isa, sets, monkeypatch)
    assert message is not None and said in message
    assert message.startswith(f"export.target {target} (") and RUNTIMES[target].version in message
    assert ": use " in message


@pytest.mark.parametrize("recipe,target,isa,sets", LOADS, ids=lambda v: v if isinstance(v, str) else None)
def test_the_table_accepts(recipe, target, isa, sets, monkeypatch):
    assert refusal(recipe, target, isa, sets, monkeypatch) is None


def test_transformers_loads_every_shipped_recipe_and_no_target_checks_nothing(monkeypatch):
    for name in shipped_recipes():
        assert refusal(name, "transformers", "avx2", (), monkeypatch) is None, name
        assert check_target(load_recipe(name)) == []


def test_an_unknown_target_is_refused_naming_the_valid_ones():
    with pytest.raises(RecipeError, match=r"export.target: 'sglang' is not valid; choose one of \['transformers', 'vllm', 'vllm-cpu', 'llama.cpp'\]"):
        load_recipe("w4a16-rtn", ("export.target=sglang",))


def test_recipe_yaml_says_target_only_where_set():
    assert "target" not in load_recipe("w4a16-rtn").to_dict()["export"]
    assert load_recipe("w4a16-rtn", ("export.target=vllm",)).to_dict()["export"]["target"] == "vllm"


def test_dry_run_and_run_refuse_before_loading(tmp_path, capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the target was checked")

    monkeypatch.setattr("lowbit.app.run.load_model", no_load)
    (tmp_path / "model").mkdir()  # never read: the refusal comes first
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    for extra in (["--dry-run"], ["--model", str(tmp_path / "model")]):  # dry run: the built-in smollm2-135m
        code = main(["run", "w4a16-rtn-kv8", "--target", "vllm", "--output", str(tmp_path / "out"), *extra])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith("lowbit: error: export.target vllm (vLLM 0.32.0, CUDA GPUs): steps[1].kv_cache is an "
                              "int8 KV cache (strategy head); vLLM 0.32 reads FP8 KV caches only: use kv_cache:")
        assert not (tmp_path / "out").exists()


# what the README's vLLM sentence says, and the shipped recipes that show it: (recipe, target, isa, loads)
VLLM_CLAIMS = {
    "INT4 or INT8 weight-only": [("w4a16-rtn", "vllm", "avx2", True), ("w8a16-rtn", "vllm", "avx2", True)],
    "W8A8 INT8": [("w8a8-int8", "vllm", "avx2", True), ("w8a8-int8", "vllm-cpu", "avx2", True)],
    "FP8 weights": [("fp8-dynamic", "vllm", "avx2", True), ("fp8-dynamic", "vllm-cpu", "avx2", True)],
    "an FP8 KV cache only": [("fp8-dynamic-kv-fp8", "vllm-cpu", "avx2", True), ("w4a16-rtn-kv8", "vllm", "avx2", False),
                             ("w4a16-rtn-kv8", "vllm-cpu", "avx512", False)],
    "on CPUs, INT4 weight-only needs AVX-512": [("w4a16-rtn", "vllm-cpu", "avx2", False),
                                               ("w4a16-rtn", "vllm-cpu", "avx512", True)],
    "INT8 weight-only does not load": [("w8a16-rtn", "vllm-cpu", "avx512", False)],
}
README_RUNTIMES = {"transformers": ("transformers",), "vLLM": ("vllm", "vllm-cpu"), "llama.cpp": ("llama.cpp",)}
FORMAT_WORDS = {"compressed-tensors": "compressed-tensors", "GPTQ": "gptq", "dense": "dense", "GGUF": "gguf"}


def readme_clauses() -> list[str]:
    first = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split("\n\n")[1].split())
    return first.split("Who loads what: ", 1)[1].split(". ")[0].split("; ")


def test_readme_first_paragraph_says_what_the_table_says(monkeypatch):
    said = {}
    for clause in readme_clauses():
        found = re.match(r"(\S+)(?: (\d[\d.]*))? loads (.+?) checkpoints(.*)$", clause)
        assert found, f"README: {clause!r} is not `RUNTIME [VERSION] loads FORMATS checkpoints ...`"
        name, version, formats, rest = found.groups()
        for target in README_RUNTIMES[name]:
            runtime = RUNTIMES[target]
            loaded = {fmt for fmt in FORMATS if runtime.verdict("export", {"export": fmt}).loads == YES}
            assert {FORMAT_WORDS[w] for w in re.split(r", | and ", formats)} == loaded, (name, target)
            assert version is None or runtime.version.startswith(version)
            said[target] = rest
    assert set(said) == set(RUNTIMES)
    for phrase, cases in VLLM_CLAIMS.items():
        assert phrase in said["vllm"], phrase
        for recipe, target, isa, loads in cases:
            assert (refusal(recipe, target, isa, (), monkeypatch) is None) == loads, (phrase, recipe, target, isa)


def test_docs_show_the_table_as_it_is():
    doc = (ROOT / "docs" / "export-formats.md").read_text(encoding="utf-8")
    shown = doc.split("<!-- runtimes-table -->\n", 1)[1].split("<!-- /runtimes-table -->", 1)[0]
    assert shown == markdown(), "regenerate with: python -c 'from lowbit.export.runtimes import markdown; " \
                                "print(markdown(), end=\"\")'"
