"""Mixture-of-experts layers as one linear per expert projection.

transformers 5.x keeps routed experts as fused 3-D parameters: Qwen3MoeExperts and its modular
copies in Qwen2-MoE, OLMoE, Mixtral and DeepSeek-V3 hold gate_up_proj [E, 2I, H] and down_proj
[E, H, I]; gpt-oss holds them transposed ([E, H, 2I], gate and up interleaved) with biases and a
clamped GLU; Llama 4 transposed with gate first, its router's score scaling each expert's input.
lowbit's steps, audit and exports work on linears, so `unfuse_experts` swaps each such module for
`ExpertLinears`: the same computation over per-expert nn.Linear modules named as the hub (or,
for the families the hub stores fused, llm-compressor) names them (`mlp.experts.3.gate_proj`).
Every expert is then a target like any linear.

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

MOE_MODES = ("all_experts", "routed")


@dataclass(frozen=True)
class FusedLayout:
    """Where a fused experts class keeps expert e's gate, up and down projections."""

    transposed: bool = False  # gate_up [E, H, 2I], down [E, I, H] (x @ W) rather than [E, 2I, H], [E, H, I]
    interleaved: bool = False  # gate and up alternate along 2I (gpt-oss) rather than gate first
    biases: bool = False  # gate_up_proj_bias [E, 2I] and down_proj_bias [E, H] beside the weights
    scales_input: bool = False  # the routing weight multiplies the expert's input (Llama 4), not its output


_STACKED = FusedLayout()
# the fused experts classes lowbit splits; all but Llama 4's are called (hidden [T, H], top_k_index
# [T, k], top_k_weights [T, k]); Llama 4's whole MoE block is replaced (`ScoredInputMoe`)
LAYOUTS = {
    "Qwen3MoeExperts": _STACKED, "Qwen2MoeExperts": _STACKED, "OlmoeExperts": _STACKED,
    "MixtralExperts": _STACKED, "DeepseekV3Experts": _STACKED, "Glm4MoeExperts": _STACKED,
    "GptOssExperts": FusedLayout(transposed=True, interleaved=True, biases=True),
    "Llama4TextExperts": FusedLayout(transposed=True, scales_input=True),
}


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


class GatedAct(nn.Module):
    """act(gate) * up: the GLU of every family but gpt-oss."""

    def __init__(self, act_fn):
        super().__init__()
        self.act_fn = act_fn

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act_fn(gate) * up


class ClampedGlu(nn.Module):
    """gpt-oss's GLU: gate clamped above, up clamped both ways, (up + 1) * gate * sigmoid(alpha * gate)."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class Expert(nn.Module):
    """One expert: down(glu(gate(x), up(x)))."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, glu: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.glu = glu
        for linear in (gate_proj, up_proj, down_proj):
            linear.inputs_masked = True  # the statistics hooks get only unpadded tokens already

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


class ExpertLinears(nn.ModuleList):
    """Routed experts as a list of `Expert`s; forward as the fused module's. `layout`: how the fused
    module held them (and a checkpoint that stores them fused does)."""

    def __init__(self, experts: list[Expert], layout: FusedLayout = _STACKED):
        super().__init__(experts)
        self.layout = layout
        # tokens the router sent each expert in the statistics forwards since take_routed_tokens
        # (plain ints: no tensor for a streamed skeleton to move to meta and back)
        self.routed = [0] * len(experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                every_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`every_weight` [T, E]: the weight each expert would get were it picked, what an input-scaling
        expert's statistics see under all_experts."""
        mask = _token_mask.get()
        if mask is None:
            return self._routed(hidden_states, top_k_index, top_k_weights)
        return self._recorded(hidden_states, top_k_index, top_k_weights, mask, every_weight)

    def _weighted(self, e: int, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Expert e's weighted output for rows `hidden` and their routing weights [rows, 1]."""
        if self.layout.scales_input:
            return self[e](hidden * weight)
        return self[e](hidden) * weight

    def _routed(self, hidden, index, weights) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in index.unique().tolist():  # the experts some token picked, in order, as the fused module
            if e >= len(self):
                continue  # a routing sentinel past the last expert (none of transformers' routers emits one)
            pos, token = torch.where((index == e).T)  # the fused module's order: by rank, then token
            y = self._weighted(e, hidden[token], weights[token, pos, None])
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def _recorded(self, hidden, index, weights, mask, every_weight) -> torch.Tensor:
        """A statistics forward: padded tokens get no expert output (nothing reads them), each
        expert's linears see its routed tokens or, under all_experts, every unpadded token."""
        valid = mask.to(hidden.device) if mask.numel() else torch.ones(hidden.shape[0], dtype=torch.bool,
                                                                       device=hidden.device)
        every = calibration_settings().mode == "all_experts"
        if every and self.layout.scales_input and every_weight is None:
            raise ValueError("an input-scaling experts module needs every expert's weight under all_experts")
        kept = hidden[valid]  # one tensor for every expert: their statistics hooks share it
        kept_weight = every_weight[valid] if every_weight is not None else None
        row_of = torch.cumsum(valid, 0) - 1  # token -> its row in `kept`
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self):
            pos, token = torch.where((index == e).T & valid)
            self.routed[e] += int(token.numel())
            if every and self.layout.scales_input:  # a routed token's weight is its every_weight: same output
                y = expert(kept * kept_weight[:, e, None])[row_of[token]]
            elif every:
                y = expert(kept)[row_of[token]] * weights[token, pos, None]
            elif token.numel():
                y = self._weighted(e, hidden[token], weights[token, pos, None])
            else:
                continue
            out.index_add_(0, token, y.to(out.dtype))
        return out


class ScoredInputMoe(nn.Module):
    """Llama 4's MoE block with its experts split: the router's sigmoid score of each picked expert
    scales that expert's input; a shared expert sees every token. Same submodule names and output
    (hidden, router logits) as Llama4TextMoe, which ran every expert on every token (zero rows for
    the unpicked ones, whose outputs are zero: the experts have no biases)."""

    def __init__(self, moe: nn.Module, experts: ExpertLinears):
        super().__init__()
        self.hidden_dim, self.top_k = moe.hidden_dim, moe.top_k
        self.router, self.shared_expert, self.experts = moe.router, moe.shared_expert, experts

    def forward(self, hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, self.hidden_dim)
        scores, logits = self.router(hidden)  # scores: sigmoid of the top-k logits, 0 elsewhere
        index = torch.topk(logits, self.top_k, dim=1).indices  # the router's own pick, recomputed
        # every expert's would-be score: what its statistics see under all_experts (statistics forwards only)
        every = torch.sigmoid(logits.float()).to(scores.dtype) if _token_mask.get() is not None else None
        out = self.shared_expert(hidden)
        out.add_(self.experts(hidden, index, scores.gather(1, index), every))
        return out, logits


def is_fused_experts(module: nn.Module) -> bool:
    return type(module).__name__ in LAYOUTS


def unfuse_experts(model: nn.Module) -> int:
    """Swap every fused experts module in `model` for ExpertLinears (copies of its slices; the fused
    tensors are freed module by module). Returns how many were swapped."""
    fused = [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]
    for name, module in fused:
        experts = _unfused(module)
        if experts.layout.scales_input:  # Llama 4: the block that scales the experts' inputs goes with them
            block = name.rpartition(".")[0]
            model.set_submodule(block, ScoredInputMoe(model.get_submodule(block), experts))
        else:
            model.set_submodule(name, experts)
    return len(fused)


def _unfused(module: nn.Module) -> ExpertLinears:
    layout = LAYOUTS[type(module).__name__]
    glu = ClampedGlu(module.alpha, module.limit) if layout.interleaved else GatedAct(module.act_fn)
    tensors = {k: getattr(module, k).data for k in FUSED_TENSORS if getattr(module, k, None) is not None}
    experts = [Expert(*(_linear(w, b) for w, b in expert_slices(tensors, e, layout)), glu)
               for e in range(tensors["gate_up_proj"].shape[0])]
    return ExpertLinears(experts, layout)


FUSED_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_slices(tensors: dict, e: int, layout: FusedLayout = _STACKED) -> list[tuple]:
    """Expert e's (weight [out, in], bias or None) for gate, up and down, cut from the fused tensors
    (FUSED_TENSORS names); a tensor `tensors` lacks gives None for what it holds."""
    gate_up, down = tensors.get("gate_up_proj"), tensors.get("down_proj")
    gate_up_bias, down_bias = tensors.get("gate_up_proj_bias"), tensors.get("down_proj_bias")
    if layout.transposed:
        gate_up = None if gate_up is None else gate_up[e].T
        down = None if down is None else down[e].T
    else:
        gate_up = None if gate_up is None else gate_up[e]
        down = None if down is None else down[e]
    gate_up_bias = None if gate_up_bias is None else gate_up_bias[e]
    down_bias = None if down_bias is None else down_bias[e]
    return [*_split_gate_up(gate_up, gate_up_bias, layout.interleaved), (down, down_bias)]


def _split_gate_up(weight, bias, interleaved: bool) -> list[tuple]:
    """(gate, up) halves of one expert's [2I, H] weight and [2I] bias: alternate rows, or gate first."""
    def halves(t):
        if t is None:
            return None, None
        if interleaved:
            return t[0::2], t[1::2]
        return t[: t.shape[0] // 2], t[t.shape[0] // 2:]
    (gate, up), (gate_bias, up_bias) = halves(weight), halves(bias)
    return [(gate, gate_bias), (up, up_bias)]


def _linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> nn.Linear:
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.clone(memory_format=torch.contiguous_format), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.clone(), requires_grad=False)
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
    """A checkpoint that stores an experts module fused (`mlp.experts.gate_up_proj`: how the hub
    stores gpt-oss and Llama 4, how save_pretrained writes a model it cannot name per expert, and
    how lowbit before per-expert targets wrote float experts) read into the per-expert linears' names."""
    for name, module in model.named_modules():
        if not isinstance(module, ExpertLinears) or f"{name}.gate_up_proj" not in tensors:
            continue
        fused = {k: tensors.pop(f"{name}.{k}") for k in FUSED_TENSORS if f"{name}.{k}" in tensors}
        for e in range(fused["gate_up_proj"].shape[0]):
            for projection, (weight, bias) in zip(PROJECTIONS, expert_slices(fused, e, module.layout)):
                if weight is not None:  # a missing down_proj: the float load names it
                    tensors[f"{name}.{e}.{projection}.weight"] = weight.contiguous()
                if bias is not None:
                    tensors[f"{name}.{e}.{projection}.bias"] = bias.contiguous()
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


# families whose hub checkpoints keep the experts fused and whose transformers loader reads them
# only so: float experts go back into the fused tensors on export. Except where transformers swaps the
# experts for per-expert linears to load a quantized checkpoint (its quantizers' module patches:
# Llama 4 under compressed-tensors), which then wants them per expert, float or not.
HUB_FUSED = ("gpt_oss", "llama4_text")
PER_EXPERT_WHEN_QUANTIZED = {"llama4_text": ("compressed-tensors",)}


def transformers_reads_per_expert(model_type: Optional[str], quant_method: Optional[str]) -> bool:
    """Whether transformers loads a checkpoint of this family and quantization method with its experts
    stored per expert (converted on load, or as per-expert linears)."""
    return model_type not in HUB_FUSED or quant_method in PER_EXPERT_WHEN_QUANTIZED.get(model_type, ())


def fuse_float_experts(model: nn.Module, tensors: dict, quant_method: Optional[str]) -> dict:
    """For a HUB_FUSED family, each experts module whose projections are all plain float weights
    (ignored, or a dense export) written back as the hub's fused tensors, so that transformers loads
    it; quantized experts keep per-expert names (llm-compressor's layout for these families)."""
    if transformers_reads_per_expert(getattr(model.config, "model_type", None), quant_method):
        return tensors
    for name, module in model.named_modules():
        if not isinstance(module, ExpertLinears):
            continue
        keys = {f"{name}.{e}.{p}.{kind}" for e in range(len(module)) for p in PROJECTIONS
                for kind in ("weight", "bias")}
        prefix = f"{name}."
        owned = [k for k in tensors if k.startswith(prefix) and k[len(prefix):].split(".")[0].isdigit()]
        if not owned or any(k not in keys for k in owned):
            continue  # not written here (another portion), or quantized tensors among them
        tensors.update({f"{name}.{k}": t for k, t in _fused(tensors, name, len(module), module.layout).items()})
        for k in owned:
            del tensors[k]
    return tensors


def _fused(tensors: dict, name: str, experts: int, layout: FusedLayout) -> dict:
    """The fused tensors (FUSED_TENSORS) of `experts` experts stored per expert under `name`."""
    def part(e, projection, kind):
        return tensors.get(f"{name}.{e}.{projection}.{kind}")

    gate_up, down, gate_up_bias, down_bias = [], [], [], []
    for e in range(experts):
        gate_up.append(_joined(part(e, "gate_proj", "weight"), part(e, "up_proj", "weight"), layout.interleaved))
        down.append(part(e, "down_proj", "weight"))
        if layout.biases:
            gate_up_bias.append(_joined(part(e, "gate_proj", "bias"), part(e, "up_proj", "bias"), layout.interleaved))
            down_bias.append(part(e, "down_proj", "bias"))
    out = {"gate_up_proj": torch.stack(gate_up), "down_proj": torch.stack(down)}
    if layout.transposed:
        out = {k: v.transpose(1, 2) for k, v in out.items()}
    if layout.biases:
        out.update(gate_up_proj_bias=torch.stack(gate_up_bias), down_proj_bias=torch.stack(down_bias))
    return {k: v.contiguous() for k, v in out.items()}


def _joined(gate: torch.Tensor, up: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """One expert's gate and up rows (or biases) as the fused tensor holds them: alternating, or gate first."""
    if interleaved:
        return torch.stack([gate, up], dim=1).reshape(-1, *gate.shape[1:])
    return torch.cat([gate, up])
