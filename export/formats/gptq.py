"""The GPTQ checkpoint format (AutoGPTQ / GPTQModel / optimum, `checkpoint_format: gptq`).

Per quantized linear, with G groups along in_features:
- `qweight` int32 (in * bits / 32, out): unsigned codes (signed + 2^(bits-1)) packed along in_features.
- `qzeros` int32 (G, out * bits / 32): unsigned zero points minus one (the v1 convention), packed
  along out_features. Symmetric grids store 2^(bits-1) - 1.
- `scales` (G, out) in the export dtype; `g_idx` int32 (in,): the group of each input column.
Dequantization: W[o, i] = scales[g, o] * (q[i, o] - (qzeros[g, o] + 1)) with g = g_idx[i].
Per-channel schemes are written with group_size -1 (G = 1); per-tensor ones broadcast their one
scale to every output channel, which is exact.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from lowbit.quantize.grids.integer import IntScheme, pack_codes, unpack_codes
from lowbit.quantize.runtime.qlinear import QuantLinear

from .base import ExportFormat
from .compressed_tensors.packed import is_plain_grouping
from .tensor_table import FolderTensors, TensorTable, build_or_explain
from .hf_folder import (checkpoint_tensors, float_linears, quant_method, quantized_modules,
                         write_quantized)

QUANT_METHOD = "gptq"
GPTQ_CONFIG = "quantize_config.json"  # what GPTQModel and AutoGPTQ read beside config.json
SUPPORTED_BITS = (2, 3, 4, 8)
ZERO_OFFSET = 1  # v1: the file stores zero - 1


def check_modules(modules: dict) -> None:
    other = [n for n, m in modules.items() if not isinstance(m, QuantLinear)]
    if other:
        raise ValueError(f"GPTQ format holds integer weights only; {other[0]} is {type(modules[other[0]]).__name__} "
                         "(use --format compressed-tensors)")


def quantization_config(modules: dict[str, QuantLinear], float_linears: list[str]) -> dict:
    """quantize_config.json (also config.json's quantization_config): one scheme for all modules."""
    schemes = {m.scheme for m in modules.values()}
    if len(schemes) != 1:
        raise ValueError(f"GPTQ format holds one bit-width and group size per model; found {sorted(map(str, schemes))}: "
                         "export a format per linear as compressed-tensors (export.format: compressed-tensors)")
    scheme = schemes.pop()
    desc_act = any(m.weight_g_idx is not None and not is_plain_grouping(m.weight_g_idx, m.scheme)
                   for m in modules.values())
    skip = [n for n in float_linears if n != "lm_head"]
    config = {
        "quant_method": QUANT_METHOD, "checkpoint_format": "gptq", "bits": scheme.bits,
        "group_size": scheme.group_size if scheme.strategy == "group" else -1,
        "desc_act": desc_act, "sym": scheme.symmetric, "true_sequential": True,
        "static_groups": False, "lm_head": "lm_head" in modules,
    }
    if skip:  # GPTQModel's per-module override: "-:" excludes a module from quantization
        config["dynamic"] = {f"-:^{n.replace('.', '[.]')}$": {} for n in skip}
    return config


def module_tensors(prefix: str, module: QuantLinear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    s = module.scheme
    if s.bits not in SUPPORTED_BITS:
        raise ValueError(f"layer {prefix}: GPTQ format supports {SUPPORTED_BITS} bits, not {s.bits}")
    offset = 2 ** (s.bits - 1)
    scale, zero = _per_channel_groups(module)  # (out, G) each
    zero_u = (zero + offset) if zero is not None else torch.full_like(scale, offset)
    stored = zero_u.round().to(torch.int64).t() - ZERO_OFFSET  # (G, out)
    if (stored < 0).any():
        raise ValueError(f"layer {prefix}: a group has zero point 0 on the unsigned grid, which the GPTQ "
                         "v1 convention (stored zero = zero - 1) cannot represent; use a symmetric scheme "
                         "or --format compressed-tensors")
    codes_u = module.weight_codes.to(torch.int16) + offset  # (out, in)
    out = {
        f"{prefix}.qweight": pack_codes(codes_u, s.bits).t().contiguous(),
        f"{prefix}.qzeros": pack_codes(stored, s.bits),
        f"{prefix}.scales": scale.t().to(dtype).contiguous(),
        f"{prefix}.g_idx": _g_idx(module).to(torch.int32),
    }
    if module.bias is not None:
        out[f"{prefix}.bias"] = module.bias.to(dtype)
    return out


def _per_channel_groups(module: QuantLinear):
    """Scale and zero as (out, G); a per-tensor scale is repeated for every output channel."""
    scale, zero = module.weight_scale.float(), module.weight_zero
    if module.scheme.strategy == "tensor":
        scale = scale.expand(module.out_features, 1)
        zero = None if zero is None else zero.float().expand(module.out_features, 1)
    return scale, None if zero is None else zero.float()


def _g_idx(module: QuantLinear) -> torch.Tensor:
    if module.weight_g_idx is not None:
        return module.weight_g_idx
    s = module.scheme
    size = s.group_size if s.strategy == "group" else module.in_features
    return torch.arange(module.in_features) // size


def build_module(prefix: str, tensors: dict[str, torch.Tensor], qconfig: dict) -> QuantLinear:
    """A QuantLinear from one module's GPTQ tensors (consumed from `tensors`)."""
    bits, group_size = qconfig["bits"], qconfig["group_size"]
    if qconfig.get("checkpoint_format", "gptq") != "gptq":
        raise ValueError(f"layer {prefix}: GPTQ checkpoint_format {qconfig['checkpoint_format']!r}; lowbit reads 'gptq' (v1)")
    qweight, qzeros = tensors.pop(f"{prefix}.qweight"), tensors.pop(f"{prefix}.qzeros")
    scales, g_idx = tensors.pop(f"{prefix}.scales").float(), tensors.pop(f"{prefix}.g_idx").long()
    bias = tensors.pop(f"{prefix}.bias", None)
    in_f, out_f = g_idx.numel(), scales.shape[1]
    offset = 2 ** (bits - 1)
    codes = unpack_codes(qweight.t().contiguous(), bits, in_f).to(torch.int16) - offset  # (out, in)
    zero = (unpack_codes(qzeros, bits, out_f).t().float() + ZERO_OFFSET - offset)  # (out, G)
    symmetric = bool(qconfig.get("sym", False)) and bool((zero == 0).all())
    strategy = "group" if group_size > 0 else "channel"
    scheme = IntScheme(bits, symmetric, strategy, group_size if group_size > 0 else None)
    plain = is_plain_grouping(g_idx, scheme)
    module = QuantLinear(in_f, out_f, scheme, bias is not None, scales.shape[0], not plain)
    module.weight_codes.copy_(codes.to(torch.int8))
    module.weight_scale = scales.t().contiguous()
    if not symmetric:
        module.weight_zero = zero
    if not plain:
        module.weight_g_idx = g_idx.to(torch.int32)
    if bias is not None:
        module.bias = bias.float()
    return module


def quantized_prefixes(tensors) -> list[str]:
    return sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight"))


def module_problems(prefix: str, table, qconfig: dict) -> list[str]:
    """Where quantization_config's bits, group_size, sym and desc_act disagree with one layer's
    tensors (`table`: a TensorTable), naming the tensor and the key."""
    missing = [f"{prefix}.{t}" for t in ("qweight", "qzeros", "scales", "g_idx") if f"{prefix}.{t}" not in table]
    if missing:
        return [f"{missing[0]}: missing (the GPTQ format stores qweight, qzeros, scales and g_idx per layer)"]
    bits, group_size = qconfig.get("bits"), qconfig.get("group_size")
    if bits not in SUPPORTED_BITS or not isinstance(group_size, int):
        return [f"{prefix}.qweight: quantization_config.bits {bits!r}, group_size {group_size!r}; "
                f"GPTQ holds bits {SUPPORTED_BITS} and an integer group_size (-1: per channel)"]
    in_f, out_f = table.shape(f"{prefix}.g_idx")[0], table.shape(f"{prefix}.scales")[-1]
    groups = in_f // group_size if group_size > 0 else 1
    need = {"qweight": ((in_f * bits + 31) // 32, out_f), "scales": (groups, out_f),
            "qzeros": (groups, (out_f * bits + 31) // 32)}
    problems = [f"{prefix}.{t}: shape {table.shape(f'{prefix}.{t}')}, but quantization_config.bits {bits} and "
                f"group_size {group_size} make {shape} for in {in_f}, out {out_f}"
                for t, shape in need.items() if table.shape(f"{prefix}.{t}") != shape]
    if problems:
        return problems
    scheme = IntScheme(bits, True, "group" if group_size > 0 else "channel", group_size if group_size > 0 else None)
    zeros = unpack_codes(table.value(f"{prefix}.qzeros"), bits, out_f).int() + ZERO_OFFSET
    off = int((zeros != 2 ** (bits - 1)).sum())
    if qconfig.get("sym") and off:
        problems.append(f"{prefix}.qzeros: {off} of {zeros.numel()} zero points are not the symmetric "
                        f"midpoint {2 ** (bits - 1)}, but quantization_config.sym is true")
    if not qconfig.get("desc_act") and not is_plain_grouping(table.value(f"{prefix}.g_idx").long(), scheme):
        problems.append(f"{prefix}.g_idx: columns out of group order (act-order), but quantization_config.desc_act "
                        "is false")
    return problems


class GPTQFormat(ExportFormat):
    name = QUANT_METHOD
    summary = "gptq: GPTQ v1 qweight/qzeros/scales/g_idx, one integer scheme per model, for GPTQModel and AutoGPTQ"

    def write(self, model, tokenizer, folder: Path, cfg, extra_files: dict[str, str]) -> None:
        quantized = quantized_modules(model)
        check_modules(quantized)
        tensors = checkpoint_tensors(model, quantized, getattr(torch, cfg.dtype), module_tensors)
        qconfig = quantization_config(quantized, float_linears(model, quantized))
        extra_files = {**extra_files, GPTQ_CONFIG: json.dumps(qconfig, indent=2)}
        write_quantized(folder, model, tokenizer, tensors, qconfig if quantized else None, cfg.dtype, extra_files)

    def detects(self, config: dict) -> bool:
        return quant_method(config) == QUANT_METHOD

    def read(self, model, tensors, config: dict, where: str) -> None:
        qconfig = config["quantization_config"]
        as_read = dict(tensors)  # what a failed build is explained from (a build takes its tensors out)
        for prefix in quantized_prefixes(tensors):
            model.set_submodule(prefix, build_or_explain(
                lambda: build_module(prefix, tensors, qconfig),
                lambda: module_problems(prefix, TensorTable(as_read), qconfig), where))

    def config_problems(self, config: dict, folder: Path) -> list[str]:
        qconfig, table = config["quantization_config"], FolderTensors(folder)
        return [p for prefix in quantized_prefixes(table.names()) for p in module_problems(prefix, table, qconfig)]

    def describe(self, config: dict) -> str:
        q = config["quantization_config"]
        return (f"GPTQ, v1 zero points ({q.get('bits')}-bit, group_size {q.get('group_size')}, "
                f"desc_act {str(q.get('desc_act')).lower()})")

    def loading(self, config: dict) -> list[str]:
        return ["GPTQ format (`quantize_config.json`): load with GPTQModel, e.g.",
                "`GPTQModel.load(path)`, or with transformers when gptqmodel and optimum are installed."]
