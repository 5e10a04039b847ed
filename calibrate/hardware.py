"""What this CPU does well, read once: which kernel variant it runs and whether bf16 is native.

Every choice that depends on the CPU (the decode kernels' instruction set, the compute dtype of
calibration forwards, int8 or float32 matmuls for W8A8) asks `cpu_info()`, so one environment
variable can make a machine behave like a lesser one, and tests run every path on the machine
they have:

  LOWBIT_CPU_ISA=avx512|avx2|none   the kernel variant (at most what the CPU has; none: the
                                    reference path, as on ARM or pre-AVX2 x86)
  LOWBIT_CPU_BF16=native|emulated   whether bf16 matmuls are fast here (default: the CPU's
                                    AVX512-BF16 / AMX-BF16 / ARM BF16 flags, and emulated
                                    whenever LOWBIT_CPU_ISA forces a variant below avx512)
  LOWBIT_CPU_INT8=native|emulated   whether torch._int_mm is fast here (default: AVX512-VNNI or
                                    AMX-INT8, the flags torch 2.x needs to run it on oneDNN; without
                                    them it runs a scalar loop, ~6x slower than a float32 matmul;
                                    emulated whenever LOWBIT_CPU_ISA forces a variant below avx512)
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

ISAS = ("avx512", "avx2", "none")  # best first
ISA_ENV, BF16_ENV, INT8_ENV = "LOWBIT_CPU_ISA", "LOWBIT_CPU_BF16", "LOWBIT_CPU_INT8"

# what each kernel variant is compiled for (csrc/ builds with the matching -m flags)
ISA_FLAGS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"},
    "avx2": {"avx2", "fma", "f16c"},
    "none": set(),
}
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX512-BF16 / AMX, aarch64 FEAT_BF16
# torch's CPU _int_mm calls oneDNN only where at::cpu::is_avx512_vnni_supported() (AMX-INT8 CPUs
# have VNNI too); elsewhere, ARM included, it falls back to a scalar triple loop
INT8_FLAGS = {"avx512_vnni", "amx_int8"}
# oneDNN's own cap, lowest first: torch's CPU bf16 and int8 matmuls run on oneDNN, so a cap below a
# feature makes it as absent as a CPU without it. With the cap below VNNI on a VNNI CPU, torch
# 2.13's CPU _int_mm even returns wrong sums (its dispatch reads the CPU flag, not the cap).
ONEDNN_CAP_ENV = "ONEDNN_MAX_CPU_ISA"
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
               "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16")


@dataclass(frozen=True)
class CpuInfo:
    isa: str  # the kernel variant to run: one of ISAS
    native_isa: str  # the best variant the CPU itself has
    bf16_native: bool  # bf16 matmuls run in hardware (else torch emulates them, several x slower)
    int8_native: bool  # torch._int_mm runs on oneDNN VNNI kernels (else a scalar loop)
    forced: str  # which environment variables changed the answer ("" when none)
    machine: str  # platform.machine(): x86_64, aarch64, ...

    def to_dict(self) -> dict:
        return {"isa": self.isa, "native_isa": self.native_isa, "bf16_native": self.bf16_native,
                "int8_native": self.int8_native, "forced": self.forced, "machine": self.machine}

    def describe(self) -> str:
        bf16 = "native bf16" if self.bf16_native else "bf16 emulated"
        int8 = "native int8 matmul" if self.int8_native else "int8 matmul emulated"
        forced = f", forced by {self.forced}" if self.forced else ""
        return f"{self.machine} {self.isa} kernels, {bf16}, {int8}{forced}"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 'flags', aarch64 'Features'); empty
    where there is no such file (macOS, Windows)."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return frozenset()
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_isa(flags: frozenset[str]) -> str:
    for isa in ISAS:
        if ISA_FLAGS[isa] <= flags:
            return isa
    return "none"


def resolve(flags: frozenset[str], machine: str, env: dict) -> CpuInfo:
    """CpuInfo for these flags under these environment variables (pure: tests pass any CPU)."""
    best = native_isa(flags)
    isa, forced = best, []
    wanted = env.get(ISA_ENV, "").strip().lower()
    if wanted:
        if wanted not in ISAS:
            raise ValueError(f"{ISA_ENV}={wanted!r}: valid values are {', '.join(ISAS)}")
        if ISAS.index(wanted) < ISAS.index(best):
            raise ValueError(f"{ISA_ENV}={wanted}: this CPU ({machine}) only has {best}; "
                             f"valid values here are {', '.join(ISAS[ISAS.index(best):])}")
        isa = wanted
        forced.append(f"{ISA_ENV}={wanted}")
    lesser = isa != best  # a forced lesser variant models a CPU without bf16 or VNNI
    has_bf16, has_int8 = bool(flags & BF16_FLAGS) and not lesser, bool(flags & INT8_FLAGS) and not lesser
    capped_bf16 = has_bf16 and onednn_allows(env, "AVX512_CORE_BF16")
    capped_int8 = has_int8 and onednn_allows(env, "AVX512_CORE_VNNI")
    if (capped_bf16, capped_int8) != (has_bf16, has_int8):
        forced.append(f"{ONEDNN_CAP_ENV}={env[ONEDNN_CAP_ENV]}")
    bf16 = _native_override(env, BF16_ENV, capped_bf16, forced)
    int8 = _native_override(env, INT8_ENV, capped_int8, forced)
    return CpuInfo(isa, best, bf16, int8, " ".join(forced), machine)


def onednn_allows(env: dict, level: str) -> bool:
    """Whether ONEDNN_MAX_CPU_ISA (unset, ALL, DEFAULT or a name we do not know: no cap) lets
    oneDNN use `level` (one of ONEDNN_ISAS)."""
    cap = env.get(ONEDNN_CAP_ENV, "").strip().upper()
    return cap not in ONEDNN_ISAS or ONEDNN_ISAS.index(cap) >= ONEDNN_ISAS.index(level)


def _native_override(env: dict, name: str, detected: bool, forced: list) -> bool:
    """`detected`, unless env[name] is native or emulated (then noted in forced)."""
    wanted = env.get(name, "").strip().lower()
    if not wanted:
        return detected
    if wanted not in ("native", "emulated"):
        raise ValueError(f"{name}={wanted!r}: valid values are native, emulated")
    forced.append(f"{name}={wanted}")
    return wanted == "native"


ENV_NAMES = (ISA_ENV, BF16_ENV, INT8_ENV, ONEDNN_CAP_ENV)


@functools.cache
def _cached(values: tuple[str, ...]) -> CpuInfo:
    return resolve(cpu_flags(), platform.machine(), dict(zip(ENV_NAMES, values)))


def cpu_info() -> CpuInfo:
    """This CPU as the environment says to treat it (re-read when the variables change)."""
    return _cached(tuple(os.environ.get(name, "") for name in ENV_NAMES))


def available_memory_bytes() -> int | None:
    """What the kernel says can be allocated without swapping (MemAvailable), or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_device_name(name: str, key: str) -> None:
    if not isinstance(name, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise ValueError(f"{key} must be auto, cpu, cuda or cuda:N, got {name!r}")


def resolve_device(name: str, key: str = "calibration.device"):
    """The torch device `name` stands for here: auto is the first GPU where torch sees one (in one
    process), else the CPU; a GPU asked for that is not there is an error naming the key."""
    import torch

    from .distributed import world

    check_device_name(name, key)
    if world().size > 1:
        return rank_device(name, key)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"{key} is {name!r}, but torch sees {count} CUDA device(s) here"
                             f"{'' if count else ' (a CPU-only torch build, or no GPU)'}; valid: auto, cpu"
                             + "".join(f", cuda:{i}" for i in range(count)))
    return device


def rank_device(name: str, key: str):
    """Under torchrun each rank calibrates on its own GPU, cuda:LOCAL_RANK (statistics reduced by
    NCCL), or every rank on the CPU (gloo); auto takes the GPUs when every rank here has one, as
    the group's backend does (distributed.group_backend)."""
    import torch

    from .distributed import gpus_here, local_world_size

    gpus, ranks_here = gpus_here(), local_world_size()
    if name == "cpu" or (name == "auto" and ranks_here > gpus):
        return torch.device("cpu")
    if ":" in name:
        raise ValueError(f"{key} is {name!r}, but under torchrun (--nproc) each rank takes the GPU of its "
                         "LOCAL_RANK: use cuda, auto or cpu")
    if gpus == 0:
        raise ValueError(f"{key} is {name!r}, but torch sees no CUDA device here (a CPU-only torch build, "
                         "or no GPU); valid: auto, cpu")
    if ranks_here > gpus:
        raise ValueError(f"{key} is {name!r}, but {ranks_here} ranks run on this machine and torch sees "
                         f"{gpus} CUDA device(s): use --nproc {gpus} or fewer, or --device cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


@functools.lru_cache(maxsize=1)
def _glibc():
    """The C library when it is glibc (Linux), else None: malloc_trim is glibc's."""
    if platform.libc_ver()[0] != "glibc":
        return None
    import ctypes

    return ctypes.CDLL(None)


def return_freed_memory() -> None:
    """Give the memory freed so far back to the operating system. glibc keeps freed blocks below
    its (self-raising) mmap threshold in its heap: after a streamed layer of Llama-3-8B widths is
    let go, 0.4 GiB stayed resident and the next layer's load stacked on top of it
    (bench/scale.py --task rtn: peak 1.79 GiB without, 1.39 GiB with). Elsewhere a no-op."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def denormals_flushed():
    """Within it the CPU reads subnormal floats as zero. Learned rounding's gradients and sign steps
    fall into them in deep layers, where x86 takes a slow path for each: on smollm2 signround's layers
    20-25 took 44-54 s instead of ~20 s, and flushing wrote the same checkpoint bytes. Torch's
    default (off) is restored after; where the CPU cannot flush, nothing changes."""
    import torch

    flushing = torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if flushing:
            torch.set_flush_denormal(False)
