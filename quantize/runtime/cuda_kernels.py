"""CUDA weight-only kernels from torch itself (no build step). Checked on an H200 (docs/gpu.md):
both match their reference path; tinygemm ran batch-1 decode at 1.70x bf16, _weight_int8pack_mm
at 0.06x (so `auto` leaves it out). tests/test_quantize_backends.py runs them where CUDA exists.

Each builder takes a QuantLinear and returns (kernel, None) or (None, why not).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

TINYGEMM_GROUPS = (32, 64, 128, 256)
INNER_K_TILES = 8  # tinygemm's k-tiling; in_features must be a multiple of 16 * this
MAX_ROWS = 16  # decode-sized batches; prefill runs the reference path


def _on_cuda(module) -> Optional[str]:
    if module.weight_codes.device.type != "cuda":
        return f"codes are on {module.weight_codes.device}, not a CUDA device"
    return None


class _CudaKernel:
    def __init__(self, bias: Optional[torch.Tensor]):
        self.bias = bias

    def accepts(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.numel() // x.shape[-1] <= MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1])).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class Int4Tinygemm(_CudaKernel):
    def __init__(self, packed, scales_zeros, group, bias):
        super().__init__(bias)
        self.packed, self.scales_zeros, self.group = packed, scales_zeros, group
        self.nbytes = packed.nbytes + scales_zeros.nbytes  # read per call

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm(x2.to(torch.bfloat16).contiguous(), self.packed, self.group,
                                         self.scales_zeros)


def int4_tinygemm(module):
    """torch._weight_int4pack_mm: bf16 activations, 4-bit codes, groups of 32-256, no act-order."""
    s, (n, k) = module.scheme, module.weight_codes.shape
    why = _on_cuda(module)
    if why is None and (s.bits > 4 or s.strategy != "group" or s.group_size not in TINYGEMM_GROUPS):
        why = f"needs codes of <= 4 bits in groups of {TINYGEMM_GROUPS}"
    if why is None and module.weight_g_idx is not None:
        why = "act-order g_idx is not supported"
    if why is None and (k % (16 * INNER_K_TILES) or n % 8):
        why = f"needs in_features % {16 * INNER_K_TILES} == 0 and out_features % 8 == 0"
    if why:
        return None, why
    u = module.weight_codes.to(torch.int32) + 8  # tinygemm stores unsigned nibbles, two per byte
    packed = torch._convert_weight_to_int4pack((u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8), INNER_K_TILES)
    scale = module.weight_scale.float()
    zero = torch.zeros_like(scale) if module.weight_zero is None else module.weight_zero.float()
    # tinygemm computes (u - 8) * scale + zero_f; ours is (u - 8 - zero) * scale
    scales_zeros = torch.stack([scale, -zero * scale], dim=-1).transpose(0, 1).contiguous()
    return Int4Tinygemm(packed, scales_zeros.to(torch.bfloat16), s.group_size, module.bias), None


class Int8WeightOnly(_CudaKernel):
    def __init__(self, codes, scale, bias):
        super().__init__(bias)
        self.codes, self.scale = codes, scale  # (N, K) int8, (N,) float32
        self.nbytes = codes.nbytes + scale.nbytes  # read per call

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        # torch's own int8 weight-only matmul reads the codes as bytes (no float weight is built)
        return torch._weight_int8pack_mm(x2.contiguous(), self.codes, self.scale.to(x2.dtype))


@functools.cache
def _int8pack_missing(device: torch.device) -> Optional[str]:
    """Whether this torch has _weight_int8pack_mm for `device` (CUDA builds before about 2.6 do not)."""
    try:
        torch._weight_int8pack_mm(torch.zeros(1, 32, dtype=torch.bfloat16, device=device),
                                  torch.zeros(8, 32, dtype=torch.int8, device=device),
                                  torch.ones(8, dtype=torch.bfloat16, device=device))
    except (RuntimeError, NotImplementedError) as e:
        return f"torch {torch.__version__} has no {device.type} _weight_int8pack_mm ({str(e).splitlines()[0]})"
    return None


def int8_weight_only(module):
    """Symmetric per-channel int8 (or narrower) codes, any activation dtype."""
    s = module.scheme
    why = _on_cuda(module)
    if why is None and (not s.symmetric or s.strategy != "channel"):
        why = "needs symmetric per-channel codes"
    if why is None:
        why = _int8pack_missing(module.weight_codes.device)
    if why:
        return None, why
    # per-channel: an act-order g_idx (all zeros) changes nothing
    return Int8WeightOnly(module.weight_codes.contiguous(), module.weight_scale[:, 0].float(), module.bias), None
