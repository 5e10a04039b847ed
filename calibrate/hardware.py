"""What this CPU does well, read once: which kernel variant it runs and whether bf16 is native.

Every choice that depends on the CPU (the decode kernels' instruction set, the compute dtype of
calibration forwards) asks `cpu_info()`, so one environment variable can make a machine behave
like a lesser one, and tests run every path on the machine they have:

  LOWBIT_CPU_ISA=avx512|avx2|none   the kernel variant (at most what the CPU has; none: the
                                    reference path, as on ARM or pre-AVX2 x86)
  LOWBIT_CPU_BF16=native|emulated   whether bf16 matmuls are fast here (default: the CPU's
                                    AVX512-BF16 / AMX-BF16 / ARM BF16 flags, and emulated
                                    whenever LOWBIT_CPU_ISA forces a variant below avx512)
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

ISAS = ("avx512", "avx2", "none")  # best first
ISA_ENV, BF16_ENV = "LOWBIT_CPU_ISA", "LOWBIT_CPU_BF16"

# what each kernel variant is compiled for (csrc/ builds with the matching -m flags)
ISA_FLAGS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"},
    "avx2": {"avx2", "fma", "f16c"},
    "none": set(),
}
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX512-BF16 / AMX, aarch64 FEAT_BF16


@dataclass(frozen=True)
class CpuInfo:
    isa: str  # the kernel variant to run: one of ISAS
    native_isa: str  # the best variant the CPU itself has
    bf16_native: bool  # bf16 matmuls run in hardware (else torch emulates them, several x slower)
    forced: str  # which environment variables changed the answer ("" when none)
    machine: str  # platform.machine(): x86_64, aarch64, ...

    def to_dict(self) -> dict:
        return {"isa": self.isa, "native_isa": self.native_isa, "bf16_native": self.bf16_native,
                "forced": self.forced, "machine": self.machine}

    def describe(self) -> str:
        bf16 = "native bf16" if self.bf16_native else "bf16 emulated"
        forced = f", forced by {self.forced}" if self.forced else ""
        return f"{self.machine} {self.isa} kernels, {bf16}{forced}"


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
    bf16 = bool(flags & BF16_FLAGS) and isa == best  # a forced lesser variant models a CPU without it
    wanted_bf16 = env.get(BF16_ENV, "").strip().lower()
    if wanted_bf16:
        if wanted_bf16 not in ("native", "emulated"):
            raise ValueError(f"{BF16_ENV}={wanted_bf16!r}: valid values are native, emulated")
        bf16 = wanted_bf16 == "native"
        forced.append(f"{BF16_ENV}={wanted_bf16}")
    return CpuInfo(isa, best, bf16, " ".join(forced), machine)


@functools.cache
def _cached(isa_env: str, bf16_env: str) -> CpuInfo:
    return resolve(cpu_flags(), platform.machine(), {ISA_ENV: isa_env, BF16_ENV: bf16_env})


def cpu_info() -> CpuInfo:
    """This CPU as the environment says to treat it (re-read when the variables change)."""
    return _cached(os.environ.get(ISA_ENV, ""), os.environ.get(BF16_ENV, ""))
