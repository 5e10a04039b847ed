"""Which linears a recipe quantizes, and swapping them for runtime modules."""
from __future__ import annotations

from dataclasses import dataclass, field
from torch import nn

from lowbit.calibrate.arch import Arch, decoder_layers, is_linear, linear_weight, matches_name, target_linears
from lowbit.quantize.grids.plan import Slot
from lowbit.quantize.runtime.modules import is_quantized_linear


is_ignored = matches_name  # the recipe's ignore list: exact names, trailing paths, re:REGEX


@dataclass
class Targets:
    linears: dict[str, nn.Module]  # full name -> module, in layer order
    ignored: dict[str, str] = field(default_factory=dict)  # full name -> why it stays float


def listed_targets(model: nn.Module, arch: Arch, ignore: tuple[str, ...]) -> tuple[dict[str, nn.Module], dict]:
    """Every module a recipe's weight steps target (the arch table's decoder-layer linears, and
    lm_head), whatever it holds now: a float linear, or the runtime module that replaced it; and
    those the ignore list keeps float, with the pattern that matched."""
    found = target_linears(model, arch)
    head = getattr(model, "lm_head", None)
    if head is not None and (is_linear(head) or is_quantized_linear(head)):
        found["lm_head"] = head
    listed, ignored = {}, {}
    for name, module in found.items():
        pattern = next((p for p in ignore if is_ignored(name, (p,))), None)
        if pattern is None:
            listed[name] = module
        else:
            ignored[name] = f"matches the recipe's ignore pattern {pattern!r}"
    return listed, ignored


def select_targets(model: nn.Module, arch: Arch, ignore: tuple[str, ...]) -> Targets:
    """The float linears a weight step quantizes now; those already quantized (by an earlier step)
    join the ignored ones."""
    listed, ignored = listed_targets(model, arch, ignore)
    targets = Targets({}, ignored)
    for name, module in listed.items():
        if is_linear(module):
            targets.linears[name] = module
        else:
            targets.ignored[name] = f"already {type(module).__name__}, not a float linear"
    return targets


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    model.set_submodule(name, new)


def slots(model: nn.Module, arch: Arch, names) -> list[Slot]:
    """The named linears as a plan sees them: their rows' length and their decoder layer."""
    layers = len(decoder_layers(model, arch))
    prefix = arch.layers + "."
    gqa = query_heads_per_kv_head(getattr(model, "config", None))
    out = []
    for name in names:
        module = model.get_submodule(name)  # float, or already quantized when the audit asks
        cols = module.in_features if hasattr(module, "in_features") else linear_weight(module).shape[1]
        layer = int(name[len(prefix):].split(".")[0]) if name.startswith(prefix) else None
        out.append(Slot(name, cols, layer, layers, gqa))
    return out


def query_heads_per_kv_head(config) -> int:
    """n_gqa as llama.cpp reads it from a model's config; 1 where the config does not say."""
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return heads // kv_heads if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 else 1


def planned_targets(model: nn.Module, arch: Arch, ignore: tuple[str, ...], plan) -> tuple[Targets, dict]:
    """The targets and each one's grid under the recipe's plan (`scheme:`), every grid checked
    against its linear before anything changes; those the plan keeps 16-bit move to targets.ignored."""
    targets = select_targets(model, arch, ignore)
    grids, kept = plan.assign(slots(model, arch, targets.linears))
    for name, why in kept.items():
        targets.ignored[name] = why
        del targets.linears[name]
    return targets, grids
