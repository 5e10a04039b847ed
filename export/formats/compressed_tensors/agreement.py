"""Does config.json's quantization_config agree with each quantized module's tensors?

The reader builds a module from its config group's num_bits, strategy, group_size and symmetric,
and from the tensors' shapes where they say more: some disagreements make the build raise (a
packed row too short for num_bits), others build a module that computes something else (num_bits
2 read from 4-bit words, a group_size the scales do not have). Each problem names the tensor and
the config key, e.g. `...down_proj.weight_scale: shape (128, 4), but
quantization_config.config_groups.group_0.weights (strategy group, group_size 32) needs (128, 8)`.
"""
from __future__ import annotations

from .codecs import CODECS, group_for, quantized_prefixes

CONFIG_GROUPS = "quantization_config.config_groups"


def config_problems(qconfig: dict, table) -> list[str]:
    """Every disagreement between `qconfig` and the quantized tensors of `table` (a TensorTable)."""
    return [p for prefix in quantized_prefixes(table.names()) for p in module_problems(prefix, table, qconfig)]


def module_problems(prefix: str, table, qconfig: dict) -> list[str]:
    """One module's disagreements: with the config group that targets it (which codec reads it,
    then that codec's own config_problems)."""
    try:
        group = group_for(prefix, qconfig, "config.json")
    except ValueError as err:
        return [f"{prefix}.weight_scale: {str(err).removeprefix('config.json: ')}"]
    key = next(k for k, g in qconfig["config_groups"].items() if g is group)
    where = f"{CONFIG_GROUPS}.{key}"
    stored = _stored_codec(prefix, table)
    as_read = {**group, "format": group.get("format") or qconfig.get("format")}  # as build_module reads it
    wanted = next((c for c in CODECS if c.reads(as_read)), None)
    weights = group.get("weights") or {}
    said = f"{where}.weights (type {weights.get('type')!r}, num_bits {weights.get('num_bits')})"
    if wanted is None:
        return [f"{prefix}.weight_scale: {said} is no scheme lowbit reads ({_schemes_read()})"]
    if stored is None:
        return [_unread_weight(prefix, table)]
    if stored is not wanted:
        tensor, _, what = stored.STORED
        return [f"{prefix}.{tensor}: {what}, but {said} describes {wanted.FORMAT}"]
    return wanted.config_problems(prefix, table, group, where)


def _stored_codec(prefix: str, table):
    """The codec whose weight tensor (name and dtype) the module's tensors hold, or None."""
    for codec in CODECS:
        tensor, dtype, _ = codec.STORED
        name = f"{prefix}.{tensor}"
        if name in table and table.dtype(name) == dtype:
            return codec
    return None


def _unread_weight(prefix: str, table) -> str:
    """Why no codec reads the module's weight: a weight tensor of a dtype none stores, or none at all."""
    for tensor in dict.fromkeys(c.STORED[0] for c in CODECS):
        name = f"{prefix}.{tensor}"
        if name in table:
            stored = sorted({c.STORED[1] for c in CODECS if c.STORED[0] == tensor})
            return f"{name}: dtype {table.dtype(name)}, but a quantized weight there is stored as {' or '.join(stored)}"
    return f"{prefix}.weight_scale: no {prefix}.weight_packed or quantized {prefix}.weight beside it"


def _schemes_read() -> str:
    return ", ".join(dict.fromkeys(c.READS for c in CODECS))  # codecs that read the same weights: listed once
