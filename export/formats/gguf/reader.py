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

from .names import TensorNames, arch_of, inverse, is_router, qk_row_order, stacked_name
from .rope import ROPE_FREQS

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
    names = TensorNames(arch, model.config.num_hidden_layers)
    state = model.state_dict()
    to_hf, to_experts = _hf_names(state, names), _expert_names(state, names)
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # lowbit's model computes it from config.json
            continue
        if t.name in to_experts:
            tensors.update(_split_experts(t, to_experts[t.name], path, gguf))
            continue
        if t.name not in to_hf:
            raise ValueError(f"{path}: tensor {t.name} matches no tensor of the {arch.name} model in config.json")
        hf_name = to_hf[t.name]
        order = qk_row_order(model.config, hf_name, arch)
        undo = None if order is None else inverse(order)
        if t.tensor_type.name in FLOAT_TYPES or hf_name not in linears:
            value = _float(t, gguf)
            if is_router(t.name):  # a shared expert's gate is 1-D in the file, [1, hidden] in the model
                value = value.reshape(state[hf_name].shape)
            tensors[hf_name] = value if undo is None else value[undo]
        else:
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))
            tensors[hf_name] = raw if undo is None else raw[undo]
            tensors[hf_name.removesuffix(".weight") + TYPE_SUFFIX] = torch.tensor(int(t.tensor_type))
    return tensors


def _split_experts(t, hf_names: list[str], path: Path, gguf) -> dict[str, torch.Tensor]:
    """A stacked experts tensor [experts, rows, ...] as each expert's linear weight (bytes and type,
    or float values) or bias."""
    floats = t.tensor_type.name in FLOAT_TYPES
    value = _float(t, gguf) if floats else torch.from_numpy(np.array(t.data, dtype=np.uint8))
    dims = 2 if hf_names[0].endswith(".bias") else 3  # gpt-oss's expert biases: [experts, rows]
    if value.dim() != dims or value.shape[0] != len(hf_names):
        raise ValueError(f"{path}: tensor {t.name} holds {tuple(value.shape)}; the model in config.json has "
                         f"{len(hf_names)} experts there")
    out = {}
    for hf_name, weight in zip(hf_names, value):
        out[hf_name] = weight.clone()
        if not floats:
            out[hf_name.removesuffix(".weight") + TYPE_SUFFIX] = torch.tensor(int(t.tensor_type))
    return out


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


def _expert_names(state: dict, names: TensorNames) -> dict[str, list[str]]:
    """A stacked experts tensor's .gguf name -> its experts' weight names in lowbit's model, by index."""
    by_stack: dict[str, dict[int, str]] = {}
    for hf_name in state:
        stacked = stacked_name(hf_name)
        if stacked is not None:
            by_stack.setdefault(stacked[0], {})[stacked[1]] = hf_name
    out = {}
    for stack, by_index in by_stack.items():
        gguf_name = names.gguf_name(stack)
        if gguf_name is not None:
            out[gguf_name] = [by_index[e] for e in sorted(by_index)]
    return out


def _hf_names(state: dict, names: TensorNames) -> dict[str, str]:
    out = {}
    for hf_name in state:
        gguf_name = names.gguf_name(hf_name)
        if gguf_name is not None:
            out.setdefault(gguf_name, hf_name)
    return out
