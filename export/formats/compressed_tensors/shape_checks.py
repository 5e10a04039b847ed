"""Checks the codecs' config_problems share: does a scale, zero point or input scale have the shape
(or presence) that the config group says the reader will build? Each returns problems as lines
naming the tensor and the config key; none knows a codec (the codecs import this module)."""
from __future__ import annotations

from lowbit.quantize.grids.integer import IntScheme


def scale_problem(prefix: str, table, scheme: IntScheme, out_f: int, in_f: int, where: str) -> list[str]:
    """The weight_scale of an integer scheme: one per group, row or tensor."""
    if scheme.strategy == "group" and in_f % scheme.group_size:
        return [f"{prefix}.weight_scale: {where}.weights.group_size {scheme.group_size} does not divide "
                f"the {in_f} columns of {prefix}"]
    need = (1,) if scheme.strategy == "tensor" else (out_f, scheme.num_groups(in_f))
    group_size = f", group_size {scheme.group_size}" if scheme.strategy == "group" else ""
    said = f"{where}.weights (strategy {scheme.strategy}{group_size})"
    return shape_problem(f"{prefix}.weight_scale", table, need, f"{said} needs {need}",
                         numel_only=scheme.strategy == "tensor")


def zero_problems(prefix: str, table, scheme: IntScheme, need: tuple, where: str) -> list[str]:
    """A weight_zero_point exactly when the scheme is asymmetric, of shape `need`."""
    name = f"{prefix}.weight_zero_point"
    if scheme.symmetric == (name in table):
        state = "present" if scheme.symmetric else "missing"
        return [f"{name}: {state}, but {where}.weights.symmetric is {str(scheme.symmetric).lower()}"]
    if scheme.symmetric:
        return []
    return shape_problem(name, table, need, f"{where}.weights (strategy {scheme.strategy}) needs {need}",
                         numel_only=scheme.strategy == "tensor")


def input_scale_problems(prefix: str, table, group: dict, where: str) -> list[str]:
    """An input_scale exactly when the group's input activations are static."""
    inputs = group.get("input_activations")
    if not inputs:
        return []
    static, present = not inputs.get("dynamic"), f"{prefix}.input_scale" in table
    if static == present:
        return []
    return [f"{prefix}.input_scale: {'missing' if static else 'present'}, but "
            f"{where}.input_activations.dynamic is {str(not static).lower()}"]


def shape_problem(name: str, table, need: tuple, why: str, numel_only: bool = False) -> list[str]:
    """`name` present with shape `need` (numel_only: any shape of as many elements, as (1,) vs (1, 1))."""
    if name not in table:
        return [f"{name}: missing ({why})"]
    shape = table.shape(name)
    same = (numel(shape) == numel(need)) if numel_only else shape == need
    return [] if same else [f"{name}: shape {shape}, but {why}"]


def numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
