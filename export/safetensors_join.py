"""Join safetensors files into one, byte for byte the file safetensors' save_file writes for the
union of their tensors, without holding the tensors: each tensor's bytes are copied from its part
file in chunks. A streamed export writes each decoder layer's tensors to a part file as the layer
is finished and joins them at the end, so its model.safetensors is the resident export's.

The layout is safetensors' own: the order of tensors in the header and in the data (by dtype,
then by name) is read from a file safetensors writes with one-element stand-ins of the same names
and dtypes; only the shapes and offsets are filled in here. Memory: the headers and one chunk.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from .files import current_umask, out_of_space_names

CHUNK = 64 << 20  # bytes copied at a time
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_header(path: Path) -> tuple[int, dict]:
    """(where the data starts, the header mapping) of a safetensors file."""
    with open(path, "rb") as f:
        size = f.read(8)
        if len(size) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", size)
        try:
            return 8 + length, json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: unreadable safetensors header ({err})") from None


def write_part(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    """A safetensors file of `tensors` in their own order, each written from its memory as it is
    (save_file first copies every tensor to bytes: twice the memory of the largest)."""
    names = {v: k for k, v in _DTYPES.items()}
    header, offset = ({"__metadata__": dict(metadata)} if metadata else {}), 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with out_of_space_names(path), open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for tensor in tensors.values():
            flat = tensor.detach().cpu().contiguous().reshape(-1)  # a view where it already is
            if flat.numel():
                f.write(memoryview(flat.view(torch.uint8).numpy()))


def join_safetensors(parts: list[Path], out: Path, metadata: dict | None = None) -> None:
    """Write `out` from the tensors of `parts` (each name in exactly one part)."""
    sources: dict[str, tuple[Path, int, dict]] = {}  # name -> (part, data start, entry)
    for part in parts:
        start, header = read_header(part)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if name in sources:
                raise ValueError(f"tensor {name!r} is in both {sources[name][0]} and {part}")
            sources[name] = (part, start, entry)
    header = _layout({n: e for n, (_, _, e) in sources.items()}, metadata)
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)
    with out_of_space_names(out), open(out, "wb") as dst:
        dst.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, entry in header.items():
            if name != "__metadata__":
                part, start, old = sources[name]
                _copy(part, start + old["data_offsets"][0], old["data_offsets"][1] - old["data_offsets"][0], dst)
    os.chmod(out, 0o666 & ~current_umask())


def _layout(entries: dict[str, dict], metadata: dict | None) -> dict:
    """The header save_file would write for tensors of these dtypes and shapes, in its order."""
    standins = {name: torch.zeros(1, dtype=_dtype(e["dtype"], name)) for name, e in entries.items()}
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "order.safetensors"
        save_file(standins, str(probe), metadata=metadata)
        _, order = read_header(probe)
    header, offset = {}, 0
    for name, entry in order.items():
        if name == "__metadata__":
            header[name] = entry
            continue
        real = entries[name]
        size = real["data_offsets"][1] - real["data_offsets"][0]
        header[name] = {"dtype": real["dtype"], "shape": real["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    return header


def _dtype(name: str, tensor: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"tensor {tensor!r} has dtype {name}, which joining does not handle "
                         f"(handled: {', '.join(_DTYPES)})")
    return _DTYPES[name]


def _copy(path: Path, offset: int, size: int, dst) -> None:
    with open(path, "rb") as src:
        src.seek(offset)
        while size:
            chunk = src.read(min(CHUNK, size))
            if not chunk:
                raise ValueError(f"{path}: truncated (a tensor's bytes end early)")
            dst.write(chunk)
            size -= len(chunk)
