"""dense: the model as a plain float transformers checkpoint, every quantized linear dequantized
into an ordinary weight and no quantization_config, for runtimes without quantization support and
to compare against. What only a runtime module does (int8/FP8 activations, the quantized KV
cache) is not kept: the checkpoint runs as the float model with the quantized weights."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lowbit.export import kv_scales

from .base import ExportFormat
from .hf_folder import base_config, checkpoint_tensors, native_modules, quantized_modules, write_folder


class DenseFormat(ExportFormat):
    name = "dense"
    summary = ("dense: a plain 16-bit transformers checkpoint, quantized weights dequantized, "
               "no quantization_config (activation and KV-cache quantization dropped)")
    holds_quantized = False

    def write(self, model, tokenizer, folder: Path, cfg, extra_files: dict[str, str]) -> None:
        quantized = quantized_modules(model)
        transposed = _conv1d_names(model, quantized)

        def module_tensors(prefix: str, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
            weight = module.dequantized_weight().float()
            out = {f"{prefix}.weight": (weight.t() if prefix in transposed else weight).to(dtype).contiguous()}
            if module.bias is not None:
                out[f"{prefix}.bias"] = module.bias.to(dtype)
            return out

        tensors = checkpoint_tensors(model, quantized, getattr(torch, cfg.dtype), module_tensors)
        config = base_config(model, cfg.dtype)
        config.pop(kv_scales.KEY, None)  # a source checkpoint's quantized cache: not part of a dense one
        write_folder(folder, model, tokenizer, tensors, config, extra_files)

    def detects(self, config: dict) -> bool:
        return not config.get("quantization_config") and kv_scales.KEY not in config

    def read(self, model, tensors, config: dict, where: str) -> None:
        """Nothing to build: every tensor is an ordinary weight, which the caller loads."""

    def describe(self, config: dict) -> str:
        return f"float safetensors ({config.get('dtype', '?')}, no quantization_config)"

    def loading(self, config: dict) -> list[str]:
        return ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
                "model = AutoModelForCausalLM.from_pretrained(path)",
                "tokenizer = AutoTokenizer.from_pretrained(path)", "```",
                "A plain transformers checkpoint: no quantization package needed."]


def _conv1d_names(model: nn.Module, names) -> set[str]:
    """Layers the architecture builds as GPT-2's Conv1D, whose weight is stored (in, out)."""
    from transformers.pytorch_utils import Conv1D

    return {n for n, m in native_modules(model, names).items() if isinstance(m, Conv1D)}
