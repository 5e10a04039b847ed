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


@dataclass(frozen=True)
class SmoothPair:
    """A per-channel scale can be folded into `prev` and its inverse into `linears`."""

    prev: str  # a norm (input_layernorm) or a linear whose output rows feed `linears`
    linears: tuple[str, ...]


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
}


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
        return ARCHS[model_type]
    if not allow_fallback:
        raise ValueError(
            f"architecture {model_type!r} is not in lowbit's table; known: {sorted(ARCHS)}"
        )
    return _fallback_arch(model, model_type)


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
        for name in arch.linears:
            out[f"{arch.layers}.{i}.{name}"] = layer.get_submodule(name)
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
