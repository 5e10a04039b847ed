"""A checkpoint's tensors by name, shape and dtype, without loading them: from the safetensors
headers of a folder, or over tensors already in memory. Checks that compare config.json with the
tensors (formats' config_problems) read shapes here and the few small values they need; a reader
that builds modules from config.json reports a disagreement instead of the error it causes."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from lowbit.calibrate.checks import read_index

from .hf_folder import INDEX, WEIGHTS

# torch dtypes under their safetensors names, so both tables answer dtype() the same way
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}


class TensorTable:
    """Tensors held in memory (a loader's dict), answered as FolderTensors answers."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> str:
        return SAFETENSORS_DTYPES.get(self.tensors[name].dtype, str(self.tensors[name].dtype))

    def value(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class FolderTensors(TensorTable):
    """The tensors of a folder's model.safetensors (or of every shard its index lists), from the
    headers; value() reads one tensor."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        index = folder / INDEX
        files = sorted(set(read_index(folder, INDEX).values())) if index.is_file() else [WEIGHTS]
        self.file_of: dict[str, Path] = {}
        self.slices: dict[str, tuple[tuple[int, ...], str]] = {}
        for file in files:
            path = folder / file
            if not path.is_file():
                listed = f" (listed in {index})" if index.is_file() else ""
                raise FileNotFoundError(f"{path}: weight file missing{listed}")
            try:
                with safe_open(str(path), "pt") as f:
                    for key in f.keys():
                        part = f.get_slice(key)
                        self.file_of[key], self.slices[key] = path, (tuple(part.get_shape()), part.get_dtype())
            except Exception as err:  # safetensors raises its own error types on a damaged header
                raise ValueError(f"{path}: unreadable safetensors header ({err})") from None

    def names(self) -> list[str]:
        return sorted(self.slices)

    def __contains__(self, name: str) -> bool:
        return name in self.slices

    def shape(self, name: str) -> tuple[int, ...]:
        return self.slices[name][0]

    def dtype(self, name: str) -> str:
        return self.slices[name][1]

    def value(self, name: str) -> torch.Tensor:
        with safe_open(str(self.file_of[name]), "pt") as f:
            return f.get_tensor(name)


def build_or_explain(build, disagreements, where: str):
    """build(), or, where it raises and config.json disagrees with the module's tensors
    (disagreements(): asked only then, a reader's load pays nothing for it), one line saying how
    (the tensor and the config key) instead of the error the disagreement caused."""
    try:
        return build()
    except (ValueError, RuntimeError, KeyError, AttributeError, TypeError, IndexError):
        found = disagreements()
        if found:
            raise ValueError(f"{where}: {found[0]}") from None
        raise
