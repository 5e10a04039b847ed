"""Model layout as data: where the decoder layers are and how their linears group.

Adding an architecture is a row in ARCHS, never an isinstance chain.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from .experts import expert_count


@dataclass(frozen=True)
class SmoothPair:
    """A per-channel scale can be folded into `prev` and its inverse into `linears`."""

    prev: str  # a norm (input_layernorm) or a linear whose output rows feed `linears`
    linears: tuple[str, ...]
    # modules that also read prev's output and take the inverse scale into their weight's input
    # columns, neither quantized nor searched: a mixture's router, whose logits so stay as they were
    passengers: tuple[str, ...] = ()
    # the module whose output judges a scaling and whose input is the statistic, where the linears sit
    # in several (a mixture's MoE block: its experts see only the tokens routed to them)
    block: str = ""


@dataclass(frozen=True)
class Arch:
    layers: str  # dotted path of the decoder-layer ModuleList
    # true-sequential groups: each is quantized after the ones before it have been
    groups: tuple[tuple[str, ...], ...]
    smooth: tuple[SmoothPair, ...] = ()
    k_proj: Optional[str] = None  # None where k and v are fused into one projection
    v_proj: Optional[str] = None
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by (1 + weight)
    fallback: bool = False  # True when guessed from the modules, not taken from the table

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.groups for name in group)


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_LLAMA = Arch(
    layers="model.layers",
    groups=(_QKV, ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)),
    smooth=(
        SmoothPair("input_layernorm", _QKV),
        SmoothPair("self_attn.v_proj", ("self_attn.o_proj",)),
        SmoothPair("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        SmoothPair("mlp.up_proj", ("mlp.down_proj",)),
    ),
    k_proj="self_attn.k_proj",
    v_proj="self_attn.v_proj",
)
_GEMMA = Arch(
    layers=_LLAMA.layers,
    groups=_LLAMA.groups,
    smooth=(
        SmoothPair("input_layernorm", _QKV),
        SmoothPair("self_attn.v_proj", ("self_attn.o_proj",)),
        # Gemma 2/3 normalise the attention output again (post_attention_layernorm); the MLP
        # input norm is pre_feedforward_layernorm
        SmoothPair("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        SmoothPair("mlp.up_proj", ("mlp.down_proj",)),
    ),
    k_proj="self_attn.k_proj",
    v_proj="self_attn.v_proj",
    norm_offset=1.0,
)
_PHI3 = Arch(
    layers="model.layers",
    groups=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
    smooth=(
        SmoothPair("input_layernorm", ("self_attn.qkv_proj",)),
        SmoothPair("post_attention_layernorm", ("mlp.gate_up_proj",)),
    ),
)
_OPT_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_OPT = Arch(
    layers="model.decoder.layers",
    groups=(_OPT_QKV, ("self_attn.out_proj",), ("fc1",), ("fc2",)),
    smooth=(
        SmoothPair("self_attn_layer_norm", _OPT_QKV),
        SmoothPair("self_attn.v_proj", ("self_attn.out_proj",)),
        SmoothPair("final_layer_norm", ("fc1",)),
    ),
    k_proj="self_attn.k_proj",
    v_proj="self_attn.v_proj",
)
_GPT2 = Arch(  # Conv1D layers: weights stored (in, out)
    layers="transformer.h",
    groups=(("attn.c_attn",), ("attn.c_proj",), ("mlp.c_fc",), ("mlp.c_proj",)),
    smooth=(SmoothPair("ln_1", ("attn.c_attn",)), SmoothPair("ln_2", ("mlp.c_fc",))),
)

# mixtures of experts (calibrate/experts.py turns fused experts into per-expert linears): "{e}" in a
# name stands for each expert index; names a layer lacks (a dense first layer's experts, a sparse
# layer's dense MLP) are skipped there, and the audit's parameter count catches anything left float.
# Routers (`mlp.gate`, `mlp.router`, Qwen2-MoE's `shared_expert_gate`) stay float on purpose.
_EXPERTS = (("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"), ("mlp.experts.{e}.down_proj",))
_DENSE_MLP = (("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def _moe_groups(attention, shared: str = "") -> tuple[tuple[str, ...], ...]:
    """Attention groups, then gate/up of the dense MLP, the experts and a shared expert (one input),
    then their down projections."""
    extra = ((f"{shared}.gate_proj", f"{shared}.up_proj"), (f"{shared}.down_proj",)) if shared else ((), ())
    return (*attention, *(d + x + s for d, x, s in zip(_DENSE_MLP, _EXPERTS, extra)))


def _mlp_pairs(block: str = "mlp", shared: str = "", passengers: tuple[str, ...] = ("gate",),
               up_down: bool = True) -> tuple[SmoothPair, ...]:
    """The MLP input norm into a MoE block's experts (and shared expert), its routers passengers; or,
    in a dense layer, into the MLP's gate and up (layer_pairs keeps the one a layer holds). With
    up_down, each expert's (and the shared expert's, the dense MLP's) up_proj into its own down_proj:
    down reads act(gate) * up, linear in up's rows (not so under gpt-oss's clamped GLU)."""
    experts = tuple(n.replace("mlp.", f"{block}.") for n in _EXPERTS[0])
    shared_in = (f"{shared}.gate_proj", f"{shared}.up_proj") if shared else ()
    norm_pairs = (SmoothPair("post_attention_layernorm", experts + shared_in,
                             passengers=tuple(f"{block}.{p}" for p in passengers), block=block),
                  SmoothPair("post_attention_layernorm", (f"{block}.gate_proj", f"{block}.up_proj")))
    if not up_down:
        return norm_pairs
    mlps = (f"{block}.experts.{{e}}", f"{block}", *((shared,) if shared else ()))
    return norm_pairs + tuple(SmoothPair(f"{m}.up_proj", (f"{m}.down_proj",)) for m in mlps)


_MOE = Arch(
    layers="model.layers",
    groups=_moe_groups((_QKV, ("self_attn.o_proj",))),
    smooth=(SmoothPair("input_layernorm", _QKV), SmoothPair("self_attn.v_proj", ("self_attn.o_proj",)), *_mlp_pairs()),
    k_proj="self_attn.k_proj",
    v_proj="self_attn.v_proj",
)
# DeepSeek-V3's multi-head latent attention: q (or its low-rank q_a) and the joint kv_a read the
# hidden state; q_b and kv_b read their normed latents; no per-head k/v projection to scale
_MLA_INPUT = ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")
_DEEPSEEK_V3 = Arch(
    layers="model.layers",
    groups=_moe_groups((_MLA_INPUT, ("self_attn.q_b_proj",), ("self_attn.kv_b_proj",), ("self_attn.o_proj",)),
                       shared="mlp.shared_experts"),
    # each latent's norm feeds one projection alone (kv_a's rotary slice bypasses kv_a_layernorm: a
    # scale folded there leaves it untouched)
    smooth=(SmoothPair("input_layernorm", _MLA_INPUT),
            SmoothPair("self_attn.q_a_layernorm", ("self_attn.q_b_proj",)),
            SmoothPair("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",)),
            *_mlp_pairs(shared="mlp.shared_experts")),
)

# GLM-4.5: DeepSeek-V3's mixture (sigmoid router with grouped top-k, shared experts, dense first
# layers) under grouped-query attention (q/k norms optional, partial rotary: neither changes a pair)
_GLM4_MOE = replace(_MOE, groups=_moe_groups((_QKV, ("self_attn.o_proj",)), shared="mlp.shared_experts"),
                    smooth=(*_MOE.smooth[:2], *_mlp_pairs(shared="mlp.shared_experts")))

# gpt-oss: attention with biases and sinks (softmax only: v -> o stays linear), routed experts alone
_GPT_OSS = replace(_MOE, groups=(_QKV, ("self_attn.o_proj",), _EXPERTS[0], _EXPERTS[1]),
                   smooth=(*_MOE.smooth[:2], *_mlp_pairs(passengers=("router",), up_down=False)))
# Llama 4 (text): the MoE block is `feed_forward` (routed experts and a shared one, both reading the
# normed hidden state; the routed ones scaled by the router's score), dense layers between them
_L4_FFN = (("feed_forward.gate_proj", "feed_forward.up_proj"), ("feed_forward.down_proj",))
_L4_EXPERTS = tuple(tuple(n.replace("mlp.", "feed_forward.") for n in group) for group in _EXPERTS)
_L4_SHARED = (("feed_forward.shared_expert.gate_proj", "feed_forward.shared_expert.up_proj"),
              ("feed_forward.shared_expert.down_proj",))
_LLAMA4 = replace(_MOE, groups=(_QKV, ("self_attn.o_proj",),
                                 *(d + x + s for d, x, s in zip(_L4_FFN, _L4_EXPERTS, _L4_SHARED))),
                  smooth=(*_MOE.smooth[:2], *_mlp_pairs("feed_forward", "feed_forward.shared_expert", ("router",))))

ARCHS: dict[str, Arch] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "gemma3": replace(_GEMMA, layers="model.language_model.layers"),
    "phi3": _PHI3,
    "opt": _OPT,
    "gpt2": _GPT2,
    "qwen3_moe": _MOE,
    "mixtral": _MOE,
    "olmoe": _MOE,
    "qwen2_moe": replace(_MOE, groups=_moe_groups((_QKV, ("self_attn.o_proj",)), shared="mlp.shared_expert"),
                         smooth=(*_MOE.smooth[:2], *_mlp_pairs(shared="mlp.shared_expert",
                                                               passengers=("gate", "shared_expert_gate")))),
    "deepseek_v3": _DEEPSEEK_V3,
    "glm4_moe": _GLM4_MOE,
    "gpt_oss": _GPT_OSS,
    "llama4_text": _LLAMA4,
}


def layer_pairs(layer: nn.Module, pairs) -> list[SmoothPair]:
    """The pairs as this layer holds them: linears it lacks left out (DeepSeek-V3's q_proj where q
    is low-rank, q_a/q_b where it is not), a pair left without prev or linears dropped."""
    present = dict(layer.named_modules())
    out = []
    for pair in pairs:
        linears = tuple(n for n in pair.linears if n in present)
        if pair.prev in present and linears and (not pair.block or pair.block in present):
            out.append(replace(pair, linears=linears, passengers=tuple(n for n in pair.passengers if n in present)))
    return out


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The (out, in) weight of an nn.Linear, or a view of a GPT-2 Conv1D's (stored (in, out)):
    writing into it writes the module's weight."""
    if isinstance(module, nn.Linear):
        return module.weight.data
    if type(module).__name__ == "Conv1D":
        return module.weight.data.t()
    raise TypeError(f"{type(module).__name__} is not a linear layer")


def arch_for(model: nn.Module, allow_fallback: bool = True) -> Arch:
    """The table row for model.config.model_type, or a guessed layout with a warning."""
    model_type = getattr(model.config, "model_type", None)
    if model_type in ARCHS:
        return with_experts(ARCHS[model_type], expert_count(model, ARCHS[model_type].layers))
    if not allow_fallback:
        raise ValueError(
            f"architecture {model_type!r} is not in lowbit's table; known: {sorted(ARCHS)}"
        )
    return _fallback_arch(model, model_type)


def with_experts(arch: Arch, experts: int) -> Arch:
    """The row with each "{e}" name written out once per expert index (none for a dense model)."""
    if not any("{e}" in n for n in arch.linears):
        return arch
    def written(names: tuple[str, ...]) -> tuple[str, ...]:
        return (tuple(n for n in names if "{e}" not in n)
                + tuple(n.format(e=e) for e in range(experts) for n in names if "{e}" in n))

    groups = tuple(written(group) for group in arch.groups)
    smooth = tuple(pair for template in arch.smooth for pair in _pairs_written(template, experts, written))
    return replace(arch, groups=tuple(g for g in groups if g), smooth=tuple(p for p in smooth if p.linears))


def _pairs_written(pair: SmoothPair, experts: int, written) -> tuple[SmoothPair, ...]:
    """A pair inside one expert (its prev names "{e}"): one per expert; else its "{e}" linears written out."""
    if "{e}" not in pair.prev:
        return (replace(pair, linears=written(pair.linears)),)
    return tuple(replace(pair, prev=pair.prev.format(e=e), linears=tuple(n.format(e=e) for n in pair.linears))
                 for e in range(experts))


def _fallback_arch(model: nn.Module, model_type) -> Arch:
    n_layers = getattr(model.config, "num_hidden_layers", None)
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and (
            n_layers is None or len(module) == n_layers
        ):
            names = tuple(n for n, m in module[0].named_modules() if n and is_linear(m))
            if names:
                warnings.warn(
                    f"architecture {model_type!r} is not in lowbit's table (known: "
                    f"{sorted(ARCHS)}); falling back to every linear inside {path}[i]: "
                    f"{', '.join(names)}. Quantized one at a time, no smoothing pairs, no KV scales.",
                    stacklevel=2,
                )
                return Arch(layers=path, groups=tuple((n,) for n in names), fallback=True)
    raise ValueError(
        f"architecture {model_type!r} is not in lowbit's table (known: {sorted(ARCHS)}) and no "
        "list of decoder layers holding linear layers was found in the model"
    )


def decoder_layers(model: nn.Module, arch: Arch) -> nn.ModuleList:
    return model.get_submodule(arch.layers)


def target_linears(model: nn.Module, arch: Arch) -> dict[str, nn.Module]:
    """Full module name -> linear module, for every linear the table targets, in layer order."""
    out = {}
    for i, layer in enumerate(decoder_layers(model, arch)):
        modules = dict(layer.named_modules())
        for name in arch.linears:
            if name in modules:  # a mixture's dense layers lack its experts, its sparse ones the dense MLP
                out[f"{arch.layers}.{i}.{name}"] = modules[name]
    return out


def matches_name(name: str, patterns) -> bool:
    """Exact module name, a trailing component path (`lm_head`, `mlp.down_proj`), or `re:REGEX`."""
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False
