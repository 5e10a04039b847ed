"""The CPU description every CPU-dependent choice reads: detection from flags and the overrides."""
from __future__ import annotations

import pytest

from lowbit.calibrate.hardware import cpu_info, resolve

ZEN4 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                  "avx512_vnni"})
CASCADE_LAKE = ZEN4 - {"avx512_bf16"}
SKYLAKE_X = CASCADE_LAKE - {"avx512_vnni"}
ZEN2 = frozenset({"avx2", "fma", "f16c"})
GRAVITON3 = frozenset({"fp", "asimd", "sve", "bf16"})


@pytest.mark.parametrize("flags, isa, bf16, int8", [
    (ZEN4, "avx512", True, True), (CASCADE_LAKE, "avx512", False, True), (SKYLAKE_X, "avx512", False, False),
    (ZEN2, "avx2", False, False),
    (frozenset({"avx2", "fma"}), "none", False, False),  # no F16C: the AVX2 kernels' FP8 decode needs it
    (GRAVITON3, "none", True, False), (frozenset(), "none", False, False),
])
def test_detects_variant_bf16_and_int8_from_flags(flags, isa, bf16, int8):
    info = resolve(flags, "x86_64", {})
    assert (info.isa, info.native_isa, info.bf16_native, info.int8_native, info.forced) == (isa, isa, bf16, int8, "")


def test_forcing_a_lesser_variant_models_a_cpu_without_bf16():
    info = resolve(ZEN4, "x86_64", {"LOWBIT_CPU_ISA": "avx2"})
    assert (info.isa, info.native_isa, info.bf16_native, info.int8_native) == ("avx2", "avx512", False, False)
    assert "LOWBIT_CPU_ISA=avx2" in info.forced and "forced" in info.describe()
    assert resolve(ZEN4, "x86_64", {"LOWBIT_CPU_ISA": "none"}).isa == "none"
    both = resolve(ZEN4, "x86_64", {"LOWBIT_CPU_ISA": "avx2", "LOWBIT_CPU_BF16": "native"})
    assert both.bf16_native and both.isa == "avx2"


def test_bf16_and_int8_overrides_alone():
    assert not resolve(ZEN4, "x86_64", {"LOWBIT_CPU_BF16": "emulated"}).bf16_native
    assert resolve(ZEN2, "x86_64", {"LOWBIT_CPU_BF16": "native"}).bf16_native
    no_vnni = resolve(ZEN4, "x86_64", {"LOWBIT_CPU_INT8": "emulated"})
    assert not no_vnni.int8_native and no_vnni.bf16_native and "LOWBIT_CPU_INT8=emulated" in no_vnni.forced
    assert resolve(ZEN2, "x86_64", {"LOWBIT_CPU_INT8": "native"}).int8_native


@pytest.mark.parametrize("env, words", [
    ({"LOWBIT_CPU_ISA": "sse"}, ["LOWBIT_CPU_ISA", "avx512, avx2, none"]),
    ({"LOWBIT_CPU_BF16": "yes"}, ["LOWBIT_CPU_BF16", "native, emulated"]),
    ({"LOWBIT_CPU_INT8": "vnni"}, ["LOWBIT_CPU_INT8", "native, emulated"]),
])
def test_bad_values_name_the_variable_and_valid_values(env, words):
    with pytest.raises(ValueError) as err:
        resolve(ZEN4, "x86_64", env)
    assert all(w in str(err.value) for w in words)


def test_cannot_force_more_than_the_cpu_has():
    with pytest.raises(ValueError, match="only has avx2.*avx2, none"):
        resolve(ZEN2, "x86_64", {"LOWBIT_CPU_ISA": "avx512"})


def test_cpu_info_follows_the_environment(monkeypatch):
    for name in ("LOWBIT_CPU_ISA", "LOWBIT_CPU_BF16", "LOWBIT_CPU_INT8", "ONEDNN_MAX_CPU_ISA"):  # may run forced
        monkeypatch.delenv(name, raising=False)
    native = cpu_info()
    monkeypatch.setenv("LOWBIT_CPU_ISA", "none")
    assert cpu_info().isa == "none" and cpu_info().native_isa == native.native_isa
    monkeypatch.delenv("LOWBIT_CPU_ISA")
    assert cpu_info() == native


def test_a_onednn_cap_below_a_feature_makes_it_absent():
    zen4 = ZEN4 | {"avx512_vnni"}
    assert resolve(zen4, "x86_64", {}).int8_native
    capped = resolve(zen4, "x86_64", {"ONEDNN_MAX_CPU_ISA": "avx2"})
    assert not capped.bf16_native and not capped.int8_native and "ONEDNN_MAX_CPU_ISA=avx2" in capped.forced
    vnni = resolve(zen4, "x86_64", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"})
    assert vnni.int8_native and not vnni.bf16_native
    for no_cap in ("ALL", "DEFAULT", ""):
        info = resolve(zen4, "x86_64", {"ONEDNN_MAX_CPU_ISA": no_cap})
        assert info.int8_native and info.bf16_native and info.forced == ""
