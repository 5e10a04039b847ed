"""A recipe checked against the runtime its export.target names (export/runtimes.py), before any work:
the run or --dry-run refuses, in one line, a plan that runtime cannot load, naming the part, the
runtime's version and what to use instead. Parts are asked of the steps' specs and the plans, never
read from a class."""
from __future__ import annotations

import dataclasses
import sys
from typing import NamedTuple

from lowbit.calibrate.hardware import cpu_info
from lowbit.export.runtimes import NO, RUNTIMES, UNCHECKED, Rule, Runtime
from lowbit.quantize.steps.registry import STEPS

from .schema import Recipe


class Part(NamedTuple):
    part: str  # export, weights or kv (export/runtimes.py's PARTS)
    key: str  # the recipe key that decides it
    what: str  # what the plan holds there
    facts: dict  # what the runtime's rules match


def check_target(recipe: Recipe) -> list[str]:
    """Raise ValueError, one line, on the first part the target cannot load; print (and return) a
    note for each part the table has not checked, or loads with something to know. No target:
    nothing is checked."""
    if recipe.export.target is None:
        return []
    runtime = RUNTIMES[recipe.export.target]
    notes = []
    for part in recipe_parts(recipe):
        rule = runtime.verdict(part.part, part.facts)
        if rule.loads == NO:
            raise ValueError(refusal(runtime, part, rule))
        if rule.loads == UNCHECKED:
            notes.append(f"export.target {runtime.name}: {part.key} is {part.what}; not checked against "
                         f"{runtime.describe()}{': ' + rule.why if rule.why else ''}")
        elif rule.why:
            notes.append(f"export.target {runtime.name}: {part.key} is {part.what}; {runtime.describe()} loads "
                         f"it: {rule.why}")
    for note in notes:
        print(f"[lowbit] note: {note}", file=sys.stderr)
    return notes


def refusal(runtime: Runtime, part: Part, rule: Rule) -> str:
    cpu = f" (this CPU's kernels: {part.facts['isa']}; LOWBIT_CPU_ISA sets them)" if "isa" in rule.when else ""
    return (f"export.target {runtime.name} ({runtime.describe()}): {part.key} is {part.what}{cpu}; "
            f"{rule.why}: use {rule.use}")


def recipe_parts(recipe: Recipe) -> list[Part]:
    """The export format, each weight step's grids (with the inputs they end up with) and each KV
    format, in the recipe's order. A recipe with a budget (fit:) has no plan yet: its format alone
    (app/run.py checks the plan the budget becomes)."""
    context = {"export": recipe.export.format, "isa": cpu_info().isa}
    parts = [Part("export", "export.format", recipe.export.format, context)]
    if recipe.fit is not None:
        return parts
    for i, step in enumerate(recipe.steps):
        spec = STEPS[step.name]
        written, kv = spec.writes(step.config), spec.kv_cache(step.config)
        if written is not None:
            inputs = final_inputs(written, recipe.steps[i + 1:])
            parts += [Part("weights", f"steps[{i}].{step.name}", grid.describe(inputs),
                           {**context, **grid_facts(grid), "inputs": inputs_kind(inputs)})
                      for grid in plan_grids(written.weights)]
        if kv is not None:
            parts.append(Part("kv", f"steps[{i}].{step.name}", f"an {kv.format} KV cache (strategy {kv.strategy})",
                              {**context, "kv": kv.format, "kv_strategy": kv.strategy}))
    return parts


def final_inputs(written, later) -> object:
    """The input quantization a step's linears run with: its own, or what a later step adds to
    linears whose grid takes it (quantize_inputs on integer weights)."""
    inputs = written.inputs
    for step in later:
        added = STEPS[step.name].adds_inputs(step.config)
        if added not in (None, "none") and written.weights.takes_inputs(added):
            inputs = added
    return inputs


def inputs_kind(inputs) -> str:
    """none, dynamic or static: an FP8 activation mode is its own word; an InputQuant says dynamic."""
    if inputs is None:
        return "none"
    return inputs if isinstance(inputs, str) else ("dynamic" if inputs.dynamic else "static")


def plan_grids(plan) -> list:
    """The grids a plan may give: a plan of several (a format per linear) lists them; a grid, and a
    llama.cpp file type (its GGML types are the gguf format's), stands for itself."""
    listed = getattr(plan, "grids", None)
    return listed() if callable(listed) else [plan]


def grid_facts(grid) -> dict:
    """A grid's fields (bits, symmetric, strategy, format, ...) and its family, as rules match them."""
    fields = {f.name: getattr(grid, f.name) for f in dataclasses.fields(grid)}
    return {**fields, "family": getattr(grid, "FAMILY", None)}
