"""Mixture-of-experts layers as one linear per expert projection.

transformers 5.x keeps routed experts as fused 3-D parameters (Qwen3MoeExperts and its modular
copies in Qwen2-MoE, OLMoE, Mixtral and DeepSeek-V3: gate_up_proj [E, 2I, H], down_proj [E, H, I]).
lowbit's steps, audit and exports work on linears, so `unfuse_experts` swaps each such module for
`ExpertLinears`: the same computation over per-expert nn.Linear modules named as the hub stores
them (`mlp.experts.3.gate_proj`). Every expert is then a target like any linear.

During calibration (`calibrating`), what each expert's linears see is chosen by the recipe's
`calibration.moe`: `routed` (the tokens the router sends it) or `all_experts` (every token of
the layer); the layer's output follows the router either way.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .distributed import sum_numbers

# the fused experts classes whose forward is (hidden [T, H], top_k_index [T, k], top_k_weights [T, k]),
# gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]; gpt-oss and Llama 4 store theirs
# transposed with their own forwards and are not in this list
FUSED_CLASSES = ("Qwen3MoeExperts", "Qwen2MoeExperts", "OlmoeExperts", "MixtralExperts", "DeepseekV3Experts")
MOE_MODES = ("all_experts", "routed")


@dataclass(frozen=True)
class ExpertCalibration:
    mode: str = "all_experts"  # one of MOE_MODES
    min_tokens: int = 16  # a routed expert that saw fewer calibration tokens gets a named fallback


_calibration: ContextVar[Optional[ExpertCalibration]] = ContextVar("lowbit_expert_calibration", default=None)
_token_mask: ContextVar[Optional[torch.Tensor]] = ContextVar("lowbit_expert_token_mask", default=None)


@contextmanager
def calibrating(settings: ExpertCalibration):
    """Inside the block, statistics forwards feed the experts as `settings.mode` says."""
    token = _calibration.set(settings)
    try:
        yield
    finally:
        _calibration.reset(token)


def calibration_settings() -> ExpertCalibration:
    return _calibration.get() or ExpertCalibration()


@contextmanager
def recording(mask: Optional[torch.Tensor]):
    """A statistics forward: experts leave padded tokens (mask False) out of what their linears see
    and count the tokens routed to each expert."""
    token = _token_mask.set(torch.ones(0, dtype=torch.bool) if mask is None else mask.reshape(-1))
    try:
        yield
    finally:
        _token_mask.reset(token)


class Expert(nn.Module):
    """One expert: down(act(gate(x)) * up(x))."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, act_fn):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act_fn = act_fn
        for linear in (gate_proj, up_proj, down_proj):
            linear.inputs_masked = True  # the statistics hooks get only unpadded tokens already

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ExpertLinears(nn.ModuleList):
    """Routed experts as a list of `Expert`s; forward as the fused module's."""

    def __init__(self, experts: list[Expert]):
        super().__init__(experts)
        # tokens the router sent each expert in the statistics forwards since take_routed_tokens
        # (plain ints: no tensor for a streamed skeleton to move to meta and back)
        self.routed = [0] * len(experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        mask = _token_mask.get()
        if mask is None:
            return self._routed(hidden_states, top_k_index, top_k_weights)
        return self._recorded(hidden_states, top_k_index, top_k_weights, mask)

    def _routed(self, hidden, index, weights) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in index.unique().tolist():  # the experts some token picked, in order, as the fused module
            if e >= len(self):
                continue  # a routing sentinel past the last expert (none of transformers' routers emits one)
            pos, token = torch.where((index == e).T)  # the fused module's order: by rank, then token
            y = self[e](hidden[token]) * weights[token, pos, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def _recorded(self, hidden, index, weights, mask) -> torch.Tensor:
        """A statistics forward: padded tokens get no expert output (nothing reads them), each
        expert's linears see its routed tokens or, under all_experts, every unpadded token."""
        valid = mask.to(hidden.device) if mask.numel() else torch.ones(hidden.shape[0], dtype=torch.bool,
                                                                       device=hidden.device)
        every = calibration_settings().mode == "all_experts"
        kept = hidden[valid]  # one tensor for every expert: their statistics hooks share it
        row_of = torch.cumsum(valid, 0) - 1  # token -> its row in `kept`
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self):
            pos, token = torch.where((index == e).T & valid)
            self.routed[e] += int(token.numel())
            if every:
                y = expert(kept)[row_of[token]]
            elif token.numel():
                y = expert(hidden[token])
            else:
                continue
            out.index_add_(0, token, (y * weights[token, pos, None]).to(out.dtype))
        return out


def is_fused_experts(module: nn.Module) -> bool:
    return type(module).__name__ in FUSED_CLASSES


def unfuse_experts(model: nn.Module) -> int:
    """Swap every fused experts module in `model` for ExpertLinears (copies of its slices; the fused
    tensors are freed module by module). Returns how many were swapped."""
    fused = [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]
    for name, module in fused:
        model.set_submodule(name, _unfused(module))
    return len(fused)


def _unfused(module: nn.Module) -> ExpertLinears:
    gate_up, down = module.gate_up_proj.data, module.down_proj.data
    experts = [Expert(*map(_linear, expert_slices(gate_up, down, e)), module.act_fn) for e in range(gate_up.shape[0])]
    return ExpertLinears(experts)


def expert_slices(gate_up: torch.Tensor, down: Optional[torch.Tensor], e: int) -> tuple:
    """Expert e's (gate, up, down) weights in fused tensors (gate rows first in gate_up); down None
    where `down` is."""
    inner = gate_up.shape[1] // 2
    return gate_up[e, :inner], gate_up[e, inner:], None if down is None else down[e]


def _linear(weight: torch.Tensor) -> nn.Linear:
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return linear


def expert_count(model: nn.Module, layers: str) -> int:
    """The most experts any decoder layer holds (0 for a dense model)."""
    return max((len(m) for m in model.get_submodule(layers).modules() if isinstance(m, ExpertLinears)), default=0)


def take_routed_tokens(layer: nn.Module, prefix: str) -> dict[str, list[int]]:
    """Experts module name -> tokens routed to each expert since the last call (then reset)."""
    out = {}
    for name, module in layer.named_modules(prefix=prefix):
        if isinstance(module, ExpertLinears):  # on every rank, in one order: the sum is collective
            routed = [int(n) for n in sum_numbers(*module.routed)]  # every rank's share of the samples
            module.routed = [0] * len(module)
            if any(routed):
                out[name] = routed
    return out


# the hub's names where they differ from the modules' (transformers renames them on load; vLLM's
# loaders read the hub's): (module path, stored path) inside a decoder layer, "{e}" an expert index
STORED_NAMES = {
    "mixtral": (("mlp.experts.{e}.gate_proj", "block_sparse_moe.experts.{e}.w1"),
                ("mlp.experts.{e}.up_proj", "block_sparse_moe.experts.{e}.w3"),
                ("mlp.experts.{e}.down_proj", "block_sparse_moe.experts.{e}.w2"),
                ("mlp.gate", "block_sparse_moe.gate")),
}


def stored_name(model_type: Optional[str], name: str) -> str:
    """A tensor or module name as the hub stores it."""
    return _renamed(name, [(m, s) for m, s in STORED_NAMES.get(model_type, ())])


def module_name(model_type: Optional[str], name: str) -> str:
    """A stored tensor or module name as lowbit's modules hold it."""
    return _renamed(name, [(s, m) for m, s in STORED_NAMES.get(model_type, ())])


def _renamed(name: str, pairs) -> str:
    for source, target in pairs:
        pattern = r"(^|\.)" + re.escape(source).replace(r"\{e\}", r"(?P<e>\d+)") + r"(?=\.|$)"
        match = re.search(pattern, name)
        if match:
            new = target.replace("{e}", match.group("e")) if "{e}" in target else target
            return name[:match.start()] + match.group(1) + new + name[match.end():]
    return name


def split_stored_experts(model: nn.Module, tensors: dict) -> dict:
    """A checkpoint that stores an experts module fused (`mlp.experts.gate_up_proj` [E, 2I, H]: how
    save_pretrained writes a model it cannot name per expert, and how lowbit before per-expert
    targets wrote float experts) read into the per-expert linears' names."""
    for name, module in model.named_modules():
        if not isinstance(module, ExpertLinears) or f"{name}.gate_up_proj" not in tensors:
            continue
        gate_up, down = tensors.pop(f"{name}.gate_up_proj"), tensors.pop(f"{name}.down_proj", None)
        for e in range(gate_up.shape[0]):
            for projection, weight in zip(("gate_proj", "up_proj", "down_proj"), expert_slices(gate_up, down, e)):
                if weight is not None:  # a missing down_proj: the float load names it
                    tensors[f"{name}.{e}.{projection}.weight"] = weight
    return tensors


def active_params(model: nn.Module) -> int:
    """Parameters one token runs through: all of them, less the routed experts its router does not
    pick (top-k of each layer's experts). What a decode step reads at batch 1; memory holds them all."""
    top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    for module in model.modules():
        if isinstance(module, ExpertLinears) and top_k:
            per_expert = sum(p.numel() for p in module[0].parameters())
            total -= per_expert * (len(module) - min(top_k, len(module)))
    return total
