"""The Triton kernels behind triton_kernels.ByteWeightKernel: a GEMV for one row (decode at
batch 1, where tl.dot's 16-row minimum would waste the tile) and a tl.dot kernel for more. Importing this module imports
triton, which decides once, from TRITON_INTERPRET, whether kernels compile for the GPU or run
in its interpreter on the CPU."""
import os

import triton
import triton.language as tl

# what triton itself read on import: kernels run in its interpreter on the CPU, one config to try
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

# (rows of W per program, columns per step, warps, pipeline stages): few enough that a fresh
# machine tunes the four Llama-3-8B shapes in seconds
GPU_CONFIGS = ((16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3),
               (16, 512, 4, 3), (32, 512, 8, 3), (64, 256, 8, 3), (128, 128, 8, 3))
INTERPRETER_CONFIGS = ((16, 32, 1, 1),)  # one config: the interpreter has nothing to tune
GEMV_CONFIGS = ((4, 1024, 4, 2), (8, 512, 4, 2), (8, 1024, 4, 2), (8, 1024, 8, 3), (16, 512, 4, 2),
                (16, 512, 8, 3), (16, 1024, 8, 2), (32, 256, 4, 3), (32, 512, 8, 2), (8, 2048, 8, 2),
                (4, 2048, 8, 2), (64, 128, 4, 3))
MAGIC = tl.constexpr(8388608.0)  # 2**23: float32 bits 0x4B000000 | i, for an integer i < 2**23, are 2**23 + i

INT4_CONFIGS = ((8, 128, 4, 3), (16, 128, 4, 3), (32, 128, 4, 3), (64, 128, 4, 3), (16, 64, 4, 4),
                (32, 64, 4, 4), (8, 128, 2, 4), (64, 64, 8, 3), (16, 32, 4, 4), (32, 32, 4, 4))


def _within_a_group(configs, named_args, **kwargs) -> list:
    """int4_gemv's configs whose column block lies inside one scale group."""
    group = named_args.get("GROUP", kwargs.get("GROUP"))
    return [c for c in configs if group % c.kwargs["BLOCK_K"] == 0] or configs[:1]


def _configs(gpu_configs) -> list:
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for n, k, w, s in (INTERPRETER_CONFIGS if INTERPRETING else gpu_configs)]


@triton.autotune(_configs(GEMV_CONFIGS), key=["N", "K"])
@triton.jit
def byte_weight_gemv(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, K: tl.constexpr, FP8: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # summed across K once, at the end
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0)
        if FP8:
            wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            # int8 -> float32 without the conversion instruction (a quarter-rate one, which would
            # bound the GEMV): the byte + 128 in a float32's mantissa, then one subtraction
            b = w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80
            wf = (b | 0x4B000000).to(tl.float32, bitcast=True) - (MAGIC + 128.0)
        acc += wf * x[None, :]
    y = tl.sum(acc, axis=1) * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.autotune(_configs(GPU_CONFIGS), key=["N", "K", "BLOCK_M"])
@triton.jit
def byte_weight_matmul(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K: tl.constexpr, FP8: tl.constexpr,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    # K is a compile-time constant: the loop bound then needs no runtime scalar (Triton's
    # interpreter cannot loop to one under numpy >= 2.4)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0)
        if FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        # float32 operands: bf16 inputs, int8 codes and E4M3 values are all exact in TF32 (float32
        # inputs are not: IEEE then), and the interpreter has no bf16 matmul
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
    acc = acc * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.autotune(_configs(INT4_CONFIGS), key=["N", "K", "GROUP"],
                 prune_configs_by={"early_config_prune": _within_a_group})
@triton.jit
def int4_gemv(x_ptr, w_ptr, scale_ptr, zero_ptr, y_ptr, N, K: tl.constexpr, GROUP: tl.constexpr,
              HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # w: (N, K // 2) bytes, code 2j in the low nibble and 2j + 1 in the high one, each stored
    # + 8 (unsigned); scale and zero: (N, K // GROUP) float32; BLOCK_K <= GROUP is arranged by
    # the caller's configs (a block never straddles a group)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    half: tl.constexpr = BLOCK_K // 2
    acc = tl.zeros((BLOCK_N, half), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        js = k0 // 2 + tl.arange(0, half)
        packed = tl.load(w_ptr + cols[:, None] * (K // 2) + js[None, :], mask=cols[:, None] < N, other=0)
        packed = packed.to(tl.uint8, bitcast=True).to(tl.int32)
        x_even, x_odd = tl.split(tl.reshape(tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32), (half, 2)))
        offset = 8.0
        if HAS_ZERO:
            offset = 8.0 + tl.load(zero_ptr + cols * (K // GROUP) + k0 // GROUP, mask=cols < N, other=0.0)[:, None]
        s = tl.load(scale_ptr + cols * (K // GROUP) + k0 // GROUP, mask=cols < N, other=0.0)[:, None]
        # nibbles to float32 through the mantissa (as in byte_weight_gemv), not a conversion instruction
        lo = ((packed & 15) | 0x4B000000).to(tl.float32, bitcast=True) - MAGIC
        hi = ((packed >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - MAGIC
        acc += ((lo - offset) * x_even[None, :] + (hi - offset) * x_odd[None, :]) * s
    tl.store(y_ptr + cols, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=cols < N)
