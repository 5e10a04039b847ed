"""compressed-tensors' layers: `quantization_config`, and each quantized module sent to the codec
of its scheme family. A codec (int8.py, packed.py, fp8.py, mxfp4.py) is a module with handles(module),
reads(group), scheme_entry(name, module), module_tensors(prefix, module, dtype) and
build_module(prefix, tensors, group), and for the audit (agreement.py) STORED (the tensor holding
its weights, its safetensors dtype, what it is), READS (what it reads, in a few words) and
config_problems(prefix, table, group, where); add a scheme by adding its codec to CODECS.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from ..hf_folder import native_modules
from . import fp8, int8, mxfp4, packed

QUANT_METHOD = "compressed-tensors"
CODECS = [int8, packed, fp8, mxfp4]  # first match wins: W8A8 before weight-only
SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def is_quantized(module: nn.Module) -> bool:
    return any(codec.handles(module) for codec in CODECS)


def codec_for(name: str, module: nn.Module):
    for codec in CODECS:
        if codec.handles(module):
            return codec
    raise ValueError(f"layer {name}: no compressed-tensors writer for {type(module).__name__}")


def quantization_config(modules: dict[str, nn.Module], ignore: Iterable[str]) -> dict:
    """One config group per distinct scheme, targeting its modules by name."""
    groups: dict[str, dict] = {}
    by_entry: dict[str, str] = {}
    for name, module in modules.items():
        entry = codec_for(name, module).scheme_entry(name, module)
        key = repr(entry)
        if key not in by_entry:
            by_entry[key] = f"group_{len(by_entry)}"
            groups[by_entry[key]] = {"targets": [], **entry}
        groups[by_entry[key]]["targets"].append(name)
    if len(groups) == 1:  # the common case: one scheme for every Linear that is not ignored
        next(iter(groups.values()))["targets"] = ["Linear"]
    formats = {g["format"] for g in groups.values()}
    return {
        "quant_method": QUANT_METHOD,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
    }


def check_consumers_can_load(model: nn.Module, names: Iterable[str]) -> None:
    """compressed-tensors quantizes torch Linear modules only: a quantized GPT-2 Conv1D would be
    skipped by transformers, which then loads it randomly initialised with only a warning."""
    native = native_modules(model, names)
    other = [n for n, m in native.items() if not isinstance(m, nn.Linear)]
    if other:
        kinds = sorted({type(native[n]).__name__ for n in other})
        raise ValueError(
            f"layers {other[:3]}{' …' if len(other) > 3 else ''} are {', '.join(kinds)} in "
            f"{type(model).__name__}, not torch Linear; compressed-tensors cannot describe them and "
            "transformers would load them with random weights. Add them to the recipe's ignore list.")


def module_tensors(prefix: str, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return codec_for(prefix, module).module_tensors(prefix, module, dtype)


def quantized_prefixes(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Module names that carry compressed tensors: every quantized weight has a weight_scale."""
    return sorted(k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale"))


def build_module(prefix: str, tensors: dict[str, torch.Tensor], qconfig: dict, where: str) -> nn.Module:
    group = group_for(prefix, qconfig, where)
    group = {**group, "format": group.get("format") or qconfig.get("format")}
    for codec in CODECS:
        if codec.reads(group):
            return codec.build_module(prefix, tensors, group)
    raise ValueError(f"{where}: layer {prefix}: no reader for config group {group.get('weights')} "
                     f"in format {group['format']!r}; lowbit reads: {[c.FORMAT for c in CODECS]}")


def group_for(name: str, qconfig: dict, where: str) -> dict:
    """The config group whose targets match `name`: an exact name, `re:` regex, or class Linear."""
    if any(_matches(name, t) for t in qconfig.get("ignore") or []):
        raise ValueError(f"{where}: layer {name} has compressed tensors but is in quantization_config.ignore")
    by_class = None
    for group in (qconfig.get("config_groups") or {}).values():
        targets = group.get("targets") or []
        if any(t != "Linear" and _matches(name, t) for t in targets):
            return group
        if "Linear" in targets and by_class is None:
            by_class = group
    if by_class is None:
        raise ValueError(f"{where}: no config group in quantization_config targets layer {name}")
    return by_class


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None  # compressed-tensors uses re.match
    return name == target
