"""Write a quantized model as a checkpoint, atomically, and read it back into runtime modules."""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lowbit.quantize.qlinear import QuantLinear

from . import compressed_tensors as ct
from .config import ExportConfig

WEIGHTS = "model.safetensors"
DONE_MARKER = "config.json"  # written last into the staging folder; the rename publishes it all


def save(model: nn.Module, tokenizer, out_dir: str | Path, cfg: ExportConfig,
         extra_files: dict[str, str] | None = None) -> Path:
    """Write the checkpoint into a staging folder beside out_dir, then rename it into place."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir, cfg.overwrite)
    staging = out_dir.with_name(f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        _write(model, tokenizer, staging, cfg.dtype, extra_files or {})
        _publish(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def check_output_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"output {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"output folder {out_dir} is not empty; choose another --output or pass --overwrite"
        )
    parent = out_dir.parent if out_dir.parent != Path("") else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"cannot write into {parent} (for output {out_dir})")


def _write(model, tokenizer, folder: Path, dtype_name: str, extra_files) -> None:
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    dtype = getattr(torch, dtype_name)
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in _float_tensors(model, quantized).items()}
    for name, module in quantized.items():
        tensors.update(ct.module_tensors(name, module, dtype))
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    for name, text in extra_files.items():
        (folder / name).write_text(text, encoding="utf-8")
    config = model.config.to_dict()
    config["dtype"] = dtype_name
    config["quantization_config"] = ct.quantization_config(quantized, _float_linears(model, quantized))
    (folder / DONE_MARKER).write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


def _float_tensors(model: nn.Module, quantized: dict) -> dict[str, torch.Tensor]:
    """Every tensor except those of quantized modules, shared (tied) storage written once."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        owner = name.rsplit(".", 1)[0]
        if owner in quantized:
            continue
        ptr = tensor.data_ptr()
        if ptr in seen:
            continue  # tied to a tensor already written (lm_head <- embed_tokens)
        seen.add(ptr)
        out[name] = tensor.detach().contiguous()
    return out


def _float_linears(model, quantized) -> list[str]:
    """Names for the config's ignore list: linears that stay float (ignored or not targeted)."""
    from lowbit.calibrate.arch import is_linear

    return [n for n, m in model.named_modules() if is_linear(m) and n not in quantized]


def _publish(staging: Path, out_dir: Path) -> None:
    if out_dir.exists():  # --overwrite: move the old one aside, so a crash still leaves one whole
        old = out_dir.with_name(f".{out_dir.name}.old-{int(time.time())}")
        out_dir.rename(old)
        staging.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(out_dir)


def is_checkpoint(folder: Path) -> bool:
    return (folder / DONE_MARKER).is_file() and (folder / WEIGHTS).is_file()


def load(folder: str | Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """(model, tokenizer) with QuantLinear modules, from a checkpoint written by save().

    Float tensors are cast to `dtype` for compute (float32 on CPU, where bf16 matmuls are slow).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

    folder = Path(folder)
    if not is_checkpoint(folder):
        raise FileNotFoundError(f"{folder} is not a lowbit checkpoint (needs {DONE_MARKER} and {WEIGHTS})")
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    qconfig = config.to_dict().get("quantization_config")
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # we build the runtime modules ourselves
    try:
        tensors = load_file(str(folder / WEIGHTS))
    except Exception as err:
        raise ValueError(f"{folder / WEIGHTS}: unreadable or truncated safetensors file ({err})") from err
    with no_init_weights():  # every tensor is overwritten from the file; skip random init
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)
    _install_quantized(model, tensors, qconfig, folder)
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    _load_float(model, tensors, folder)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    return model, tokenizer


def _install_quantized(model, tensors, qconfig, folder) -> None:
    prefixes = sorted(k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed"))
    if prefixes and not qconfig:
        raise ValueError(f"{folder}/config.json: quantized tensors but no quantization_config")
    for prefix in prefixes:
        module = ct.build_module(prefix, tensors, ct.args_for_module(prefix, qconfig),
                                 ct.args_for_module(prefix, qconfig, "input_activations"))
        model.set_submodule(prefix, module)
        for key in [k for k in tensors if k.startswith(prefix + ".")]:
            del tensors[key]


def _load_float(model, tensors, folder) -> None:
    result = model.load_state_dict(tensors, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False) and not isinstance(model.get_output_embeddings(), QuantLinear):
        model.tie_weights()
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    missing = [k for k in result.missing_keys
               if k.rpartition(".")[0] not in quantized and not _tied(model, k)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{folder / WEIGHTS}: tensors do not match the model in config.json; "
            f"missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )


def _tied(model, key: str) -> bool:
    """A key absent from the file because it is tied to one that was loaded (lm_head.weight)."""
    if key != "lm_head.weight" or not getattr(model.config, "tie_word_embeddings", False):
        return False
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight
