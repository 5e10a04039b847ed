"""gguf: one model.gguf (tensors, metadata, tokenizer) for llama.cpp, Ollama and LM Studio, in a lowbit
checkpoint folder (config.json whose quantization_config says quant_method "gguf", generation config,
card, manifest; the tokenizer only inside model.gguf) that lowbit and transformers
(`gguf_file="model.gguf"`) read back. For a model transformers' GGUF loader does not read (OLMoE,
Llama 3's RoPE scaling) the folder also holds the tokenizer's files, which lowbit reads instead."""
from __future__ import annotations

from pathlib import Path

import torch

from lowbit.calibrate.model_config import read_config
from lowbit.export import kv_scales

from ..base import ExportFormat
from ..hf_folder import base_config, quant_method, write_folder_files
from .modules import module_from_ggml
from .names import transformers_reads
from .reader import TYPE_SUFFIX, gguf_tensor_bytes, read_gguf_tensors
from .writer import write_gguf

GGUF_FILE = "model.gguf"
METHOD = "gguf"  # config.json's quantization_config.quant_method: marks the format for lowbit's reader


class GGUFFormat(ExportFormat):
    name = "gguf"
    summary = ("gguf: one model.gguf (GGML blocks Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K, MXFP4, tokenizer, metadata) "
               "for llama.cpp, Ollama and LM Studio; --type quantizes float linears by llama.cpp's RTN")

    def write(self, model, tokenizer, folder: Path, cfg, extra_files: dict[str, str]) -> None:
        if kv_scales.kv_config(model) is not None:
            raise ValueError("GGUF export cannot hold lowbit's quantized KV cache (llama.cpp chooses its cache "
                             "type at run time: llama-cli --cache-type-k q8_0); drop the kv_cache step")
        title = Path(getattr(model.config, "name_or_path", "") or "model").name or "model"
        write_gguf(folder / GGUF_FILE, model, tokenizer, cfg, title)
        config = base_config(model, cfg.dtype)
        config.pop(kv_scales.KEY, None)
        config["quantization_config"] = {"quant_method": METHOD, "file": GGUF_FILE, "type": cfg.type,
                                         "embedding_type": cfg.embedding_type}
        # no tokenizer files where transformers reads the file: the tokenizer is in model.gguf, and its
        # gguf_file= loader, finding a tokenizer.json beside the file, builds it without its BOS/EOS/PAD tokens
        reads = transformers_reads(model.config)
        if not reads:  # said only where false: the other files' config.json stays as it was
            config["quantization_config"]["transformers_reads"] = False
        write_folder_files(folder, model, None if reads else tokenizer, config, extra_files)

    def detects(self, config: dict) -> bool:
        return quant_method(config) == METHOD

    def outer_dtype(self, cfg) -> torch.dtype:
        return torch.float32  # the token embedding is rounded to its GGML type from float32

    def load_tokenizer(self, folder: Path, trust_remote_code: bool):
        from transformers import AutoTokenizer

        if _transformers_reads(folder):
            return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)

    def read_tensors(self, folder: Path, model) -> dict[str, torch.Tensor]:
        return read_gguf_tensors(Path(folder) / GGUF_FILE, model)

    def read(self, model, tensors, config: dict, where: str) -> None:
        for key in [k for k in tensors if k.endswith(TYPE_SUFFIX)]:
            layer = key.removesuffix(TYPE_SUFFIX)
            ggml_type = int(tensors.pop(key))
            raw = tensors.pop(f"{layer}.weight")
            bias = tensors.pop(f"{layer}.bias", None)
            native = model.get_submodule(layer)
            try:
                module = module_from_ggml(ggml_type, raw, native.in_features, native.out_features, bias is not None)
            except ValueError as err:
                raise ValueError(f"{where}: {layer}: {err}") from None
            if bias is not None:
                module.bias = bias.float().clone()
            model.set_submodule(layer, module)

    def weight_bytes(self, folder: Path) -> int:
        return gguf_tensor_bytes(Path(folder) / GGUF_FILE)

    def describe(self, config: dict) -> str:
        q = config["quantization_config"]
        rounded = [f"{what} rounded to {q[key]} by llama.cpp's RTN" for key, what in
                   (("type", "float linears"), ("embedding_type", "token embedding")) if q.get(key)]
        return f"GGUF, one file `{q.get('file', GGUF_FILE)}`" + (f" ({'; '.join(rounded)})" if rounded else "")

    def loading(self, config: dict) -> list[str]:
        file = config["quantization_config"].get("file", GGUF_FILE)
        python = (["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
                   f"model = AutoModelForCausalLM.from_pretrained(path, gguf_file=\"{file}\")  # dequantized on load",
                   f"tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=\"{file}\")", "```"]
                  if config["quantization_config"].get("transformers_reads", True) else
                  ["transformers' `gguf_file=` loader does not rebuild this model from its GGUF file (it does not "
                   "read the architecture, or drops Llama 3's RoPE scaling); `lowbit.export.reader.load(path)` "
                   "does (dequantized on load)."])
        return ["```bash", f"llama-cli -m {file} -p \"Hello\"          # llama.cpp",
                f"printf 'FROM ./{file}\\n' > Modelfile && ollama create mymodel -f Modelfile   # Ollama", "```",
                *python,
                f"LM Studio: import `{file}`. One file holds the weights, the tokenizer and the chat template."]


def _transformers_reads(folder: Path) -> bool:
    """Whether the checkpoint's config says transformers' gguf_file= loader reads it (older folders: yes)."""
    config = read_config(str(folder))
    return config.get("quantization_config", {}).get("transformers_reads", True)
