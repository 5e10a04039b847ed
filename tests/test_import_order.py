"""Imports run one way: calibrate <- quantize (grids <- runtime <- steps) <- export <- evaluate <- recipes <- app.

Every import statement of every module (function-level ones too) is read from the source and
checked against that order; export and evaluate may see the runtime and the grids but never a
step's file, and recipes and app reach the steps through their registry only.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("calibrate", "quantize", "export", "evaluate", "recipes", "app")
# lowest first; a module may import its own layer and the layers before it
LAYERS = ("lowbit.calibrate", "lowbit.quantize.grids", "lowbit.quantize.runtime", "lowbit.quantize",
          "lowbit.quantize.steps", "lowbit.export", "lowbit.evaluate", "lowbit.recipes", "lowbit.app")
STEP_PLUMBING = {"lowbit.quantize.steps", "lowbit.quantize.steps.registry", "lowbit.quantize.steps.spec",
                 "lowbit.quantize.steps.context"}  # what code outside the steps may import of them


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("lowbit",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def layer(module: str) -> int:
    """Index of the most specific layer that contains module."""
    return max(i for i, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + "."))


def imports(path: Path, me: str, at_run_time: bool = False) -> list[str]:
    """Every lowbit module the file of module `me` imports, relative imports resolved; at_run_time:
    leaving out those under `if TYPE_CHECKING:` (never run)."""
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for block in ast.walk(tree) if at_run_time and _type_checking(block)
                   for n in ast.walk(block)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            target = ".".join(p for p in (base, node.module) if p)
            # `from pkg import name` may name a submodule: check both readings
            found += [target] + [f"{target}.{a.name}" for a in node.names]
    return [m for m in found if m.startswith("lowbit.") and _exists(m)]


def _type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`"""
    test = node.test if isinstance(node, ast.If) else None
    name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
    return name == "TYPE_CHECKING"


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def violations(path: Path, me: str | None = None) -> list[str]:
    me = me or module_name(path)
    out = []
    for target in imports(path, me):
        if layer(target) > layer(me):
            out.append(f"{me} imports {target}, a later layer ({LAYERS[layer(target)]})")
        elif (target.startswith("lowbit.quantize.steps.") and target not in STEP_PLUMBING
              and not me.startswith("lowbit.quantize.steps")):
            out.append(f"{me} imports the algorithm {target}; outside the steps only "
                       f"{sorted(STEP_PLUMBING)} may be imported")
        elif target.startswith("lowbit.quantize.steps") and me.startswith(("lowbit.export", "lowbit.evaluate")):
            out.append(f"{me} imports {target}: export and evaluate see the runtime and the grids only")
    return out


def test_the_walk_sees_every_package_module():
    names = {module_name(p) for p in sources()}
    assert {"lowbit.quantize.steps.gptq", "lowbit.quantize.runtime.qlinear", "lowbit.quantize.grids.integer",
            "lowbit.export.checkpoint", "lowbit.app.run"} <= names
    assert len(names) > 60


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_one_way_order(path):
    assert violations(path) == []


def test_a_backward_import_is_caught(tmp_path):
    """The check itself can fail: an export module importing a step or evaluate, the runtime
    importing a step (relatively), and the recipe language importing the application are reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("from lowbit.quantize.steps import gptq\nfrom lowbit.evaluate import memory\n")
    found = violations(probe, "lowbit.export.probe")
    assert any("lowbit.quantize.steps.gptq" in v for v in found)
    assert any("lowbit.evaluate.memory" in v and "later layer" in v for v in found)
    probe.write_text("from ..steps import rtn\n")
    assert "lowbit.quantize.runtime.probe imports lowbit.quantize.steps.rtn, a later layer (lowbit.quantize.steps)" \
        in violations(probe, "lowbit.quantize.runtime.probe")
    probe.write_text("from lowbit.app.run import run\n")
    assert any("later layer (lowbit.app)" in v for v in violations(probe, "lowbit.recipes.probe"))
