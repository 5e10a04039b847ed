"""The audit counts parameters, not linears: every tensor of two or more dimensions inside a decoder
layer is part of a quantized module, kept float on purpose (ignored, or a mixture-of-experts
router), or a problem. transformers 5.x holds MoE experts as fused 3-D parameters on an `experts`
module (Qwen3MoeExperts: gate_up_proj [E, 2I, H], down_proj [E, H, I]), not as linears, so a
linear-by-linear check passes a model whose experts stayed float; this count does not.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import nn

from lowbit.calibrate.arch import Arch, matches_name
from lowbit.quantize.runtime.modules import is_quantized_linear

# transformers 5.x names the module beside `experts` that picks them `gate` (Qwen3-MoE, Mixtral,
# DeepSeek, ...) or `router` (gpt-oss, ...), and Qwen2-MoE gates its shared expert: small matrices kept float on purpose
ROUTERS = ("gate", "router", "shared_expert_gate")
ROUTER_KEPT = "router: kept float"


@dataclass
class MatrixCount:
    quantized: int = 0  # weight parameters (out x in) of the quantized modules in decoder layers
    float: int = 0  # parameters of the float matrices there, kept float on purpose or not
    kept: dict[str, str] = field(default_factory=dict)  # module -> why it stays float (not a linear)

    @property
    def share(self) -> Optional[float]:
        """The share of decoder-layer matrix parameters that are quantized; None without any."""
        total = self.quantized + self.float
        return self.quantized / total if total else None

    def add(self, other: "MatrixCount") -> None:
        self.quantized += other.quantized
        self.float += other.float
        self.kept.update(other.kept)


def count_matrices(model: nn.Module, arch: Arch, kept_float: dict[str, str], ignore: tuple[str, ...],
                   checked=()) -> tuple[MatrixCount, list[str]]:
    """(the count, a problem per float matrix nobody meant) over every decoder layer. kept_float:
    modules meant to stay float (with the reason); ignore: patterns (calibrate.arch.matches_name)
    of modules or tensors meant to; checked: modules whose own check already reports them float."""
    count, problems, seen = MatrixCount(), [], set()
    for index, layer in model.get_submodule(arch.layers).named_children():  # a streamed portion: some layers
        modules = dict(layer.named_modules(prefix=f"{arch.layers}.{index}"))
        for name, module in modules.items():
            if is_quantized_linear(module):
                count.quantized += module.in_features * module.out_features
                continue
            for tensor_name, tensor in _own_matrices(module, seen):
                full = f"{name}.{tensor_name}"
                count.float += tensor.numel()
                if name in kept_float or name in checked:
                    continue
                if matches_name(name, ignore) or matches_name(full, ignore):
                    count.kept[name] = "matches the ignore list"
                elif _is_router(name, modules):
                    count.kept[name] = ROUTER_KEPT
                else:
                    problems.append(f"{full}: float {list(tensor.shape)} ({tensor.numel():,} parameters) "
                                    "in a decoder layer, neither quantized nor ignored")
    return count, problems


def _own_matrices(module: nn.Module, seen: set) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's own parameters and saved buffers of 2+ dimensions, each shared tensor once."""
    tensors = list(module.named_parameters(recurse=False))
    tensors += [(n, b) for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
    for name, tensor in tensors:
        if tensor is not None and tensor.ndim >= 2 and id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def _is_router(name: str, modules: dict[str, nn.Module]) -> bool:
    parent, _, last = name.rpartition(".")
    return last in ROUTERS and isinstance(getattr(modules.get(parent), "experts", None), nn.Module)
