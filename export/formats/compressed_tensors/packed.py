"""compressed-tensors `pack-quantized`: integer weight-only schemes (W2..W8 A16) as QuantLinear.

The contract, as compressed-tensors 0.20 writes and reads it:
- `weight_packed` int32 (out, ceil(in * bits / 32)): signed codes plus 2^(bits-1), densely
  packed along in_features (a 3-bit code may straddle two words).
- `weight_scale` (out, G) for group/channel (G == 1), (1,) for tensor, in the export dtype.
- `weight_zero_point` only when asymmetric: signed zero points, for group/channel packed the
  same way but along out_features, int32 (ceil(out * bits / 32), G); for tensor one int8 (1,).
- `weight_shape` int64 [out, in].
Dequantization: (code - zero) * scale, the convention lowbit's codes already follow.
"""
from __future__ import annotations

import torch

from lowbit.quantize.grids.integer import IntScheme, pack_codes, unpack_codes
from lowbit.quantize.runtime.qlinear import QuantLinear

from .shape_checks import scale_problem, shape_problem, zero_problems

FORMAT = "pack-quantized"
STORED = ("weight_packed", "I32", "packed integer codes (pack-quantized)")  # tensor suffix, safetensors dtype, what
READS = "int 2-8 bits"  # the weights this codec reads, as the agreement check lists them


def handles(module) -> bool:
    return isinstance(module, QuantLinear)


def reads(group: dict) -> bool:
    weights = group.get("weights") or {}
    return weights.get("type") == "int" and not group.get("input_activations")


def scheme_entry(name: str, module: QuantLinear) -> dict:
    """The config group body (weights args, format) for one module."""
    s = module.scheme
    if module.weight_g_idx is not None and not is_plain_grouping(module.weight_g_idx, s):
        raise ValueError(
            f"layer {name}: act-order with a permuted g_idx cannot be written as compressed-tensors "
            "(version 0.20 removed actorder 'group' and weight_g_idx); export with --format gptq, or "
            "quantize with gptq actorder: static (groups fixed in column order, no g_idx)"
        )
    weights = {"num_bits": s.bits, "type": "int", "symmetric": s.symmetric, "strategy": s.strategy,
               "group_size": s.group_size, "dynamic": False, "actorder": None}
    return {"weights": weights, "input_activations": None, "output_activations": None, "format": FORMAT}


def is_plain_grouping(g_idx: torch.Tensor, scheme: IntScheme) -> bool:
    """True when g_idx only restates contiguous groups (column j in group j // group_size)."""
    if scheme.strategy != "group":
        return bool((g_idx == 0).all())
    plain = torch.arange(g_idx.numel(), device=g_idx.device) // scheme.group_size
    return torch.equal(g_idx.long(), plain)


def module_tensors(prefix: str, module: QuantLinear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    s = module.scheme
    offset = 2 ** (s.bits - 1)
    out = {
        f"{prefix}.weight_packed": pack_codes(module.weight_codes.to(torch.int16) + offset, s.bits),
        f"{prefix}.weight_scale": _file_shape(module.weight_scale, s).to(dtype).contiguous(),
        f"{prefix}.weight_shape": torch.tensor([module.out_features, module.in_features], dtype=torch.int64),
    }
    if module.weight_zero is not None:
        zero = module.weight_zero.round().to(torch.int16)  # (out, G) or (1, 1)
        if s.strategy == "tensor":
            out[f"{prefix}.weight_zero_point"] = zero.reshape(1).to(torch.int8)
        else:
            out[f"{prefix}.weight_zero_point"] = pack_codes((zero + offset).t(), s.bits).t().contiguous()
    if module.bias is not None:
        out[f"{prefix}.bias"] = module.bias.to(dtype)
    return out


def _file_shape(scale: torch.Tensor, scheme: IntScheme) -> torch.Tensor:
    return scale.reshape(1) if scheme.strategy == "tensor" else scale


def scheme_from_args(args: dict, where: str) -> IntScheme:
    strategy = args.get("strategy") or ("group" if (args.get("group_size") or 0) > 0 else "tensor")
    if strategy not in ("tensor", "channel", "group"):
        raise ValueError(f"{where}: weight strategy {strategy!r} is not supported; supported: tensor, channel, group")
    group_size = args.get("group_size") if strategy == "group" else None
    return IntScheme(bits=args["num_bits"], symmetric=args.get("symmetric", True), strategy=strategy,
                     group_size=group_size)


def group_scheme(prefix: str, group: dict, where: str) -> tuple[IntScheme | None, list[str]]:
    """(the IntScheme the reader builds from the group, []) or (None, [why it cannot])."""
    weights = group["weights"]
    if not isinstance(weights.get("num_bits"), int):
        return None, [f"{prefix}.weight_scale: {where}.weights.num_bits is {weights.get('num_bits')!r}, not an integer"]
    try:
        return scheme_from_args(weights, f"{where}.weights"), []
    except ValueError as err:
        text = str(err)
        return None, [f"{prefix}.weight_scale: {text if text.startswith(where) else f'{where}.weights: {text}'}"]


def config_problems(prefix: str, table, group: dict, where: str) -> list[str]:
    """How one module's tensors in `table` (a TensorTable) disagree with its config `group` at `where`."""
    scheme, problems = group_scheme(prefix, group, where)
    if scheme is None:
        return problems
    if f"{prefix}.weight_shape" not in table:
        return [f"{prefix}.weight_shape: missing (pack-quantized needs the [out, in] of each weight)"]
    out_f, in_f = (int(v) for v in table.value(f"{prefix}.weight_shape").tolist())
    words = (in_f * scheme.bits + 31) // 32
    problems = shape_problem(f"{prefix}.weight_packed", table, (out_f, words),
                             f"{where}.weights.num_bits {scheme.bits} packs {in_f} columns into {words} words")
    problems += scale_problem(prefix, table, scheme, out_f, in_f, where)
    zero = (1,) if scheme.strategy == "tensor" else ((out_f * scheme.bits + 31) // 32, scheme.num_groups(in_f))
    return problems + zero_problems(prefix, table, scheme, zero, where)


def build_module(prefix: str, tensors: dict[str, torch.Tensor], group: dict) -> QuantLinear:
    """A QuantLinear from one module's tensors (consumed from `tensors`)."""
    scheme = scheme_from_args(group["weights"], prefix)
    take = lambda key: tensors.pop(f"{prefix}.{key}", None)  # noqa: E731
    out_f, in_f = (int(v) for v in take("weight_shape").tolist())
    offset = 2 ** (scheme.bits - 1)
    packed = take("weight_packed")
    scale = take("weight_scale").float()
    scale = scale.reshape(1, 1) if scheme.strategy == "tensor" else scale.reshape(out_f, -1)
    g_idx, bias, zp = take("weight_g_idx"), take("bias"), take("weight_zero_point")
    module = QuantLinear(in_f, out_f, scheme, bias is not None, scale.shape[1], g_idx is not None)
    for start in range(0, out_f, 1024):  # int16 temporaries a block's, not the weight's
        rows = slice(start, start + 1024)
        module.weight_codes[rows] = unpack_codes(packed[rows], scheme.bits, in_f).to(torch.int16) - offset
    module.weight_scale = scale
    if zp is not None and scheme.strategy == "tensor":
        module.weight_zero = zp.float().reshape(1, 1)
    elif zp is not None:
        module.weight_zero = unpack_codes(zp.t().contiguous(), scheme.bits, out_f).t().float() - offset
    if g_idx is not None:  # written by compressed-tensors before 0.20 (actorder 'group')
        module.weight_g_idx = g_idx.to(torch.int32)
    if bias is not None:
        module.bias = bias.float()
    return module
