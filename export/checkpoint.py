"""Write a quantized model as a checkpoint, atomically, and read it back into runtime modules."""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import torch
from torch import nn

from . import compressed_tensors as ct
from . import gptq_format, kv_scales
from .config import ExportConfig
from .files import out_of_space_names, save_tensors
from .manifest import MANIFEST, write_manifest
from .reader import load, read_tensors  # noqa: F401  (re-exported: checkpoint.load)

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
GPTQ_CONFIG = "quantize_config.json"


def save(model: nn.Module, tokenizer, out_dir: str | Path, cfg: ExportConfig,
         extra_files: dict[str, str] | None = None) -> Path:
    """Write the checkpoint into a staging folder beside out_dir, then rename it into place.

    The manifest is written last into the staging folder, so a folder at out_dir is always
    whole; a crash leaves at most a hidden `.NAME.partial-*` folder.
    """
    out_dir = Path(out_dir)
    for name in extra_files or {}:
        check_plain_name(name, "extra file name")
    check_output_dir(out_dir, cfg.overwrite)
    staging = out_dir.with_name(f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        with out_of_space_names(out_dir, "cannot write the checkpoint"):
            _write(model, tokenizer, staging, cfg, extra_files or {})
            write_manifest(staging)
        publish(staging, out_dir)
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
    make_parent(out_dir)


def make_parent(out_dir: Path) -> None:
    """Create the folder that will hold out_dir, or say clearly why it cannot be."""
    parent = out_dir.parent if out_dir.parent != Path("") else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file where a folder should be, a read-only or full disk
        raise type(err)(err.errno, f"cannot create the folder {parent} for output {out_dir} "
                        f"({err.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"cannot write into {parent} (for output {out_dir})")


def check_plain_name(name: str, what: str) -> None:
    """A name used as one file or folder name: it may not climb out of (or hide in) its folder."""
    rules = [
        (lambda n: isinstance(n, str) and n, "must be a non-empty string"),
        (lambda n: "/" not in n and "\\" not in n, "may not contain / or \\"),
        (lambda n: not n.startswith("."), "may not start with '.' (., .., hidden and staging names)"),
        (lambda n: all(ord(c) >= 32 for c in n), "may not contain control characters"),
        (lambda n: len(n.encode()) <= 200, "may not be longer than 200 bytes"),
    ]
    for ok, problem in rules:
        if not ok(name):
            raise ValueError(f"{what} {name!r} {problem}: it becomes a file or folder name")


def _write(model, tokenizer, folder: Path, cfg: ExportConfig, extra_files) -> None:
    quantized = {n: m for n, m in model.named_modules() if ct.is_quantized(m)}
    dtype = getattr(torch, cfg.dtype)
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in _float_tensors(model, quantized).items()}
    fmt = ct if cfg.format == "compressed-tensors" else gptq_format
    if fmt is gptq_format:
        gptq_format.check_modules(quantized)
    if fmt is ct:
        ct.check_consumers_can_load(model, quantized)
    for name, module in quantized.items():
        tensors.update(fmt.module_tensors(name, module, dtype))
    qconfig = fmt.quantization_config(quantized, _float_linears(model, quantized))
    kv = kv_scales.kv_config(model)
    if kv is not None:
        tensors.update(kv_scales.scale_tensors(model, torch.float32))
    save_tensors(tensors, folder / WEIGHTS, metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    if cfg.format == "gptq":
        extra_files = {**extra_files, GPTQ_CONFIG: json.dumps(qconfig, indent=2)}
    for name, text in extra_files.items():
        (folder / name).write_text(text, encoding="utf-8")
    config = model.config.to_dict()
    config["dtype"] = cfg.dtype
    config.pop("_name_or_path", None)  # where the source sat on this machine: not part of the checkpoint
    config.pop("quantization_config", None)
    if ct.is_quantized(model.get_output_embeddings()):
        config["tie_word_embeddings"] = False  # a quantized head no longer shares the float embedding
    if quantized:
        config["quantization_config"] = qconfig
    if kv is not None:
        kv_scales.add_to_config(config, kv)
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


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


def publish(staging: Path, out_dir: Path) -> None:
    """Rename a finished folder to out_dir; a folder already there is replaced (moved aside first)."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    old = out_dir.with_name(f".{out_dir.name}.old-{int(time.time())}")  # --overwrite: move it aside
    out_dir.rename(old)
    try:
        staging.rename(out_dir)
    except BaseException:
        old.rename(out_dir)  # the previous checkpoint goes back where it was
        raise
    shutil.rmtree(old, ignore_errors=True)


def is_checkpoint(folder: Path) -> bool:
    """A published lowbit export (manifest present) or any safetensors model folder."""
    folder = Path(folder)
    has_weights = (folder / WEIGHTS).is_file() or (folder / f"{WEIGHTS}.index.json").is_file()
    return (folder / CONFIG).is_file() and has_weights


def is_lowbit_export(folder: Path) -> bool:
    return is_checkpoint(folder) and (Path(folder) / MANIFEST).is_file()
