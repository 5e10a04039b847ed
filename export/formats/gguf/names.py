"""What a .gguf file calls things: the architectures lowbit writes, their tensor names (the `gguf`
package's TensorNameMap, as llama.cpp's convert_hf_to_gguf.py uses it), the q/k row order llama.cpp
expects, and the hyperparameter metadata."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GGUFArch:
    name: str  # general.architecture, and the MODEL_ARCH member's value
    permute_qk: bool  # llama.cpp's llama graph rotates interleaved pairs: q/k rows are reordered on write


ARCHS = {
    "llama": GGUFArch("llama", permute_qk=True),
    "qwen2": GGUFArch("qwen2", permute_qk=False),  # NEOX rope: rows kept as they are
}


def arch_of(config, where: str) -> GGUFArch:
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHS:
        raise ValueError(f"{where}: GGUF export supports the architectures {sorted(ARCHS)}; this model is "
                         f"{model_type!r}")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{where}: GGUF export writes plain RoPE only; this model's rope_parameters.rope_type "
                         f"is {rope.get('rope_type')!r}")
    return ARCHS[model_type]


class TensorNames:
    """Hugging Face state-dict names <-> .gguf tensor names for one model."""

    def __init__(self, arch: GGUFArch, num_layers: int):
        import gguf

        member = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch.name)
        self._map = gguf.get_tensor_name_map(member, num_layers)

    def gguf_name(self, hf_name: str) -> str | None:
        """The .gguf name, or None for a tensor llama.cpp does not store (RoPE's inv_freq)."""
        return self._map.get_name(hf_name, try_suffixes=(".weight", ".bias"))


def qk_row_order(config, hf_name: str, arch: GGUFArch) -> torch.Tensor | None:
    """The row permutation llama.cpp's converter applies to a llama q_proj/k_proj weight (and bias):
    each head's rows [0, d/2) and [d/2, d) interleaved. None for every other tensor. Rows only, so a
    packed GGML row (whole blocks along in_features) moves as one piece."""
    if not arch.permute_qk:
        return None
    if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        heads = config.num_attention_heads
    elif hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        heads = config.num_key_value_heads
    else:
        return None
    rows = heads * _head_dim(config)
    # convert_hf_to_gguf: w.reshape(heads, 2, d/2, ...).swapaxes(1, 2).reshape(w.shape)
    return torch.arange(rows).reshape(heads, 2, -1).transpose(1, 2).reshape(-1)


def inverse(order: torch.Tensor) -> torch.Tensor:
    return torch.argsort(order)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def add_hyperparameters(writer, config, arch: GGUFArch) -> None:
    """llama.cpp's `{arch}.*` keys, from a transformers config (as convert_hf_to_gguf writes them)."""
    head_dim = _head_dim(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
