"""Does config.json's quantization_config agree with each quantized module's tensors?

The reader builds a module from its config group's num_bits, strategy, group_size and symmetric,
and from the tensors' shapes where they say more: some disagreements make the build raise (a
packed row too short for num_bits), others build a module that computes something else (num_bits
2 read from 4-bit words, a group_size the scales do not have). Each problem names the tensor and
the config key, e.g. `...down_proj.weight_scale: shape (128, 4), but
quantization_config.config_groups.group_0.weights (strategy group, group_size 32) needs (128, 8)`.
"""
from __future__ import annotations

from lowbit.quantize.grids.integer import IntScheme

from . import fp8, int8, packed
from .codecs import group_for, quantized_prefixes

CONFIG_GROUPS = "quantization_config.config_groups"
STORED = {  # codec -> (the tensor that holds its weight, what it is)
    packed: ("weight_packed", "packed integer codes (pack-quantized)"),
    int8: ("weight", "int8 codes (int-quantized)"),
    fp8: ("weight", "float8_e4m3fn values (float-quantized)"),
}


def config_problems(qconfig: dict, table) -> list[str]:
    """Every disagreement between `qconfig` and the quantized tensors of `table` (a TensorTable)."""
    return [p for prefix in quantized_prefixes(table.names()) for p in module_problems(prefix, table, qconfig)]


def module_problems(prefix: str, table, qconfig: dict) -> list[str]:
    """One module's disagreements: with the config group that targets it (which codec reads it,
    then that codec's shapes)."""
    try:
        group = group_for(prefix, qconfig, "config.json")
    except ValueError as err:
        return [f"{prefix}.weight_scale: {str(err).removeprefix('config.json: ')}"]
    key = next(k for k, g in qconfig["config_groups"].items() if g is group)
    where = f"{CONFIG_GROUPS}.{key}"
    stored = _stored_codec(prefix, table)
    as_read = {**group, "format": group.get("format") or qconfig.get("format")}  # as build_module reads it
    wanted = next((c for c in STORED if c.reads(as_read)), None)
    weights = group.get("weights") or {}
    said = f"{where}.weights (type {weights.get('type')!r}, num_bits {weights.get('num_bits')})"
    if wanted is None:
        return [f"{prefix}.weight_scale: {said} is no scheme lowbit reads (int 2-8 bits, float 8 bits)"]
    if stored is None:
        return [f"{prefix}.weight_scale: no {prefix}.weight_packed or quantized {prefix}.weight beside it"]
    if stored is not wanted:
        tensor, what = STORED[stored]
        return [f"{prefix}.{tensor}: {what}, but {said} describes {wanted.FORMAT}"]
    return CHECKS[wanted](prefix, table, group, where)


def _stored_codec(prefix: str, table):
    if f"{prefix}.weight_packed" in table:
        return packed
    weight = f"{prefix}.weight"
    dtype = table.dtype(weight) if weight in table else None
    return {"I8": int8, "F8_E4M3": fp8}.get(dtype)


def _packed_problems(prefix: str, table, group: dict, where: str) -> list[str]:
    scheme, problems = _scheme(prefix, group, where)
    if scheme is None:
        return problems
    if f"{prefix}.weight_shape" not in table:
        return [f"{prefix}.weight_shape: missing (pack-quantized needs the [out, in] of each weight)"]
    out_f, in_f = (int(v) for v in table.value(f"{prefix}.weight_shape").tolist())
    words = (in_f * scheme.bits + 31) // 32
    problems = _shape_problem(f"{prefix}.weight_packed", table, (out_f, words),
                              f"{where}.weights.num_bits {scheme.bits} packs {in_f} columns into {words} words")
    problems += _scale_problem(prefix, table, scheme, out_f, in_f, where)
    zero = (1,) if scheme.strategy == "tensor" else ((out_f * scheme.bits + 31) // 32, scheme.num_groups(in_f))
    return problems + _zero_problems(prefix, table, scheme, zero, where)


def _int8_problems(prefix: str, table, group: dict, where: str) -> list[str]:
    scheme, problems = _scheme(prefix, group, where)
    if scheme is None:
        return problems
    out_f, in_f = table.shape(f"{prefix}.weight")
    problems = _scale_problem(prefix, table, scheme, out_f, in_f, where)
    problems += _zero_problems(prefix, table, scheme, (1,) if scheme.strategy == "tensor" else (out_f, 1), where)
    return problems + _input_scale_problems(prefix, table, group, where)


def _fp8_problems(prefix: str, table, group: dict, where: str) -> list[str]:
    weights = group["weights"]
    out_f, in_f = table.shape(f"{prefix}.weight")
    strategy = weights.get("strategy")
    block = (weights.get("block_structure") or [128])[0]
    need = {"tensor": (1,), "channel": (out_f, 1), "block": (-(-out_f // block), -(-in_f // block))}.get(strategy)
    if need is None:
        return [f"{prefix}.weight_scale: {where}.weights.strategy is {strategy!r}; "
                f"supported: {', '.join(fp8.WEIGHT_STRATEGIES)}"]
    said = f"{where}.weights.strategy {strategy}" + (f", block {block}" if strategy == "block" else "")
    problems = _shape_problem(f"{prefix}.weight_scale", table, need, f"{said} needs {need}",
                              numel_only=strategy == "tensor")
    return problems + _input_scale_problems(prefix, table, group, where)


def _scheme(prefix: str, group: dict, where: str):
    """(the IntScheme the reader builds from the group, []) or (None, [why it cannot])."""
    weights = group["weights"]
    if not isinstance(weights.get("num_bits"), int):
        return None, [f"{prefix}.weight_scale: {where}.weights.num_bits is {weights.get('num_bits')!r}, not an integer"]
    try:
        return packed.scheme_from_args(weights, f"{where}.weights"), []
    except ValueError as err:
        text = str(err)
        return None, [f"{prefix}.weight_scale: {text if text.startswith(where) else f'{where}.weights: {text}'}"]


def _scale_problem(prefix: str, table, scheme: IntScheme, out_f: int, in_f: int, where: str) -> list[str]:
    if scheme.strategy == "group" and in_f % scheme.group_size:
        return [f"{prefix}.weight_scale: {where}.weights.group_size {scheme.group_size} does not divide "
                f"the {in_f} columns of {prefix}"]
    need = (1,) if scheme.strategy == "tensor" else (out_f, scheme.num_groups(in_f))
    group_size = f", group_size {scheme.group_size}" if scheme.strategy == "group" else ""
    said = f"{where}.weights (strategy {scheme.strategy}{group_size})"
    return _shape_problem(f"{prefix}.weight_scale", table, need, f"{said} needs {need}",
                          numel_only=scheme.strategy == "tensor")


def _zero_problems(prefix: str, table, scheme: IntScheme, need: tuple, where: str) -> list[str]:
    name = f"{prefix}.weight_zero_point"
    if scheme.symmetric == (name in table):
        state = "present" if scheme.symmetric else "missing"
        return [f"{name}: {state}, but {where}.weights.symmetric is {str(scheme.symmetric).lower()}"]
    if scheme.symmetric:
        return []
    return _shape_problem(name, table, need, f"{where}.weights (strategy {scheme.strategy}) needs {need}",
                          numel_only=scheme.strategy == "tensor")


def _input_scale_problems(prefix: str, table, group: dict, where: str) -> list[str]:
    inputs = group.get("input_activations")
    if not inputs:
        return []
    static, present = not inputs.get("dynamic"), f"{prefix}.input_scale" in table
    if static == present:
        return []
    return [f"{prefix}.input_scale: {'missing' if static else 'present'}, but "
            f"{where}.input_activations.dynamic is {str(not static).lower()}"]


def _shape_problem(name: str, table, need: tuple, why: str, numel_only: bool = False) -> list[str]:
    if name not in table:
        return [f"{name}: missing ({why})"]
    shape = table.shape(name)
    same = (_numel(shape) == _numel(need)) if numel_only else shape == need
    return [] if same else [f"{name}: shape {shape}, but {why}"]


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


CHECKS = {packed: _packed_problems, int8: _int8_problems, fp8: _fp8_problems}
