"""A kernel build killed half-way (Ctrl-C, SIGKILL, an OOM kill) must not hang every later run.

torch's extension builder guards a build folder with a plain `lock` file; a killed build leaves
it behind and the next load waits on it forever. Reproduced for real: a process compiling the
CPU kernels into a fresh cache is SIGKILLed (with its compiler children) while the file exists,
then another process loads the same kernels.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from lowbit.calibrate.hardware import cpu_info

LOAD = "from lowbit.quantize.runtime import cpu_kernels; cpu_kernels.load({variant!r}); print('loaded')"


def start_load(variant: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOAD.format(variant=variant)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_build_killed_mid_compile_does_not_block_the_next_load(tmp_path):
    variant = cpu_info().native_isa
    if variant == "none":
        pytest.skip("this CPU has no kernel variant to build (neither AVX-512 nor AVX2)")
    env = {**os.environ, "LOWBIT_CACHE": str(tmp_path / "cache"), "LOWBIT_CPU_ISA": variant}
    builds = tmp_path / "cache" / "kernels"
    first = start_load(variant, env)
    try:
        assert wait_for(lambda: any(builds.rglob("lock")), 120), "the build never took torch's lock"
        os.killpg(first.pid, signal.SIGKILL)  # the compiler too, as a terminal's Ctrl-C or the OOM killer would
    finally:
        first.wait(30)
    assert list(builds.rglob("lock")), "torch's lock file should outlive the killed build (the fault)"
    second = start_load(variant, env)
    try:
        out, err = second.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(second.pid, signal.SIGKILL)
        pytest.fail("the load after a killed build hung on the leftover lock file")
    assert second.returncode == 0 and "loaded" in out, err[-2000:]
