"""Number formats are a seam: code outside quantize/grids/ asks a grid or a plan what it can do
(quantize/grids/plan.py) and never branches on its class. Every class defined in grids/ is checked:
an `isinstance`, `issubclass` or `type(x) is` against one of them anywhere else fails here."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from lowbit.quantize.grids.fp8 import FP8Scheme
from lowbit.quantize.grids.gguf import GGUFScheme
from lowbit.quantize.grids.gguf_plan import GGUFTypes
from lowbit.quantize.grids.formats import LinearFormats
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.grids.mxfp4 import MXScheme
from lowbit.quantize.grids.plan import Slot
from lowbit.quantize.runtime.modules import BUILDERS, module_for
from lowbit.quantize.steps.awq import CLIPS, AWQConfig
from lowbit.quantize.steps.gptq import GPTQConfig
from lowbit.quantize.steps.gptq_solver import SOLVERS

ROOT = Path(__file__).resolve().parents[1]
GRIDS = ROOT / "quantize" / "grids"
OUTSIDE = [p for folder in ("calibrate", "quantize", "export", "evaluate", "recipes", "app", "bench")
           for p in sorted((ROOT / folder).rglob("*.py")) if GRIDS not in p.parents]


def grid_classes() -> set[str]:
    return {node.name for path in GRIDS.glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)}


def _names(node: ast.AST) -> list[str]:
    """The class names a type argument spells: `C`, `mod.C`, `(C, D)`."""
    if isinstance(node, ast.Tuple):
        return [n for elt in node.elts for n in _names(elt)]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return [node.id] if isinstance(node, ast.Name) else []


def class_branches(source: str, classes: set[str]) -> list[tuple[int, str]]:
    """(line, class) of every isinstance/issubclass/`type(x) is|==` test against one of `classes`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        if call and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
            found += [(node.lineno, n) for n in _names(node.args[1]) if n in classes]
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and \
                isinstance(node.left.func, ast.Name) and node.left.func.id == "type":
            if all(isinstance(op, (ast.Is, ast.Eq, ast.IsNot, ast.NotEq)) for op in node.ops):
                found += [(node.lineno, n) for c in node.comparators for n in _names(c) if n in classes]
    return found


def test_the_check_sees_every_spelling():
    classes = {"IntScheme", "GGUFTypes"}
    source = ("isinstance(a, IntScheme)\nisinstance(b, (FP8Scheme, grids.GGUFTypes))\n"
              "type(c) is IntScheme\nissubclass(d, IntScheme)\nisinstance(e, QuantLinear)\n")
    assert class_branches(source, classes) == [(1, "IntScheme"), (2, "GGUFTypes"), (3, "IntScheme"), (4, "IntScheme")]


def test_no_code_outside_grids_branches_on_a_grid_class():
    classes = grid_classes()
    assert {"IntScheme", "FP8Scheme", "MXScheme", "GGUFScheme", "LinearFormats", "GGUFTypes", "QuantizedWeight"} <= classes
    offenders = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in OUTSIDE
                 for line, name in class_branches(path.read_text(encoding="utf-8"), classes)]
    assert offenders == [], "ask the grid (grids/plan.py) instead of testing its class:\n" + "\n".join(offenders)


PLANS = [IntScheme(4, True, "group", 32), FP8Scheme(), LinearFormats({"down_proj": "int8", "q_proj": "mxfp4"}, "fp8_e4m3"),
         GGUFTypes("q4_k_m"), MXScheme()]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: type(p).__name__)
def test_every_plan_answers_the_protocol(plan):
    slots = [Slot("model.layers.0.mlp.down_proj", 1536, 0, 2), Slot("model.layers.1.self_attn.q_proj", 576, 1, 2),
             Slot("lm_head", 576, None, 2)]
    grids, kept = plan.assign(slots)
    assert set(grids) | set(kept) == {s.name for s in slots} and not set(grids) & set(kept)
    assert isinstance(plan.record(grids), dict)
    assert plan.scales_per_row() is True
    assert plan.takes_inputs(None) is not None and isinstance(plan.describe(), str)
    for grid in grids.values():
        assert grid.takes_inputs(None) or grid.takes_inputs("none")
        assert grid.largest_stored() is None or grid.largest_stored() > 0
        assert isinstance(grid.describe(None if grid.takes_inputs(None) else "none"), str)


def test_a_grid_a_target_cannot_take_is_refused_naming_it_before_any_change():
    with pytest.raises(ValueError, match="layer model.layers.0.mlp.down_proj: group_size 128 does not divide"):
        IntScheme(4, True, "group", 128).assign([Slot("model.layers.0.mlp.down_proj", 576, 0, 1)])


def test_gguf_plan_keeps_rows_no_block_divides_16_bit_and_records_types():
    grids, kept = GGUFTypes("q4_0").assign([Slot("model.layers.0.mlp.up_proj", 40, 0, 1),
                                            Slot("model.layers.0.mlp.down_proj", 64, 0, 1)])
    assert list(kept) == ["model.layers.0.mlp.up_proj"] and "no GGML block fits" in kept["model.layers.0.mlp.up_proj"]
    assert GGUFTypes("q4_0").record(grids) == {"types": {"model.layers.0.mlp.down_proj": "q4_0"}}


@pytest.mark.parametrize("grid", [IntScheme(4, False, "group", 32), FP8Scheme(), MXScheme(), GGUFScheme("q4_k")],
                         ids=lambda g: g.FAMILY)
def test_each_family_builds_its_module_from_its_rounding(grid):
    # the step registries hold only the families with their own solver or clip search: a new grid needs
    # a line in BUILDERS (its runtime module), none in SOLVERS or CLIPS
    assert grid.FAMILY in BUILDERS and set(SOLVERS) == {"int", "gguf"} and set(CLIPS) == {"int"}
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    weight = grid.round(w, "probe")
    module = module_for(weight, None)
    assert module.holds(module.linear_scheme()) and module.linear_scheme().weights == grid
    assert module.audit("probe") == []
    assert torch.equal(module.dequantized_weight(), weight.dequantize())
    assert grid.search_groups(w).shape[:2] == (8, 256 // grid.search_groups(w).shape[-1])


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: type(p).__name__)
def test_every_plan_says_whether_awq_can_search_it_and_gptq_can_reorder_its_groups(plan):
    assert isinstance(plan.searchable(), bool) and isinstance(plan.orders_groups(), bool)


@pytest.mark.parametrize("build, words", [
    (lambda: GPTQConfig(scheme=FP8Scheme("e4m3", "channel"), actorder="group"), "use actorder static or none"),
    (lambda: GPTQConfig(scheme=MXScheme(), actorder="group"), "use actorder static or none"),
    (lambda: GPTQConfig(scheme=GGUFTypes("q4_0"), actorder="group"), "use actorder static or none"),
    (lambda: GPTQConfig(scheme=LinearFormats({"down_proj": "mxfp4"}), actorder="group"), "mxfp4"),
    (lambda: AWQConfig(scheme=FP8Scheme("e4m3", "block")), "use strategy channel"),
])
def test_a_step_a_grid_cannot_serve_is_refused_when_the_recipe_is_read(build, words):
    with pytest.raises(ValueError, match=words):
        build()


def test_integer_groups_keep_actorder_group_and_awq_searches_fp8_channels():
    assert GPTQConfig(scheme=LinearFormats({}, "int4_g128"), actorder="group").actorder == "group"
    assert AWQConfig(scheme=FP8Scheme("e4m3", "channel")).scheme.searchable()
