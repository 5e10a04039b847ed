"""RoPE as a .gguf file holds it beyond the metadata keys: Llama 3's scaling as llama.cpp's
`rope_freqs` tensor, which lowbit derives from config.json on write and never reads back."""
from __future__ import annotations

import math
from typing import Optional

import torch

ROPE_FREQS = "rope_freqs.weight"


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_freqs(config) -> Optional[torch.Tensor]:
    """llama.cpp's `rope_freqs.weight` for Llama 3's RoPE scaling: each frequency's divisor (1 above
    the high-frequency wavelength, `factor` below the low one, smoothly between), float32
    [rotary width / 2], as convert_hf_to_gguf derives it from the config. None for other RoPE."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "llama3":
        return None
    dim = head_dim(config)
    freqs = 1.0 / (rope.get("rope_theta", 10000.0) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    context = rope.get("original_max_position_embeddings", 8192)
    divisors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            divisors.append(1.0)
        elif wavelength > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(divisors, dtype=torch.float32)
