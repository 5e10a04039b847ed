"""What a run's plan quantizes, judged before the work: a plan that quantizes no weight would
publish a float model as a quantized one, so it is refused, before the model is loaded where the
steps alone show it and before any step where only the model's linears do (an ignore list matching
them all, a plan keeping them all 16-bit). A float export is asked for explicitly with a float
format (`export: {format: dense}`); its audit and model card then say "not quantized".
"""
from __future__ import annotations

from collections import Counter

from lowbit.export.formats.registry import FORMATS
from lowbit.quantize.audit import AuditReport
from lowbit.quantize.audit_matrices import MatrixCount
from lowbit.quantize.steps.registry import STEPS
from lowbit.recipes.schema import Recipe
from lowbit.recipes.validate import RecipeError

FLOAT_EXPORT = "set export.format: dense for a float export"
WRITTEN_FLOAT = "written dequantized (a float export)"


def float_export(recipe: Recipe) -> bool:
    """Whether the recipe's checkpoint holds no quantized module by its format (dense)."""
    return not FORMATS[recipe.export.format].holds_quantized


def weight_steps(recipe: Recipe) -> list[str]:
    """Each step that writes a weight grid, with the grid: ["rtn int4 sym group 64"]."""
    return [f"{s.name} {STEPS[s.name].writes(s.config).describe()}" for s in recipe.steps
            if STEPS[s.name].writes(s.config) is not None]


def weight_step_names() -> list[str]:
    """The steps that write a weight grid (with their default options), for error messages."""
    return [name for name, spec in STEPS.items() if spec.writes(spec.config()) is not None]


def float_export_note(recipe: Recipe) -> str | None:
    """What the audit and the model card say of a float export (None for any other recipe)."""
    if not float_export(recipe):
        return None
    steps = weight_steps(recipe)
    if not steps:
        return f"a float export (export.format {recipe.export.format}), no weight step"
    return (f"a float export (export.format {recipe.export.format}): the {'; '.join(steps)} weights "
            f"written dequantized to {recipe.export.dtype}")


def check_quantizes(recipe: Recipe) -> None:
    """Before loading the model: refuse a recipe none of whose steps writes a weight grid (no step,
    or only steps that fold scales, rotate or set the KV cache, whose checkpoint would carry no
    quantized weight), unless it asks for a float export. A `fit:` budget plans its steps later."""
    if recipe.fit is not None or weight_steps(recipe) or float_export(recipe):
        return
    what = (f"none of its steps ({', '.join(s.name for s in recipe.steps)}) writes a weight grid"
            if recipe.steps else "steps is empty")
    raise RecipeError(f"recipe {recipe.name}", "steps",
                      f"quantizes no linear: {what}; add a weight step ({', '.join(weight_step_names())}; "
                      f"`lowbit recipes` lists the shipped recipes) or {FLOAT_EXPORT}")


def check_targets(recipe: Recipe, expected: dict, ignored: dict[str, str]) -> None:
    """After loading the model, before any step: refuse a plan that leaves every linear it could
    target float (expected: what the steps should leave; ignored: the others, with the reason),
    unless the recipe asks for a float export."""
    check_quantizes(recipe)  # no weight step: said so, as before loading
    if expected or float_export(recipe):
        return
    reasons = Counter(ignored.values())
    why = f" ({reasons.most_common(1)[0][0]})" if reasons else ""
    key = "ignore" if any(r.startswith("matches the recipe's ignore") for r in reasons) else "scheme"
    raise RecipeError(f"recipe {recipe.name}", key,
                      f"quantizes no linear of {recipe.model}: all {len(ignored)} of its linears stay "
                      f"float{why}; narrow {key} so that a linear is quantized, or {FLOAT_EXPORT}")


def as_written(part: AuditReport) -> AuditReport:
    """A float export's audit of the model before its export, as its file holds it: the checked
    linears float (written dequantized), no quantized matrix, no KV-cache quantization (dropped);
    its problems stay. `lowbit audit` of the file then finds the same."""
    ignored = {**part.ignored, **dict.fromkeys(part.checked, WRITTEN_FLOAT)}
    matrices = MatrixCount(0, part.matrices.quantized + part.matrices.float, dict(part.matrices.kept))
    return AuditReport(ignored=ignored, problems=list(part.problems), matrices=matrices)
