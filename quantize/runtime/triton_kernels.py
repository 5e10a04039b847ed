"""Triton weight-only kernels for decode-sized batches: one byte per weight (int8 codes with a
per-output-row scale, W8A16, or FP8 E4M3 bytes with theirs, FP8 weight-only), and 4-bit group
codes at batch 1, decoded in registers, so no decode step builds an (N, K) float weight. On an
H200 at batch 1 they ran Llama-3-8B-shaped layers at 64% (int8) and 68% (FP8) of the read
bandwidth, the 4-bit GEMV at 18% (tinygemm, first in `auto`, at 38%): docs/gpu.md.

Triton is optional (`pip install triton`; CUDA builds of torch bring it). With
TRITON_INTERPRET=1 the same kernel runs on the CPU through Triton's interpreter, which is how
the test suite checks it against the reference path on machines without a GPU.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

MAX_ROWS = 64  # decode batches; prefill runs the reference path
ROW_BLOCKS = (16, 32, 64)  # tl.dot needs 16 rows at least; a batch of 1 pads to 16 (memory-bound anyway)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable(device: torch.device) -> Optional[str]:
    """Why the Triton kernels cannot run for tensors on `device`, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return None
    return f"tensors on {device}: Triton runs on CUDA (or on the CPU with TRITON_INTERPRET=1)"


def _kernels():
    """The jitted kernels. Their module imports triton, which reads TRITON_INTERPRET once, on first use."""
    from lowbit.quantize.runtime import triton_byte_matmul

    return triton_byte_matmul


class ByteWeightKernel:
    """y = x @ (bytes * scale[row]).T + bias, for int8 codes or FP8 E4M3 bytes of shape (N, K)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]):
        self.fp8 = weight.dtype == torch.float8_e4m3fn
        self.weight = weight.contiguous().view(torch.int8)  # (N, K) bytes, read once per call
        self.scale = scale.reshape(-1).float().contiguous()  # (N,)
        self.bias = bias
        self.nbytes = self.weight.nbytes + self.scale.nbytes  # read per call

    def accepts(self, x: torch.Tensor) -> bool:
        return x.device == self.weight.device and x.numel() // x.shape[-1] <= MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        (m, k), n = x2.shape, self.weight.shape[0]
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        kernels = _kernels()
        bias = self.bias if self.bias is not None else self.scale  # any pointer; not read
        flags = dict(K=k, FP8=self.fp8, HAS_BIAS=self.bias is not None)
        if m == 1:
            kernels.byte_weight_gemv[lambda meta: (-(-n // meta["BLOCK_N"]),)](
                x2, self.weight, self.scale, bias, y, n, **flags)
        else:
            block_m = next(b for b in ROW_BLOCKS if m <= b)
            grid = lambda meta: (-(-m // block_m), -(-n // meta["BLOCK_N"]))  # noqa: E731
            kernels.byte_weight_matmul[grid](x2, self.weight, self.scale, bias, y, m, n, IEEE=x.dtype == torch.float32,
                                             BLOCK_M=block_m, **flags)
        return y.reshape(*x.shape[:-1], n)


class Int4Gemv:
    """Batch-1 decode with 4-bit group codes, two per byte; other batch sizes take the reference path."""

    def __init__(self, module):
        u = (module.weight_codes.to(torch.int16) + 8).to(torch.uint8)  # codes -8..7 stored unsigned
        self.packed = (u[:, ::2] | (u[:, 1::2] << 4)).contiguous()  # (N, K / 2)
        self.scale = module.weight_scale.float().contiguous()  # (N, K / group)
        self.zero = None if module.weight_zero is None else module.weight_zero.float().contiguous()
        self.group, self.bias = module.scheme.group_size, module.bias
        self.nbytes = self.packed.nbytes + self.scale.nbytes + (0 if self.zero is None else self.zero.nbytes)

    def accepts(self, x: torch.Tensor) -> bool:
        return x.device == self.packed.device and x.numel() == x.shape[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.packed.shape[0], x.shape[-1]
        y = torch.empty(n, dtype=x.dtype, device=x.device)
        zero = self.zero if self.zero is not None else self.scale  # any pointer; not read
        _kernels().int4_gemv[lambda meta: (-(-n // meta["BLOCK_N"]),)](
            x.reshape(-1).contiguous(), self.packed, self.scale, zero, y, n, K=k, GROUP=self.group,
            HAS_ZERO=self.zero is not None)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], n)


def int4_group(module):
    """QuantLinear with 4-bit (or narrower) group codes, groups of 32 or more, no act-order g_idx."""
    s, k = module.scheme, module.in_features
    if s.bits > 4 or s.strategy != "group" or s.group_size < 32 or k % s.group_size:
        return None, "needs <= 4-bit codes in groups of 32 or more dividing in_features"
    if module.weight_g_idx is not None:
        return None, "act-order g_idx is not supported"
    return Int4Gemv(module), None


def for_quantlinear(module):
    """A Triton kernel for a weight-only QuantLinear: byte codes per channel, or 4-bit groups (batch 1)."""
    s = module.scheme
    why = unavailable(module.weight_codes.device)
    if why is None and s.strategy == "group":
        return int4_group(module)
    if why is None and (not s.symmetric or s.strategy != "channel"):
        why = "needs symmetric per-channel codes, or <= 4-bit group codes"
    if why:
        return None, why
    # per-channel: an act-order g_idx (all zeros) changes nothing
    return ByteWeightKernel(module.weight_codes, module.weight_scale[:, 0], module.bias), None


def fp8_weight_only(module):
    """FP8Linear with E4M3 weights, per-channel or per-tensor scales, and float activations."""
    why = unavailable(module.weight.device)
    if why is None and module.activations != "none":
        why = "FP8 activations run torch._scaled_mm (W8A8), not a weight-only kernel"
    if why is None and (module.fmt != "e4m3" or module.weight_strategy not in ("tensor", "channel")):
        why = "needs E4M3 weights with a per-tensor or per-channel scale"
    if why:
        return None, why
    scale = module.weight_scale.float().reshape(-1).expand(module.out_features)
    return ByteWeightKernel(module.weight, scale, module.bias), None
