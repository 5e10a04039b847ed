"""The compressed-tensors checkpoint format: what vLLM and transformers load natively."""
from __future__ import annotations

from pathlib import Path

import torch

from ..base import ExportFormat
from ..hf_folder import (checkpoint_tensors, float_linears, quant_method, quantized_modules,
                          write_quantized)
from ..tensor_table import FolderTensors, TensorTable, build_or_explain
from .agreement import config_problems, module_problems
from .codecs import (QUANT_METHOD, build_module, check_consumers_can_load, module_tensors,
                     quantization_config, quantized_prefixes)


class CompressedTensorsFormat(ExportFormat):
    name = QUANT_METHOD
    summary = "compressed-tensors: packed codes and scales per layer, loaded by transformers and vLLM"

    def write(self, model, tokenizer, folder: Path, cfg, extra_files: dict[str, str]) -> None:
        quantized = quantized_modules(model)
        check_consumers_can_load(model, quantized)
        tensors = checkpoint_tensors(model, quantized, getattr(torch, cfg.dtype), module_tensors)
        qconfig = quantization_config(quantized, float_linears(model, quantized))
        write_quantized(folder, model, tokenizer, tensors, qconfig if quantized else None, cfg.dtype, extra_files)

    def detects(self, config: dict) -> bool:
        return quant_method(config) == QUANT_METHOD

    def read(self, model, tensors, config: dict, where: str) -> None:
        qconfig = config["quantization_config"]
        as_read = dict(tensors)  # what a failed build is explained from (a build takes its tensors out)
        for prefix in quantized_prefixes(tensors):
            model.set_submodule(prefix, build_or_explain(
                lambda: build_module(prefix, tensors, qconfig, where),
                lambda: module_problems(prefix, TensorTable(as_read), qconfig), where))

    def config_problems(self, config: dict, folder: Path) -> list[str]:
        return config_problems(config["quantization_config"], FolderTensors(folder))

    def describe(self, config: dict) -> str:
        qconfig = config["quantization_config"]
        detail = qconfig.get("format") or qconfig.get("checkpoint_format", "")
        return f"{QUANT_METHOD} ({detail})" if detail else QUANT_METHOD

    def loading(self, config: dict) -> list[str]:
        groups = (config["quantization_config"].get("config_groups") or {}).values()
        load = "AutoModelForCausalLM.from_pretrained(path)"
        note = []
        if any(not (g.get("weights") or {}).get("symmetric", True) for g in groups):
            load = "AutoModelForCausalLM.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True))"
            note = ["Asymmetric weights: compressed-tensors 0.20.1's default (compressed) load path rejects packed",
                    "zero points, so dequantize on load as above."]
        return ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig",
                f"model = {load}  # needs the compressed-tensors package",
                "tokenizer = AutoTokenizer.from_pretrained(path)", "```", *note,
                "vLLM reads the compressed-tensors format too (`vllm serve path`); lowbit's tests cover transformers."]
