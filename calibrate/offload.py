"""Where a layer walk keeps the activations between decoder layers: `calibration.offload`.

A walk holds every calibration sample's hidden states twice while a layer runs (its inputs and its
outputs): 2·S·L·d·4 bytes in float32, 4.3 GB for a 70B model (d 8192) on 128 × 512 tokens and 17 GB
on 128 × 2048. Where they wait between forwards:
  device  on the calibration device (a GPU's memory, or the CPU's when calibrating on the CPU);
  cpu     in CPU memory, each micro-batch moved to the device for its forward;
  disk    in files, one safetensors file per micro-batch, read back when a forward needs it: memory
          holds the micro-batch at work, its outputs being written, and the page cache the kernel
          may drop;
  auto    device when both copies fit in half of the device's free memory, else cpu when they fit
          in half of the free CPU memory, else disk.
The figures a walk computes are the same wherever the activations wait (tests/test_offload.py).
"""
from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors.torch import load_file, save_file

from .hardware import available_memory_bytes

OFFLOADS = ("auto", "device", "cpu", "disk")
FIT_SHARE = 0.5  # auto keeps the activations where both copies take at most this share of the free memory


class DiskTensors(Sequence):
    """A list of tensors kept in files, one per item, each read back when it is indexed. The folder
    is removed once the list is garbage (or at exit), so an abandoned walk leaves no files behind."""

    def __init__(self, parent: Optional[Path] = None):
        if parent is not None:
            Path(parent).mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix="activations-", dir=parent))
        self._count = 0
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.folder), True)

    def append(self, tensor: torch.Tensor) -> None:
        save_file({"t": tensor.detach().to("cpu").contiguous()}, str(self._path(self._count)))
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Union[int, slice]):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(f"activation {index} of {self._count}")
        return load_file(str(self._path(index)))["t"]

    def _path(self, index: int) -> Path:
        return self.folder / f"{index}.safetensors"


@dataclass(frozen=True)
class Offload:
    """A resolved choice: where (device, cpu or disk) and, for disk, under which folder."""

    where: str = "device"
    folder: Optional[Path] = None  # disk: the files go in a fresh folder under it (default: the temp folder)

    def __post_init__(self):
        if self.where not in OFFLOADS[1:]:
            raise ValueError(f"offload must be one of {OFFLOADS[1:]} once resolved, got {self.where!r}")

    def new(self) -> Union[list, DiskTensors]:
        """An empty container for one layer's activations."""
        return DiskTensors(self.folder) if self.where == "disk" else []

    def home(self, device) -> torch.device:
        """Where a tensor goes before it is put in the container, for a walk on `device`."""
        return torch.device(device) if self.where == "device" else torch.device("cpu")

    def keep(self, tensors, device) -> Union[list, DiskTensors]:
        """`tensors` (a list of micro-batches) in a container of this kind, for a walk on `device`."""
        kept = self.new()
        for tensor in tensors:
            kept.append(tensor.to(self.home(device)))
        return kept


def resolve_offload(name: str, device, activation_bytes: int, folder: Optional[Path] = None,
                    key: str = "calibration.offload") -> Offload:
    """The Offload `name` stands for: auto picks by the free memory of the device and of the CPU."""
    if name not in OFFLOADS:
        raise ValueError(f"{key} must be one of {', '.join(OFFLOADS)}, got {name!r}")
    if name != "auto":
        return Offload(name, folder)
    device = torch.device(device)
    need = 2 * activation_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need <= FIT_SHARE * free:
            return Offload("device", folder)
    cpu_free = available_memory_bytes()
    if cpu_free is None or need <= FIT_SHARE * cpu_free:
        return Offload("device" if device.type == "cpu" else "cpu", folder)
    return Offload("disk", folder)
