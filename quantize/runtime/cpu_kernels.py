"""Low-bit GEMV for CPU decode, in two variants built from csrc/ on first use, each its own
extension module compiled only for its instruction set:

  avx512  gemv_avx512.cpp, gemv_bf16.cpp (AVX512-BF16 dot products where the CPU has them)
  avx2    gemv_avx2.cpp: AVX2 + FMA + F16C, never an AVX-512 instruction (AMD Zen 2/3, older Intel)

Both take the same layouts and export gemv_int4 / gemv_int8 / gemv_fp8 / quantize_fp8_inputs
(fp8_inputs.cpp, compiled into each), and fake_quant_int / fake_quant_int_backward (fake_quant.cpp:
signround's integer weight and its gradients, in one pass each). Which one runs is `cpu_info().isa`
(lowbit.calibrate.hardware; LOWBIT_CPU_ISA=avx512|avx2|none forces a lesser one). Builds are cached
under $LOWBIT_CACHE/kernels; when a build fails, or the CPU has no variant (ARM, old x86, or
forced none), `load()` returns None with the reason, and the caller falls back to the reference path.
"""
from __future__ import annotations

import functools
import hashlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from lowbit.calibrate.cache import cache_dir, exclusive
from lowbit.calibrate.hardware import ISAS, cpu_info
from lowbit.quantize.grids.fp8 import quantize_activation

CSRC = Path(__file__).with_name("csrc")
BUILD_LOCK = ".lowbit-build.lock"  # held (fcntl) while one process builds a kernel module
HEADERS = [CSRC / "gemv_common.h"]
COMMON_FLAGS = ["-O3", "-fopenmp"]
VARIANTS = {  # variant -> (sources, the only instruction-set flags its module is compiled with)
    "avx512": ([CSRC / "gemv_avx512.cpp", CSRC / "gemv_bf16.cpp", CSRC / "fp8_inputs.cpp",
                CSRC / "fake_quant.cpp"],
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]),
    "avx2": ([CSRC / "gemv_avx2.cpp", CSRC / "fp8_inputs.cpp", CSRC / "fake_quant.cpp"], ["-mavx2", "-mfma", "-mf16c"]),
}


def unavailable(variant: str) -> str | None:
    """None when this CPU, as cpu_info() describes it, runs `variant`'s kernels, else why not."""
    if variant not in VARIANTS:
        return f"no kernel variant {variant!r} (variants: {', '.join(VARIANTS)})"
    info = cpu_info()
    if ISAS.index(variant) >= ISAS.index(info.isa):
        return None
    if info.forced and ISAS.index(variant) >= ISAS.index(info.native_isa):
        return f"{info.forced} limits this CPU to {info.isa}"
    return f"this {info.machine} CPU has no {variant} (its best variant: {info.native_isa})"


def load(variant: str | None = None):
    """The compiled module of `variant` (default: cpu_info().isa), or None after one warning
    saying why (the CPU lacks it, or the build failed)."""
    variant = variant or cpu_info().isa
    reason = unavailable(variant) if variant != "none" else f"no kernel variant for this CPU ({cpu_info().describe()})"
    if reason is None:
        try:
            return _build(variant)
        except Exception as err:  # a missing compiler or ninja shows up as several error types
            names = ", ".join(p.name for p in VARIANTS[variant][0])
            reason = f"building {names} failed: {type(err).__name__}: {err}"
    _warn_once(reason)
    return None


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"lowbit: CPU low-bit kernels unavailable ({reason}); using the reference "
                  "path (dequantize + F.linear)", RuntimeWarning, stacklevel=3)


@functools.cache
def _build(variant: str):
    from torch.utils.cpp_extension import load as load_extension

    sources, isa_flags = VARIANTS[variant]
    flags = COMMON_FLAGS + isa_flags
    code = b"".join(p.read_bytes() for p in sources + HEADERS)
    digest = hashlib.sha256(code + " ".join(flags).encode()).hexdigest()[:12]
    name = f"lowbit_gemv_{variant}_{digest}"  # a new source or flags is a new module, never a stale one
    build_dir = cache_dir("kernels", f"torch{torch.__version__}", name)
    with exclusive(build_dir / BUILD_LOCK):
        # torch's own build lock is a plain file (`lock`): a build killed mid-way (Ctrl-C, SIGKILL)
        # leaves it behind and every later load waits on it forever. Under our lock, which the OS
        # drops with its process, nobody else is building: a `lock` file here is such a leftover.
        (build_dir / "lock").unlink(missing_ok=True)
        return load_extension(name, [str(p) for p in sources], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                              build_directory=str(build_dir), verbose=False)


def pack_int4(codes: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Signed codes (N, K) in [-8, 8) -> (N, K/2) uint8, `block` weights per block/2 bytes: byte
    i of a block holds weight i (low nibble) and weight i + block/2 (high nibble), both as
    code + 8. gemv_int4 reads blocks of 32, pack_int4_tiles lays out blocks of 64."""
    n, k = codes.shape
    u = (codes.to(torch.int16) + 8).to(torch.uint8).reshape(n, k // block, 2, block // 2)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


TILE_ROWS = 4  # output rows per tile of gemv_int4_bf16


def pack_int4_tiles(codes: torch.Tensor) -> torch.Tensor:
    """Signed codes (N, K) -> (ceil(N/4), K/64, 4, 32) uint8 for gemv_int4_bf16: pack_int4's
    64-weight blocks, with the blocks of four rows side by side (rows past N are zero codes)."""
    n, k = codes.shape
    padded = -(-n // TILE_ROWS) * TILE_ROWS
    blocks = pack_int4(F.pad(codes, (0, 0, 0, padded - n)), block=64)  # pads with code 0
    return blocks.reshape(padded // TILE_ROWS, TILE_ROWS, k // 64, 32).transpose(1, 2).contiguous()


def scale_offset(scale: torch.Tensor, zero: torch.Tensor | None, code_shift: int) -> torch.Tensor:
    """(N, G, 2) float32: w = u * s + b for a stored code u = q + code_shift, b = -(shift + z) * s."""
    shift = torch.full_like(scale, float(code_shift)) if zero is None else code_shift + zero.float()
    return torch.stack([scale.float(), -shift * scale.float()], dim=-1).contiguous()


def has_bf16_dot(variant: str) -> bool:
    """Whether `variant` may use AVX512-BF16 dot products here: the avx512 variant, on a CPU
    that has them (its module asks the CPU) and that cpu_info() treats as bf16-native."""
    if variant != "avx512" or not cpu_info().bf16_native:
        return False
    ext = load(variant)
    return ext is not None and bool(ext.has_avx512_bf16())


def bf16_dot_available(variant: str | None = None) -> bool:
    """Whether layers with 16-bit activations may round them to bf16 for the dot-product
    kernels (4-bit at any batch size; 8-bit and FP8 weight-only in batches): has_bf16_dot and
    LOWBIT_CPU_BF16_DOT is not 0. Results then differ from the float32 reference by bf16
    rounding (~0.4% relative)."""
    return os.environ.get("LOWBIT_CPU_BF16_DOT", "1") != "0" and has_bf16_dot(variant or cpu_info().isa)


MAX_ROWS = 16  # activation rows per call the kernels take; larger (prefill) runs the reference


@dataclass(frozen=True)
class CpuLayout:
    bits: int  # 4: nibbles (codes of 2-4 bits), 8: bytes (codes of 5-8 bits)
    weight: torch.Tensor  # (N, K/2) uint8, (N, K) int8, or int4 tiles (N/4, K/64, 4, 32) uint8
    sb: torch.Tensor  # (N, G, 2) float32 scale and offset
    group: int  # input columns per scale
    perm: Optional[torch.Tensor]  # (K,) input order that makes act-order groups contiguous
    # activations rounded to bf16 for vdpbf16ps: 4-bit (pack_int4_tiles) at every batch size,
    # 8-bit in batches of 2+ rows (batch 1 is memory-bound and stays float32)
    bf16_dot: bool = False

    def bf16_activations(self, rows: int) -> bool:
        return self.bf16_dot and (self.bits == 4 or rows > 1)


def layout_for(module, variant: str) -> CpuLayout | str:
    """The layout `variant`'s kernels take for a QuantLinear, or why they cannot take it."""
    scheme, (n, k) = module.scheme, module.weight_codes.shape
    bits = 4 if scheme.bits <= 4 else 8
    group = scheme.group_size if scheme.strategy == "group" else k
    if group % 16 or k % (32 if bits == 4 else 16):
        return f"in_features {k} / group {group} not multiples of the kernel's 16/32-column chunks"
    codes, perm = module.weight_codes, None
    if module.weight_g_idx is not None:
        g_idx = module.weight_g_idx.long()
        if not bool((torch.bincount(g_idx, minlength=k // group) == group).all()):
            return "act-order g_idx does not give every group exactly group_size columns"
        perm = torch.argsort(g_idx, stable=True)
        codes = codes[:, perm]
    scale, zero = module.weight_scale, module.weight_zero
    scale = scale.expand(n, k // group)  # per-tensor (1, 1) becomes one scale per row
    zero = None if zero is None else zero.expand(n, k // group)
    bf16_dot = bf16_dot_available(variant)
    if bits == 4 and bf16_dot and group % 64 == 0:
        return CpuLayout(4, pack_int4_tiles(codes), scale_offset(scale, zero, 8), group, perm, bf16_dot=True)
    if bits == 4:
        return CpuLayout(4, pack_int4(codes), scale_offset(scale, zero, 8), group, perm)
    return CpuLayout(8, codes.contiguous(), scale_offset(scale, zero, 0), group, perm,
                     bf16_dot=bf16_dot and group % 32 == 0)


class CpuKernel:
    """Callable attached to a QuantLinear: y = x @ W^T (+ bias) for up to MAX_ROWS rows."""

    def __init__(self, ext, variant: str, layout: CpuLayout, bias: Optional[torch.Tensor]):
        self.variant, self.layout, self.bias = variant, layout, None if bias is None else bias.float()
        self.fn = ext.gemv_int8 if layout.bits == 8 else ext.gemv_int4_bf16 if layout.bf16_dot else ext.gemv_int4
        self.flags = (layout.bf16_dot,) if layout.bits == 8 else ()  # gemv_int8's bf16_batches
        self.nbytes = sum(t.nbytes for t in (layout.weight, layout.sb, bias) if t is not None)  # read per call

    def accepts(self, x: torch.Tensor) -> bool:
        return x.is_cpu and x.numel() <= MAX_ROWS * x.shape[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Few torch calls: at decode each costs about a microsecond next to a ~10 us kernel, so
        # conversions that would return x itself are not called.
        lay = self.layout
        xk = x if lay.perm is None else x.index_select(-1, lay.perm)
        if xk.dtype != torch.float32 or not xk.is_contiguous():
            xk = xk.float().contiguous()
        y = self.fn(xk, lay.weight, lay.sb, lay.group, *self.flags)  # (..., N), x's leading dims
        if self.bias is not None:
            y += self.bias
        return y if x.dtype == torch.float32 else y.to(x.dtype)


def fp8_group_scales(module) -> tuple[torch.Tensor, int] | str:
    """(scales (N, K/group) float32, group) for an FP8Linear's weight, with E4M3's 2^8 folded in
    (gemv_fp8 decodes E4M3 bytes to value * 2^-8), or why the kernel cannot take it."""
    n, k = module.weight.shape
    scale = module.weight_scale.float()
    if module.weight_strategy == "block":
        group = module.block_size
        if k % group or group % 16:
            return f"in_features {k} is not a multiple of the {group}-column weight blocks"
        scale = scale.repeat_interleave(group, dim=0)[:n]  # (N, K/group)
    else:
        group = k
        scale = scale.expand(n, 1)  # per tensor or per channel: one group per row
    if k % 16:
        return f"in_features {k} is not a multiple of 16"
    return (scale * (256.0 if module.fmt == "e4m3" else 1.0)).contiguous(), group


class CpuFp8Kernel:
    """Callable attached to an FP8Linear: its activations rounded onto the FP8 grid as the
    reference path does (same function), then the codes times the FP8 weight bytes."""

    def __init__(self, ext, variant: str, module, scales: torch.Tensor, group: int):
        self.fn, self.variant, self.module, self.scales, self.group = ext.gemv_fp8, variant, module, scales, group
        # batches of 2+ rows on bf16 dot products: exact for FP8-coded inputs; with 16-bit
        # inputs (activations "none") they round to bf16, as W8A16 does, unless opted out
        coded = module.activations != "none"
        self.flags = (module.fmt == "e4m3", has_bf16_dot(variant) if coded else bf16_dot_available(variant))
        self.codes = module.weight.view(torch.uint8)
        self.bias = None if module.bias is None else module.bias.float()
        self.quantize_inputs = ext.quantize_fp8_inputs
        self.static_scale = float(module.input_scale) if module.activations == "static" else 0.0  # 0: per token
        self.nbytes = sum(t.nbytes for t in (self.codes, scales, self.bias) if t is not None)  # read per call

    def bf16_activations(self, rows: int) -> bool:
        return self.module.activations == "none" and self.flags[1] and rows > 1

    def accepts(self, x: torch.Tensor) -> bool:
        return x.is_cpu and x.numel() <= MAX_ROWS * x.shape[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if m.activations == "none":
            y = self.fn(x.float().contiguous(), self.codes, self.scales, self.group, *self.flags)
        elif x.dtype == torch.float32 and x.shape[-1] % 16 == 0:  # one C++ pass, same values
            codes, x_scale = self.quantize_inputs(x.contiguous(), self.static_scale, m.fmt == "e4m3")
            y = self.fn(codes, self.codes, self.scales, self.group, *self.flags) * x_scale
        else:
            x_scale = m.input_scale_for(x)  # per token (..., 1) or the static scalar
            codes = quantize_activation(x, x_scale, m.fmt).float().contiguous()
            y = self.fn(codes, self.codes, self.scales, self.group, *self.flags) * x_scale.float()
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)
