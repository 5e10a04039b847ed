"""A streamed layer's routed experts read from the shards one expert at a time, not all at once.

A mixture's decoder layer is mostly experts (Qwen3-30B-A3B: 2.4 GB of them in float32 per layer,
DeepSeek-V3: about 45 GB), and a walk that loads the whole layer holds them all. Where a step reads
each expert's float weights only while that expert runs and while it is solved, and writes none
of them back (GPTQ without true_sequential, and the data-free rtn, rtn_mse and fp8: each linear
done is replaced by its quantized module), they can stay on the meta device: `DeferredExperts`
reads an expert's weights when its forward starts and lets them go when it ends, `fetch` reads
named linears for a solve or a rounding (StepContext.resident), and
`settle` reads whatever is still deferred once the step is done with the layer (experts the step
does not quantize), so the rest of the walk finds the layer whole. Each read is the same as the
whole layer's load (same tensors, same dtype): the figures do not change.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from .experts import ExpertLinears


class DeferredExperts:
    """The routed experts of one loaded layer, their parameters left on meta until needed.

    read(module, name): give `module` (at `name` in the model) its parameters from the source, checked
    finite; release(module): put them back on meta."""

    def __init__(self, layer: nn.Module, prefix: str, read: Callable[[nn.Module, str], None],
                 release: Callable[[nn.Module], None]):
        self.layer, self.prefix, self.read, self.release = layer, prefix, read, release
        self.experts = _experts(layer)
        self.handles = [h for rel, expert in self.experts.items()
                        for h in (expert.register_forward_pre_hook(self._before(rel)),
                                  expert.register_forward_hook(self._after(rel)))]
        self.held: set[str] = set()  # experts read by their forward's pre-hook, let go after it

    @staticmethod
    def deferred(layer: nn.Module) -> set[str]:
        """Names (relative to the layer) of the parameters a deferred load leaves on meta."""
        return {f"{rel}.{p}" for rel, expert in _experts(layer).items() for p, _ in expert.named_parameters()}

    def _before(self, rel: str):
        def hook(module, args):
            if self._read_if_meta(rel, module):
                self.held.add(rel)
        return hook

    def _after(self, rel: str):
        def hook(module, args, output):
            if rel in self.held:
                self.held.discard(rel)
                for linear in module.children():
                    if isinstance(linear, nn.Linear):  # a solved one is quantized: it stays
                        self.release(linear)
        return hook

    def _read_if_meta(self, rel: str, module: nn.Module) -> bool:
        if not any(p.is_meta for p in module.parameters()):
            return False
        self.read(module, f"{self.prefix}.{rel}")
        return True

    def fetch(self, names: list[str]) -> None:
        """Read the named linears (relative to the layer) that are still deferred, for a solve."""
        for name in names:
            self._read_if_meta(name, self.layer.get_submodule(name))

    def settle(self) -> None:
        """Stop deferring: every expert's parameters still on meta are read (those no solve replaced)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for rel, expert in self.experts.items():
            self._read_if_meta(rel, expert)


def _experts(layer: nn.Module) -> dict[str, nn.Module]:
    """Every routed expert of the layer by its name relative to the layer (`mlp.experts.3`)."""
    return {f"{name}.{e}": expert for name, module in layer.named_modules()
            if isinstance(module, ExpertLinears) for e, expert in enumerate(module)}
