"""A streamed layer's routed experts read from the shards one expert at a time, not all at once.

A mixture's decoder layer is mostly experts (Qwen3-30B-A3B: 2.4 GB of them in float32 per layer,
DeepSeek-V3: about 45 GB), and a walk that loads the whole layer holds them all. Where a step reads
each expert's float weights only while that expert runs and while it is solved, and writes none
of them back (GPTQ without true_sequential: each solved linear is replaced by its quantized
module), they can stay on the meta device: `DeferredExperts` reads an expert's weights when its
forward starts and lets them go when it ends, `fetch` reads named linears for a solve, and
`settle` reads whatever is still deferred once the step is done with the layer (experts the step
does not quantize), so the rest of the walk finds the layer whole. Each read is the same as the
whole layer's load (same tensors, same dtype): the figures do not change.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .experts import ExpertLinears


class DeferredExperts:
    """The routed experts of one loaded layer, their parameters left on meta until needed.

    read(module, name): give `module` (at `name` in the model) its parameters from the source, checked
    finite."""

    def __init__(self, layer: nn.Module, prefix: str, read: Callable[[nn.Module, str], None]):
        self.layer, self.prefix, self.read = layer, prefix, read
        self.experts = {f"{name}.{e}": expert for name, module in layer.named_modules()
                        if isinstance(module, ExpertLinears) for e, expert in enumerate(module)}
        self.handles = [h for rel, expert in self.experts.items()
                        for h in (expert.register_forward_pre_hook(self._before(rel)),
                                  expert.register_forward_hook(self._after(rel)))]
        self.held: set[str] = set()  # experts read by their forward's pre-hook, let go after it

    @staticmethod
    def deferred(layer: nn.Module) -> set[str]:
        """Names (relative to the layer) of the parameters a deferred load leaves on meta."""
        return {f"{name}.{e}.{p}" for name, module in layer.named_modules() if isinstance(module, ExpertLinears)
                for e, expert in enumerate(module) for p, _ in expert.named_parameters()}

    def _before(self, rel: str):
        def hook(module, args):
            if self._read_meta(rel, module):
                self.held.add(rel)
        return hook

    def _after(self, rel: str):
        def hook(module, args, output):
            if rel in self.held:
                self.held.discard(rel)
                for linear in module.children():
                    if isinstance(linear, nn.Linear):  # a solved one is quantized: it stays
                        _to_meta(linear)
        return hook

    def _read_meta(self, rel: str, module: nn.Module) -> bool:
        if not any(p.is_meta for p in module.parameters()):
            return False
        self.read(module, f"{self.prefix}.{rel}")
        return True

    def fetch(self, names: list[str]) -> None:
        """Read the named linears (relative to the layer) that are still deferred, for a solve."""
        for name in names:
            module = self.layer.get_submodule(name)
            if any(p.is_meta for p in module.parameters()):
                self.read(module, f"{self.prefix}.{name}")

    def settle(self) -> None:
        """Stop deferring: every expert's parameters still on meta are read (those no solve replaced)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for rel, expert in self.experts.items():
            self._read_meta(rel, expert)


def _to_meta(linear: nn.Linear) -> None:
    for name, param in list(linear.named_parameters(recurse=False)):
        setattr(linear, name, nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False))
