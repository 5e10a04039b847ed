"""Runtime backends for QuantLinear: one `backend` setting picks the matmul each layer runs.

`prepare(model, backend)` packs every QuantLinear's codes once into the chosen kernel's layout
and attaches the kernel (FP8Linear too, on the CPU); the module's forward then calls it for the
inputs it accepts (decode-sized batches) and runs the reference path (dequantize + F.linear) for
the rest. A layer that a kernel cannot take (bit width, group size, shape) keeps the reference
path and is reported.

  reference   dequantize + F.linear everywhere (the definition every backend is tested against)
  cpu_avx512  quantize/csrc/ kernels for AVX-512 CPUs: int2-4 codes as nibbles, int5-8 as bytes,
              FP8 bytes (bf16 dot products where the CPU has AVX512-BF16)
  cpu_avx2    the same layouts for AVX2 + FMA + F16C CPUs (own module, no AVX-512 instruction)
  cuda_int4   torch's tinygemm (torch._weight_int4pack_mm), 4-bit groups of 32-256
  cuda_int8   int8 weight-only: per-channel symmetric codes, torch._weight_int8pack_mm
  triton      quantize/runtime/triton_kernels.py: per-channel int8 codes (W8A16), E4M3 FP8
              weight-only layers, and 4-bit group codes at batch 1, decoded in registers (CUDA;
              the CPU under TRITON_INTERPRET=1)
  auto        the fastest available one for the device the layer's codes are on (on CUDA:
              cuda_int4, then triton; on the CPU: cpu_<cpu_info().isa>; none, as
              on ARM or with LOWBIT_CPU_ISA=none: the reference)
"""
from __future__ import annotations

import functools
from typing import Literal, get_args

import torch
from torch import nn

from lowbit.calibrate.hardware import cpu_info
from lowbit.quantize.runtime import cpu_kernels, cuda_kernels, triton_kernels
from lowbit.quantize.runtime.fp8_linear import FP8Linear
from lowbit.quantize.runtime.modules import is_quantized_linear
from lowbit.quantize.runtime.qlinear import QuantLinear

Backend = Literal["reference", "auto", "cpu_avx512", "cpu_avx2", "cuda_int4", "cuda_int8", "triton"]
BACKENDS = get_args(Backend)
CPU_VARIANTS = {"cpu_avx512": "avx512", "cpu_avx2": "avx2"}  # backend -> cpu_kernels variant


def prepare(model: nn.Module, backend: Backend = "auto") -> dict[str, str]:
    """Attach `backend`'s kernel to every QuantLinear and FP8Linear in model; returns layer ->
    what it runs.

    Call it after moving the model to its device; moving it later needs a new prepare()."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    chosen = {}
    for name, module in model.named_modules():
        if is_quantized_linear(module):
            module.kernel, chosen[name] = make_kernel(module, backend)
    return chosen


def make_kernel(module: QuantLinear | FP8Linear, backend: Backend):
    """(kernel or None, description) for one layer."""
    if backend == "reference":
        return None, "reference"
    if isinstance(module, FP8Linear):
        return _fp8_kernel(module, backend)
    if module.input_quant is not None:
        return None, "int8 inputs (W8A8): quantized-input path, not a weight-only kernel"
    candidates = auto_candidates(module.weight_codes.device) if backend == "auto" else [backend]
    reasons = []
    for name in candidates:
        kernel, reason = BUILDERS[name](module)
        if kernel is not None:
            return kernel, name
        reasons.append(f"{name}: {reason}")
    if not candidates:
        reasons.append(no_candidates_reason(module.weight_codes.device))
    return None, "reference (" + "; ".join(reasons) + ")"


def auto_candidates(device: torch.device) -> list[str]:
    if device.type == "cuda":
        return ["cuda_int4", "triton"]  # cuda_int8 only when named: 0.06x bf16 on an H200
    if device.type == "cpu" and cpu_info().isa != "none":
        return [f"cpu_{cpu_info().isa}"]
    return []


def no_candidates_reason(device: torch.device) -> str:
    if device.type == "cpu":
        return f"no CPU kernel variant: {cpu_kernels.unavailable('avx2')}"
    return f"no kernels for {device.type}"


def _cpu(module: QuantLinear, variant: str):
    if module.weight_codes.device.type != "cpu":
        return None, f"codes are on {module.weight_codes.device}, not the CPU"
    if (reason := cpu_kernels.unavailable(variant)) is not None:
        return None, reason
    layout = cpu_kernels.layout_for(module, variant)
    if isinstance(layout, str):
        return None, layout
    ext = cpu_kernels.load(variant)
    if ext is None:
        return None, "the extension did not build (see the warning)"
    return cpu_kernels.CpuKernel(ext, variant, layout, module.bias), None


def _fp8_kernel(module: FP8Linear, backend: Backend):
    """FP8 layers: Triton's weight-only kernel, the CPU kernel, or FP8Linear's own paths
    (torch._scaled_mm on FP8 GPUs for FP8 activations)."""
    on_cpu = module.weight.device.type == "cpu"
    if backend == "triton" or (backend == "auto" and not on_cpu):
        kernel, why = triton_kernels.fp8_weight_only(module)
        if kernel is not None:
            return kernel, "triton"
        scaled_mm = "" if module.activations == "none" else "; FP8Linear runs torch._scaled_mm where the GPU has FP8"
        return None, f"reference (triton: {why}{scaled_mm})"
    if backend == "auto":
        if cpu_info().isa == "none":
            return None, f"reference ({no_candidates_reason(module.weight.device)})"
        backend = f"cpu_{cpu_info().isa}"
    if backend not in CPU_VARIANTS:
        return None, f"reference ({backend} takes no FP8 layers)"
    if not on_cpu:
        return None, f"reference ({backend}: the weight is on {module.weight.device}, not the CPU)"
    variant = CPU_VARIANTS[backend]
    found = cpu_kernels.fp8_group_scales(module)
    if isinstance(found, str):
        return None, f"reference ({backend}: {found})"
    if (reason := cpu_kernels.unavailable(variant)) is not None:
        return None, f"reference ({backend}: {reason})"
    if (ext := cpu_kernels.load(variant)) is None:
        return None, f"reference ({backend}: the extension did not build (see the warning))"
    return cpu_kernels.CpuFp8Kernel(ext, variant, module, *found), backend


BUILDERS = {
    **{backend: functools.partial(_cpu, variant=variant) for backend, variant in CPU_VARIANTS.items()},
    "cuda_int4": cuda_kernels.int4_tinygemm,
    "cuda_int8": cuda_kernels.int8_weight_only,
    "triton": triton_kernels.for_quantlinear,
}
