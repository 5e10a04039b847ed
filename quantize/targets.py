"""Which linears a recipe quantizes, and swapping them for runtime modules."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from lowbit.calibrate.arch import Arch, decoder_layers, is_linear, linear_weight, matches_name, target_linears
from lowbit.quantize.grids.gguf_plan import GGUFTypes, linear_type, output_type


is_ignored = matches_name  # the recipe's ignore list: exact names, trailing paths, re:REGEX


@dataclass
class Targets:
    linears: dict[str, nn.Module]  # full name -> module, in layer order
    ignored: dict[str, str] = field(default_factory=dict)  # full name -> why it stays float


def select_targets(model: nn.Module, arch: Arch, ignore: tuple[str, ...]) -> Targets:
    found = target_linears(model, arch)
    head = getattr(model, "lm_head", None)
    if head is not None and is_linear(head):
        found["lm_head"] = head
    targets = Targets({})
    for name, module in found.items():
        if is_ignored(name, ignore):
            targets.ignored[name] = "matches the recipe's ignore list"
        elif not is_linear(module):
            targets.ignored[name] = f"already {type(module).__name__}, not a float linear"
        else:
            targets.linears[name] = module
    return targets


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    model.set_submodule(name, new)


def gguf_types(model: nn.Module, arch: Arch, names, types: GGUFTypes) -> dict[str, Optional[str]]:
    """The GGML type of each named linear under a llama.cpp file type (None: stays 16-bit, its
    rows split into no block): decoder-layer linears by their role and layer, others (lm_head)
    as the output matrix."""
    layers = len(decoder_layers(model, arch))
    prefix = arch.layers + "."
    out = {}
    for name in names:
        module = model.get_submodule(name)  # float, or already quantized when the audit asks
        cols = module.in_features if hasattr(module, "in_features") else linear_weight(module).shape[1]
        if name.startswith(prefix):
            out[name] = linear_type(types, name, int(name[len(prefix):].split(".")[0]), layers, cols)
        else:
            out[name] = output_type(types, cols)
    return out
