"""Checks on a model before any work: its folder's files are whole, its weights are finite (and
small enough to square in float32).

Both fail in seconds with the file or parameter named, instead of deep inside transformers or
after an hour of calibration.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .messages import shown_name

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
            raise FileNotFoundError(f"model folder {shown_name(str(folder))} does not exist (or is not a folder)")
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
    names = sorted(set(read_index(folder).values()))
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder / missing[0]}: weight shard missing (listed in {index})")
    return [folder / n for n in names]


def read_index(folder: Path, index_name: str = SAFE_INDEX) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file), every shard a plain file name in `folder`:
    checked before any shard is opened, so an entry such as `/etc/passwd` or `../x.safetensors`
    never makes lowbit read (or a later copy write) outside the model folder."""
    index = Path(folder) / index_name
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{index}: not a valid safetensors index ({type(err).__name__}: {err})") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map is a {type(weight_map).__name__}; expected a mapping of "
                         "tensor names to shard file names")
    for tensor, shard in weight_map.items():
        if not _plain_file_name(shard):
            raise ValueError(f"{index}: weight_map[{tensor!r}] is {str(shard)[:200]!r}; a shard must be a plain "
                             f"file name in {folder} (no folder part, no '..', not absolute)")
    return weight_map


def _plain_file_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and Path(name).name == name)


def check_tensors_match(where, missing, unexpected, mismatched=(), advice: str = "") -> None:
    """Refuse weights that do not match the model config.json describes, in one line: transformers
    would give a missing or wrongly shaped tensor random values and carry on, and every figure
    after that (quantized, audited, published) would be of an invented model.
    `mismatched`: (name, stored shape, expected shape) triples; `advice` replaces the default advice."""
    if not (missing or unexpected or mismatched):
        return
    parts = []
    if missing:
        parts.append(f"missing: {_some(sorted(missing))}")
    if unexpected:
        parts.append(f"unexpected: {_some(sorted(unexpected))}")
    if mismatched:
        shapes = [f"{name} {list(stored)} (expected {list(expected)})" for name, stored, expected in sorted(mismatched)]
        parts.append(f"another shape: {_some(shapes)}")
    head = " (no LM head: a headless base model?)" if "lm_head.weight" in set(missing) else ""
    raise ValueError(f"{where}: its weights do not match the model its config.json describes; {'; '.join(parts)}"
                     f"{head}; lowbit never fills in weights with random values: "
                     f"{advice or 're-download or re-save the model, or fix its config.json'}")


def _some(names: list[str], shown: int = 3) -> str:
    """A few names and the count: a message stays one readable line for a 70B model too."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{len(names)} tensors, e.g. {', '.join(names[:shown])}, …"


def _check_safetensors(path: Path) -> None:
    """Opening reads the header and checks it covers the file exactly: catches truncation."""
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as err:  # safetensors raises its own error type for every header problem
        raise ValueError(f"{path}: truncated or corrupt safetensors file ({err}); "
                         "re-download or re-save the model") from None


SQUARABLE = torch.finfo(torch.float32).max ** 0.5  # 1.8e19: a larger value's square is inf in float32


def check_finite_weights(model: nn.Module) -> None:
    """Refuse a model with NaN or inf in any parameter: every scale computed from it would be too;
    or with a value whose square overflows float32: a norm's mean square, GPTQ's Hessian XᵀX of the
    inputs it feeds, are inf then (GPTQ said only "not positive definite", after calibrating).

    Buffers are not checked: some models keep -inf attention masks there on purpose.
    """
    for name, tensor in model.named_parameters():
        if tensor.is_meta or _within_square_range(tensor.detach()):  # meta: not read yet (deferred experts)
            continue
        nans = int(torch.isnan(tensor).sum())
        infs = int(torch.isinf(tensor).sum())
        if nans or infs:
            raise ValueError(
                f"model weight {name} has {nans} NaN and {infs} inf value(s); "
                "lowbit will not quantize non-finite weights (the checkpoint is corrupt or diverged)"
            )
        values = tensor.detach()
        index = tuple(int(i) for i in (values.abs() > SQUARABLE).nonzero()[0])
        raise ValueError(f"model weight {name} holds {float(values[index]):g} at {list(index)}; past {SQUARABLE:.2g} "
                         "a value's square overflows float32 (a norm's mean square, GPTQ's Hessian of the inputs "
                         "it feeds): the checkpoint is corrupt or diverged; fix or re-download it")


def _within_square_range(tensor: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """Every value finite and at most SQUARABLE in magnitude: a chunk's min and max (NaN propagates
    into both; no copy of the tensor; ~8x faster than float64 sums)."""
    for part in tensor.reshape(-1).split(chunk):
        low, high = torch.aminmax(part)
        if not (-SQUARABLE <= float(low) and float(high) <= SQUARABLE):  # NaN compares False
            return False
    return True


def largest_value(module: nn.Module) -> tuple[str, float]:
    """(name, value) of the module's parameter value largest in magnitude: what a message about
    inputs too large to square points at."""
    found = [("", 0.0)]
    for name, tensor in module.named_parameters():
        if not tensor.is_meta and tensor.numel():
            flat = tensor.detach().reshape(-1)
            found.append((name, float(flat[int(flat.abs().argmax())])))
    return max(found, key=lambda item: abs(item[1]))
