"""Checks on a model before any work: its folder's files are whole, its weights are finite.

Both fail in seconds with the file or parameter named, instead of deep inside transformers or
after an hour of calibration.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

SAFE_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def looks_like_local_path(name: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else with a path shape must be a local folder."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def check_model_folder(name: str, allow_pickle: bool = False) -> None:
    """A local model folder has config.json and whole weight files (safetensors unless allowed)."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        if looks_like_local_path(name) or folder.exists():
            raise FileNotFoundError(f"model folder {folder} does not exist (or is not a folder)")
        return  # a hub id: transformers fetches it (use_safetensors refuses pickle there)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder / 'config.json'}: missing; a model folder needs its config.json")
    shards = safetensors_files(folder)
    if shards:
        for path in shards:
            _check_safetensors(path)
        return
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if allow_pickle and any(p.endswith(".bin") for p in pickles):
        return  # loaded through torch.load(weights_only=True): tensors only, no code
    found = f" (found pickle-based {', '.join(pickles)})" if pickles else ""
    hint = ("pass --allow-pickle (recipe key allow_pickle: true) to load *.bin weights with "
            "torch.load(weights_only=True), or convert them to safetensors") if pickles else \
        "expected model.safetensors (or shards with model.safetensors.index.json)"
    raise FileNotFoundError(f"{folder}: no *.safetensors weights{found}; lowbit loads safetensors only "
                            f"and never unpickles weights unless asked; {hint}")


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's safetensors weight files: the shards its index lists (each checked to exist),
    else every *.safetensors file."""
    index = folder / SAFE_INDEX
    if not index.is_file():
        return sorted(folder.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index}: not a valid safetensors index ({err})") from None
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder / missing[0]}: weight shard missing (listed in {index})")
    return [folder / n for n in names]


def _check_safetensors(path: Path) -> None:
    """Opening reads the header and checks it covers the file exactly: catches truncation."""
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as err:  # safetensors raises its own error type for every header problem
        raise ValueError(f"{path}: truncated or corrupt safetensors file ({err}); "
                         "re-download or re-save the model") from None


def check_finite_weights(model: nn.Module) -> None:
    """Refuse a model with NaN or inf in any parameter: every scale computed from it would be too.

    Buffers are not checked: some models keep -inf attention masks there on purpose.
    """
    for name, tensor in model.named_parameters():
        if _sums_are_finite(tensor.detach()):
            continue
        nans = int(torch.isnan(tensor).sum())
        infs = int(torch.isinf(tensor).sum())
        raise ValueError(
            f"model weight {name} has {nans} NaN and {infs} inf value(s); "
            "lowbit will not quantize non-finite weights (the checkpoint is corrupt or diverged)"
        )


def _sums_are_finite(tensor: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """float64 sums (NaN/inf propagate, nothing overflows; ~10x cheaper than a mask), a chunk at a
    time: a whole-tensor sum(dtype=float64) widens all of it first (a Llama-3-8B down_proj: 0.47 GB)."""
    return all(bool(torch.isfinite(part.sum(dtype=torch.float64))) for part in tensor.reshape(-1).split(chunk))
