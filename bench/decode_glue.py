"""The element-wise work between a decoder layer's linears, fused the way a compiled decode step
runs it (one kernel for residual add + RMSNorm, one for SiLU(gate) * up), so that a timed step
is the linears plus what any serving engine must add, not eager PyTorch's launch overhead.
Triton kernels on a GPU; eager PyTorch with the same maths elsewhere (and with --glue eager)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-6


def _triton_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm(h_ptr, d_ptr, out_ptr, H: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, eps):
        cols = tl.arange(0, BLOCK)
        at = tl.program_id(0) * H + cols
        h = tl.load(h_ptr + at, mask=cols < H, other=0.0).to(tl.float32)
        if ADD:  # the residual stream takes the sublayer's output in place
            h += tl.load(d_ptr + at, mask=cols < H, other=0.0).to(tl.float32)
            tl.store(h_ptr + at, h.to(h_ptr.dtype.element_ty), mask=cols < H)
        a = h * tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)
        tl.store(out_ptr + at, a.to(out_ptr.dtype.element_ty), mask=cols < H)

    @triton.jit
    def silu_mul(gu_ptr, out_ptr, I: tl.constexpr, BLOCK: tl.constexpr):
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        row = tl.program_id(0)
        g = tl.load(gu_ptr + row * 2 * I + cols, mask=cols < I, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=cols < I, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * I + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=cols < I)

    return add_rms_norm, silu_mul


class Glue:
    """add_norm(h, d) -> RMSNorm(h + d), adding d into h in place; silu_mul(gate_up) -> SiLU(gate) * up."""

    def __init__(self, fused: bool):
        self.fused = fused
        if fused:
            import triton

            self._add_norm, self._silu_mul = _triton_kernels()
            self._pow2 = triton.next_power_of_2

    def add_norm(self, h: torch.Tensor, d: torch.Tensor | None) -> torch.Tensor:
        if not self.fused:
            if d is not None:
                h += d
            return F.rms_norm(h, (h.shape[-1],), eps=EPS)
        out = torch.empty_like(h)
        n = h.shape[-1]
        self._add_norm[(h.shape[0],)](h, h if d is None else d, out, H=n, BLOCK=self._pow2(n), ADD=d is not None,
                                      eps=EPS)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        i = gate_up.shape[-1] // 2
        if not self.fused:
            return F.silu(gate_up[:, :i]) * gate_up[:, i:]
        out = torch.empty(gate_up.shape[0], i, dtype=gate_up.dtype, device=gate_up.device)
        self._silu_mul[(gate_up.shape[0], -(-i // 1024))](gate_up, out, I=i, BLOCK=1024)
        return out
