"""Writing model.gguf with the `gguf` package's GGUFWriter: metadata, tokenizer, then every tensor.

GGUFLinear modules go in as their `weight` bytes unchanged, MXFP4Linear ones as GGML MXFP4 blocks
(modules.py; llama q/k rows reordered whole);
float linears are rounded by llama.cpp's reference quantizer when the export names a `type`, else
kept in the export dtype; 1-D tensors (norms, biases) are F32, as llama.cpp keeps them.

Each tensor carries its place in the file (`order`: float tensors in the model's state_dict order,
then quantized layers in module order, then stacked experts), so a file written a portion of the
model at a time (parts.py) holds its tensors where the whole model's file does."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn

from lowbit.export.files import out_of_space_names
from lowbit.quantize.grids.gguf import GGUFScheme, fallback_type, quantize_gguf
from lowbit.quantize.grids.gguf_packing import pack

from ..hf_folder import float_tensors, quantized_modules
from .modules import ggml_tensor
from .metadata import add_hyperparameters
from .names import TensorNames, arch_of, is_router, qk_row_order, stacked_name
from .rope import ROPE_FREQS, rope_freqs
from .parts import Positions, gguf_parts
from .tokenizer import add_tokenizer

GGUF_RECIPES_HINT = ("GGUF holds GGML block grids and MXFP4: quantize with a gguf recipe (its steps write GGUFLinear "
                     "modules), or export the float model with --type")


class GGUFTensor(NamedTuple):
    name: str
    data: np.ndarray  # float32/float16 values, or the packed bytes of `ggml_type` (rows, bytes per row)
    ggml_type: object  # gguf.GGMLQuantizationType
    numel: int
    order: tuple = ()  # its place in the file (Positions)

    @property
    def shape(self) -> Sequence[int]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def array(self) -> np.ndarray:
        return self.data


def write_gguf(path: Path, model: nn.Module, tokenizer, cfg, title: str) -> None:
    """model.gguf of the model; inside export/portions.py's portions, the portion's tensors are
    collected instead (gguf_parts), and its last pass writes the file from them."""
    where = f"GGUF export of {title}"
    arch = arch_of(model.config, where)
    parts = gguf_parts.get()
    if parts is not None and parts.collecting:
        parts.add(model_tensors(model, cfg, arch, where, parts.positions))
        return
    if tokenizer is None:
        raise ValueError(f"{where}: a .gguf file carries its tokenizer; none was given")
    tensors = parts.stored() if parts is not None else list(model_tensors(model, cfg, arch, where))
    tensors += derived_tensors(model.config)
    _write_file(path, model, tokenizer, cfg, title, arch, sorted(tensors, key=lambda t: t.order))


def derived_tensors(config) -> list[GGUFTensor]:
    """Tensors llama.cpp reads that the model computes from its config (Llama 3's RoPE divisors),
    first in the file as convert_hf_to_gguf writes them."""
    freqs = rope_freqs(config)
    if freqs is None:
        return []
    return [_float_tensor(ROPE_FREQS, freqs, None, "float32")._replace(order=(-1,))]


def _write_file(path: Path, model: nn.Module, tokenizer, cfg, title: str, arch, tensors: list) -> None:
    """Header, metadata, tokenizer and tensor infos, then each tensor's data as it is read."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch.name)
    with out_of_space_names(path):
        try:
            writer.add_name(title)
            add_hyperparameters(writer, model.config, arch)
            writer.add_file_type(file_type(tensors, cfg.dtype))
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            add_tokenizer(writer, tokenizer, model.config.vocab_size, f"GGUF export of {title}")
            for t in tensors:
                writer.add_tensor_info(t.name, t.shape, t.dtype, t.nbytes, raw_dtype=t.ggml_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for t in tensors:
                writer.write_tensor_data(t.array())
        finally:
            writer.close()


def model_tensors(model: nn.Module, cfg, arch, where: str,
                  positions: Optional[Positions] = None) -> Iterator[GGUFTensor]:
    """Every tensor the file holds, by its .gguf name; a tied lm_head is not among them (llama.cpp
    reads token_embd for the output then, as convert_hf_to_gguf leaves it out). Routed experts'
    weights come out as one stacked tensor per projection and layer. positions: where each tensor
    goes in the whole model's file (default: as `model` orders them)."""
    names = TensorNames(arch, model.config.num_hidden_layers)
    positions = positions or Positions.of(model)
    experts: dict[str, dict[int, GGUFTensor]] = {}
    for t in _tensors_by_hf_name(model, cfg, arch, names, where, positions):
        stacked = stacked_name(t.name)
        if stacked is None:
            yield t._replace(name=_gguf_name(names, t.name, where))
        else:
            experts.setdefault(stacked[0], {})[stacked[1]] = t
    for hf_name, by_index in experts.items():
        yield _stacked(_gguf_name(names, hf_name, where), by_index, hf_name, where)


def _tensors_by_hf_name(model: nn.Module, cfg, arch, names: TensorNames, where: str,
                        positions: Positions) -> Iterator[GGUFTensor]:
    quantized = quantized_modules(model)
    stored = {name: ggml_tensor(module) for name, module in quantized.items()}
    for name, module in quantized.items():
        if stored[name] is None:
            raise ValueError(f"{where}: layer {name} is a {type(module).__name__}, which GGUF cannot hold. "
                             f"{GGUF_RECIPES_HINT}")
    embedding = _param_name(model, model.get_input_embeddings().weight)
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for hf_name, tensor in float_tensors(model, quantized, torch.float32).items():
        if tensor.is_meta:  # outside the portion being written (export/portions.py)
            continue
        order = qk_row_order(model.config, hf_name, arch)
        tensor = tensor if order is None else tensor[order]
        place = positions.tensor(hf_name)
        if is_router(names.gguf_name(hf_name) or ""):  # F32; a shared expert's [1, hidden] gate 1-D
            yield _float_tensor(hf_name, tensor.squeeze(0) if tensor.shape[0] == 1 else tensor, None,
                                "float32")._replace(order=place)
            continue
        wanted = cfg.embedding_type if hf_name == embedding else cfg.type if hf_name in linears else None
        yield _float_tensor(hf_name, tensor, wanted, cfg.dtype)._replace(order=place)
        if hf_name == embedding and arch.output_required and _tied(model):  # the output, as the embedding
            yield _float_tensor(_param_name(model, model.get_output_embeddings().weight, skip=embedding), tensor,
                                wanted, cfg.dtype)._replace(order=(*place, 1))
    for layer, module in quantized.items():
        order = qk_row_order(model.config, f"{layer}.weight", arch)
        raw, ggml_type = stored[layer]
        raw = raw if order is None else raw[order]
        yield GGUFTensor(f"{layer}.weight", raw.cpu().numpy(), ggml_type,
                         module.in_features * module.out_features, positions.module(layer, 0))
        if module.bias is not None:
            yield _float_tensor(f"{layer}.bias", module.bias if order is None else module.bias[order], None,
                                "float32")._replace(order=positions.module(layer, 1))


def _stacked(name: str, by_index: dict[int, GGUFTensor], hf_name: str, where: str) -> GGUFTensor:
    """One layer's experts' weights for one projection as llama.cpp's [experts, rows, cols] tensor:
    every expert must be there and share one type and shape (llama.cpp holds one type per tensor)."""
    count = max(by_index) + 1
    missing = sorted(set(range(count)) - set(by_index))
    if missing:
        raise ValueError(f"{where}: {hf_name}: experts {missing} have no weight to stack")
    tensors = [by_index[e] for e in range(count)]
    kinds = {(t.ggml_type.name, t.data.shape) for t in tensors}
    if len(kinds) > 1:
        found = ", ".join(f"expert {e}: {t.ggml_type.name} {tuple(t.data.shape)}" for e, t in enumerate(tensors))
        raise ValueError(f"{where}: {hf_name}: llama.cpp stores a layer's experts as one tensor of one type; "
                         f"give every expert of the layer the same type ({found})")
    return GGUFTensor(name, np.stack([t.data for t in tensors]), tensors[0].ggml_type, sum(t.numel for t in tensors),
                      Positions.stacked(min(t.order for t in tensors)))


def _float_tensor(name: str, tensor: torch.Tensor, wanted: Optional[str], dtype: str) -> GGUFTensor:
    """A float tensor as the file stores it: quantized to `wanted` (or llama.cpp's fallback for its
    row length), else F32 for 1-D tensors and the export dtype for the others."""
    import gguf

    tensor = tensor.detach().float().cpu()
    qtype = fallback_type(wanted, tensor.shape[-1]) if wanted and tensor.dim() == 2 else None
    if qtype is not None:
        scheme = GGUFScheme(qtype)
        return GGUFTensor(name, pack(quantize_gguf(tensor, scheme, name)).numpy(), scheme.ggml_type, tensor.numel())
    if tensor.dim() == 1 or dtype == "float32":
        return GGUFTensor(name, tensor.numpy(), gguf.GGMLQuantizationType.F32, tensor.numel())
    if dtype == "float16":
        return GGUFTensor(name, tensor.half().numpy(), gguf.GGMLQuantizationType.F16, tensor.numel())
    raw = tensor.to(torch.bfloat16).view(torch.uint8).numpy()  # torch's rounding, as every other export
    return GGUFTensor(name, raw, gguf.GGMLQuantizationType.BF16, tensor.numel())


def file_type(tensors: list, dtype: str):
    """general.file_type: the type holding most matrix weights (Q4_K with Q6_K beside it: llama.cpp's Q4_K_M)."""
    import gguf

    F = gguf.LlamaFileType
    counts = Counter()
    for t in tensors:
        if len(t.shape) >= 2:
            counts[t.ggml_type.name] += t.numel
    present = set(counts)
    if "Q4_K" in present:
        return F.MOSTLY_Q4_K_M if "Q6_K" in present else F.MOSTLY_Q4_K_S
    if "IQ4_XS" in present:  # beside IQ4_NL where rows do not split into 256, as llama.cpp falls back
        return F.MOSTLY_IQ4_XS
    top = counts.most_common(1)[0][0] if counts else {"float32": "F32", "float16": "F16"}.get(dtype, "BF16")
    return {"F32": F.ALL_F32, "F16": F.MOSTLY_F16, "BF16": F.MOSTLY_BF16, "Q8_0": F.MOSTLY_Q8_0,
            "Q4_0": F.MOSTLY_Q4_0, "Q4_1": F.MOSTLY_Q4_1, "Q5_0": F.MOSTLY_Q5_0, "Q5_1": F.MOSTLY_Q5_1,
            "Q5_K": F.MOSTLY_Q5_K_M, "Q6_K": F.MOSTLY_Q6_K, "IQ4_NL": F.MOSTLY_IQ4_NL, "MXFP4": F.MOSTLY_MXFP4_MOE}[top]


def _gguf_name(names: TensorNames, hf_name: str, where: str) -> str:
    name = names.gguf_name(hf_name)
    if name is None:
        raise ValueError(f"{where}: tensor {hf_name} has no GGUF name in llama.cpp's tensor map")
    return name


def _param_name(model: nn.Module, tensor: torch.Tensor, skip: Optional[str] = None) -> str:
    return next(n for n, t in model.state_dict().items() if t.data_ptr() == tensor.data_ptr() and n != skip)


def _tied(model: nn.Module) -> bool:
    head = model.get_output_embeddings()
    return head is not None and head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
