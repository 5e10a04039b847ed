"""The pieces every safetensors format shares: a transformers checkpoint folder (config.json,
model.safetensors, tokenizer, generation config) and the float tensors beside quantized layers."""
from __future__ import annotations

import json
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from lowbit.calibrate.checks import read_index
from lowbit.calibrate.experts import fuse_float_experts, stored_name, unfuse_experts
from lowbit.calibrate.model_config import check_model_source, code_modules
from lowbit.calibrate.models import resolve_model_path
from lowbit.export import kv_scales
from lowbit.export.files import save_tensors
from lowbit.quantize.runtime.modules import is_quantized_linear

# a streamed export collects each pass's tensors instead of writing them (export/portions.py)
_weights_sink: ContextVar[Optional[Callable]] = ContextVar("lowbit_weights_sink", default=None)
# its last pass wants everything but the tensors: packing every module on the meta device took
# 3.3 of a 6.9 s export of smollm2-135m
_tensors_wanted: ContextVar[bool] = ContextVar("lowbit_tensors_wanted", default=True)
# native_modules' skeleton per model (a streamed export asks once per portion: 34 builds, 1.5 s)
_skeletons: "weakref.WeakKeyDictionary[nn.Module, tuple[str, nn.Module]]" = weakref.WeakKeyDictionary()

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if is_quantized_linear(m)}


def quant_method(config: dict) -> str | None:
    return (config.get("quantization_config") or {}).get("quant_method")


def checkpoint_tensors(model: nn.Module, quantized: dict, dtype: torch.dtype, module_tensors) -> dict:
    """The float tensors, then each quantized module's as the format's module_tensors writes them
    (none inside weights_to(..., tensors=False))."""
    if not _tensors_wanted.get():
        return {}
    tensors = float_tensors(model, quantized, dtype)
    for name, module in quantized.items():
        tensors.update(module_tensors(name, module, dtype))
    return tensors


def float_tensors(model: nn.Module, quantized: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor except those of quantized modules (floats cast to dtype), shared (tied) storage
    written once."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        if name.rsplit(".", 1)[0] in quantized:
            continue
        ptr = tensor.data_ptr()
        if ptr in seen:
            continue  # tied to a tensor already written (lm_head <- embed_tokens)
        seen.add(ptr)
        tensor = tensor.detach().contiguous()
        out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out


def native_modules(model: nn.Module, names) -> dict[str, nn.Module]:
    """The modules the architecture itself builds at `names` (before lowbit replaced them), from a
    skeleton on the meta device: no memory."""
    config = model.config.to_json_string()
    cached = _skeletons.get(model)
    if cached is None or cached[0] != config:
        with torch.device("meta"):
            skeleton = type(model)(model.config)
            unfuse_experts(skeleton)
            cached = _skeletons[model] = (config, skeleton)
    return {n: cached[1].get_submodule(n) for n in names}


def float_linears(model: nn.Module, quantized: dict) -> list[str]:
    """Names for a config's ignore list: linears that stay float (ignored or not targeted)."""
    from lowbit.calibrate.arch import is_linear

    model_type = getattr(model.config, "model_type", None)
    return [stored_name(model_type, n) for n, m in model.named_modules() if is_linear(m) and n not in quantized]


def base_config(model: nn.Module, dtype: str) -> dict:
    """config.json as transformers writes it, with what a lowbit export changes in it."""
    config = model.config.to_dict()
    config["dtype"] = dtype
    config.pop("_name_or_path", None)  # where the source sat on this machine: not part of the checkpoint
    config.pop("quantization_config", None)
    if is_quantized_linear(model.get_output_embeddings()):
        config["tie_word_embeddings"] = False  # a quantized head no longer shares the float embedding
    return config


def write_quantized(folder: Path, model, tokenizer, tensors: dict, qconfig: dict | None, dtype: str,
                    extra_files: dict[str, str]) -> None:
    """A quantized format's folder: its quantization_config and the KV-cache scales and scheme."""
    config = base_config(model, dtype)
    if qconfig is not None:
        config["quantization_config"] = qconfig
    kv = kv_scales.kv_config(model)
    if kv is not None:
        tensors.update(kv_scales.scale_tensors(model, torch.float32))
        kv_scales.add_to_config(config, kv)
    write_folder(folder, model, tokenizer, tensors, config, extra_files)


@contextmanager
def weights_to(sink: Callable[[dict, Path, dict], None], tensors: bool = True):
    """Inside the block, write_folder hands sink(tensors, path, metadata) the weights instead of
    writing model.safetensors; with tensors=False the formats make none (sink gets {})."""
    token, wanted = _weights_sink.set(sink), _tensors_wanted.set(tensors)
    try:
        yield
    finally:
        _tensors_wanted.reset(wanted)
        _weights_sink.reset(token)


def write_folder(folder: Path, model, tokenizer, tensors: dict, config: dict, extra_files: dict[str, str]) -> None:
    sink, metadata = _weights_sink.get(), {"format": "pt"}
    model_type = getattr(model.config, "model_type", None)
    tensors = fuse_float_experts(model, tensors, quant_method(config))  # gpt-oss, Llama 4: as their hub stores them
    tensors = {stored_name(model_type, k): t for k, t in tensors.items()}  # the hub's per-expert names
    if sink is not None:
        sink(tensors, folder / WEIGHTS, metadata)
    else:
        save_tensors(tensors, folder / WEIGHTS, metadata=metadata)
    write_folder_files(folder, model, tokenizer, config, extra_files)


def write_folder_files(folder: Path, model, tokenizer, config: dict, extra_files: dict[str, str]) -> None:
    """Everything of a checkpoint folder but the weights: tokenizer, generation config, extra files, config.json."""
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    for name, text in extra_files.items():
        (folder / name).write_text(text, encoding="utf-8")
    if "auto_map" in config and not any(name.endswith(".py") for name in extra_files):
        # the model ran as transformers' own class (its code was not allowed to run, so none is
        # carried): an auto_map naming absent files would break a trust_remote_code load
        config = {k: v for k, v in config.items() if k != "auto_map"}
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


def model_code(model: str | Path, trust_remote_code: bool) -> dict[str, str]:
    """The model's own code (file name -> text) for a checkpoint to carry, so that it reloads as the
    model did: the modules config.json's auto_map names and the .py files they import from its
    folder. {} when loading the model runs no code of its own (or none was allowed to run)."""
    if not trust_remote_code:
        return {}
    folder = Path(resolve_model_path(str(model)))
    return {name: (folder / name).read_text(encoding="utf-8") for name in check_model_source(str(folder), True)}


def code_card_rows(config: dict, carried: bool) -> list[str]:
    """The model card's row for a checkpoint that carries the model's own code (`carried`: the run
    was allowed to run it, so the export copied it)."""
    modules = code_modules(config, "config.json") if carried else []
    if not modules:
        return []
    files = ", ".join(f"`{m}.py`" for m in modules)
    return [f"| Model code | its own, carried beside config.json: {files} and the files they import; loading "
            "it runs that code (`trust_remote_code=True`): review it first |"]


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of every shard its index lists (plain file names in
    `folder`, checked before any is opened)."""
    index = folder / INDEX
    files = sorted(set(read_index(folder, INDEX).values())) if index.is_file() else [WEIGHTS]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: weight file missing" + (f" (listed in {index})" if index.is_file() else ""))
        try:
            tensors.update(load_file(str(path)))
        except Exception as err:
            raise ValueError(f"{path}: unreadable or truncated safetensors file ({err})") from err
    return tensors


def safetensors_bytes(folder: str | Path) -> int:
    """Bytes of every tensor in a folder's safetensors files, read from their headers."""
    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                total += numel * _dtype_bytes(t.get_dtype())
    return total


def _dtype_bytes(dtype: str) -> int:
    return {"F64": 8, "F32": 4, "I32": 4, "U32": 4, "I64": 8, "BF16": 2, "F16": 2, "I16": 2,
            "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}[dtype]
