"""Reading model.gguf back into Hugging Face names with the `gguf` package's GGUFReader (a memory
map of the file; nothing is unpickled). A block-quantized linear weight comes back as its bytes
(rows, bytes per row) uint8 with its type beside it under `<layer>.gguf_type`; read() builds a
GGUFLinear from the pair. Float tensors (and a quantized token embedding, which is no linear)
come back as float tensors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from .names import TensorNames, arch_of, inverse, qk_row_order

TYPE_SUFFIX = ".gguf_type"
FLOAT_TYPES = ("F32", "F16", "BF16")


def read_gguf_tensors(path: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    import gguf

    where = str(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: GGUF file missing")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # the package raises ValueError/struct errors on a bad or cut file
        raise ValueError(f"{path}: unreadable or truncated GGUF file ({err})") from err
    arch = arch_of(model.config, where)
    to_hf = _hf_names(model, TensorNames(arch, model.config.num_hidden_layers))
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name not in to_hf:
            raise ValueError(f"{path}: tensor {t.name} matches no tensor of the {arch.name} model in config.json")
        hf_name = to_hf[t.name]
        order = qk_row_order(model.config, hf_name, arch)
        undo = None if order is None else inverse(order)
        if t.tensor_type.name in FLOAT_TYPES or hf_name not in linears:
            value = _float(t, gguf)
            tensors[hf_name] = value if undo is None else value[undo]
        else:
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))
            tensors[hf_name] = raw if undo is None else raw[undo]
            tensors[hf_name.removesuffix(".weight") + TYPE_SUFFIX] = torch.tensor(int(t.tensor_type))
    return tensors


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor in the file, as stored (blocks, scales, float tensors)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def _float(t, gguf) -> torch.Tensor:
    """The tensor's values, float32 (a quantized one dequantized by the gguf package)."""
    name = t.tensor_type.name
    if name == "BF16":
        raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))
        return raw.view(torch.bfloat16).float()
    if name in ("F32", "F16"):
        return torch.from_numpy(np.array(t.data, dtype=np.float32))
    return torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type).astype(np.float32))


def _hf_names(model: nn.Module, names: TensorNames) -> dict[str, str]:
    out = {}
    for hf_name in model.state_dict():
        gguf_name = names.gguf_name(hf_name)
        if gguf_name is not None:
            out.setdefault(gguf_name, hf_name)
    return out
