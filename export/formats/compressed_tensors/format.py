"""The compressed-tensors checkpoint format: what vLLM and transformers load natively."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from lowbit.calibrate.experts import transformers_reads_per_expert

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
        model_type = model.config.model_type
        if any(".experts." in n for n in quantized) and not transformers_reads_per_expert(model_type, QUANT_METHOD):
            warnings.warn(f"{model_type}: {EXPERTS_UNREAD}", stacklevel=2)

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
                    "zero points, so dequantize on load as above; a mixture of experts does not load so either",
                    "(transformers 5.25 drops its experts' zero points): load it with `lowbit.export.reader.load(path)`."]
        if not transformers_reads_per_expert(config.get("model_type"), QUANT_METHOD) and _quantized_experts(config):
            note.append(EXPERTS_UNREAD)
        return ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig",
                f"model = {load}  # needs the compressed-tensors package",
                "tokenizer = AutoTokenizer.from_pretrained(path)", "```", *note,
                "vLLM reads the compressed-tensors format too (`vllm serve path`); lowbit's tests cover transformers."]


EXPERTS_UNREAD = ("transformers 5.x reads this family's experts only fused ([experts, ...] tensors), so it would "
                  "leave these per-expert quantized experts unread and initialize its own at random: load the "
                  "checkpoint with lowbit (`lowbit.export.reader.load(path)`) or a runtime that reads per-expert "
                  "tensors (llm-compressor's layout), or keep the experts float (ignore `re:.*\\.experts\\..*`).")


def _quantized_experts(config: dict) -> bool:
    """Whether any routed expert's projection is quantized: not all of them in the ignore list."""
    ignored = [n for n in config["quantization_config"].get("ignore") or [] if ".experts." in n]
    layers, experts = config.get("num_hidden_layers", 0), config.get("num_local_experts", 0)
    return len(ignored) < layers * experts * 3
