"""model.gguf written a portion of the model at a time (export/portions.py): each portion's tensors
go to a part file as they are made, and the last pass writes the file from the parts, one tensor's
data in memory at a time. Each tensor keeps the place the whole model's file gives it (Positions),
so the file is byte for byte the one written from the whole model at once."""
from __future__ import annotations

import json
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Iterable, NamedTuple, Optional, Sequence

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from lowbit.export.safetensors_join import write_part

_KEY = "lowbit_gguf"  # the part file's metadata: name -> [GGML type, weights, place in the file]


class Positions:
    """Where each tensor goes in the file: float tensors by their state_dict index, then each
    quantized layer's weight and bias by the layer's module index, then stacked experts after the
    first tensor they hold. Taken from the whole model (export/portions.py: before any portion)."""

    def __init__(self, tensors: dict[str, int], modules: dict[str, int]):
        self.tensors, self.modules = tensors, modules

    @classmethod
    def of(cls, model: nn.Module) -> "Positions":
        return cls({name: i for i, name in enumerate(model.state_dict(keep_vars=True))},
                   {name: i for i, (name, _) in enumerate(model.named_modules())})

    def tensor(self, name: str) -> tuple:
        return (0, self.tensors[name])

    def module(self, name: str, which: int) -> tuple:
        return (1, self.modules[name], which)

    @staticmethod
    def stacked(first: tuple) -> tuple:
        return (2, *first)


class StoredTensor(NamedTuple):
    """A tensor of a part file, read when the file's data is written."""

    name: str
    shape: Sequence[int]
    dtype: np.dtype
    nbytes: int
    ggml_type: object  # gguf.GGMLQuantizationType
    numel: int
    order: tuple
    part: Path

    def array(self) -> np.ndarray:
        with safe_open(self.part, "pt") as f:
            return f.get_tensor(self.name).numpy()


class GGUFParts:
    """The part files of one export: `collect(path)` makes write_gguf hand a portion's tensors to
    `path`; outside it, write_gguf writes the file from every part (stored())."""

    def __init__(self, positions: Positions):
        self.positions, self.parts, self.written = positions, [], set()
        self._path: Optional[Path] = None

    @property
    def collecting(self) -> bool:
        return self._path is not None

    @contextmanager
    def collect(self, path: Path):
        self._path = path
        try:
            yield
        finally:
            self._path = None

    def add(self, tensors: Iterable) -> None:
        """A portion's tensors, those no earlier portion holds (a tied head is the embedding)."""
        fresh = [t for t in tensors if t.name not in self.written]
        self.written.update(t.name for t in fresh)
        meta = {t.name: [int(t.ggml_type), t.numel, list(t.order)] for t in fresh}
        write_part({t.name: torch.from_numpy(np.ascontiguousarray(t.data)) for t in fresh}, self._path,
                   {_KEY: json.dumps(meta)})
        self.parts.append(self._path)

    def stored(self) -> list[StoredTensor]:
        import gguf

        out = []
        for part in self.parts:
            with safe_open(part, "pt") as f:
                meta = json.loads(f.metadata()[_KEY])
                for name, (ggml_type, numel, order) in meta.items():
                    sl = f.get_slice(name)
                    dtype = np.dtype(str(_NUMPY[sl.get_dtype()]))
                    shape = tuple(sl.get_shape())
                    out.append(StoredTensor(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize,
                                            gguf.GGMLQuantizationType(ggml_type), numel, tuple(order), part))
        return out


_NUMPY = {"F32": "float32", "F16": "float16", "U8": "uint8"}

# set by export/portions.py around its portions and its last pass
gguf_parts: ContextVar[Optional[GGUFParts]] = ContextVar("lowbit_gguf_parts", default=None)


@contextmanager
def gguf_parts_in(parts: GGUFParts):
    token = gguf_parts.set(parts)
    try:
        yield parts
    finally:
        gguf_parts.reset(token)
