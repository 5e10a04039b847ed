"""Shared fixtures: tiny random models of several architectures, and the real smollm2-135m."""
from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on the CPU (tests/test_triton_kernels.py).
# Triton reads this once, when it is first imported, so it is set before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import ARCH_TYPES, make_tiny_model, tiny_config  # noqa: F401  (re-exported)


@pytest.fixture(params=["llama", "qwen2", "gemma3_text", "opt"])
def tiny_model(request):
    return make_tiny_model(request.param)


@pytest.fixture
def tiny_llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real built-in model, fetched and cached on first use."""
    from lowbit.calibrate.models import load_model

    model, tokenizer, _ = load_model("smollm2-135m")
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A 2-layer random llama folder on disk (model_folders.save_tiny_folder), one per test module."""
    from model_folders import save_tiny_folder

    return save_tiny_folder(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def model_copy(tiny_folder, tmp_path):
    """A copy of tiny_folder that a test may damage."""
    from model_folders import copy_folder

    return copy_folder(tiny_folder, tmp_path / "model")


@pytest.fixture
def tiny_tokenizer_dir(tmp_path_factory):
    """The smollm2 tokenizer folder (small files), for pipelines on tiny models."""
    from lowbit.calibrate.models import resolve_model_path

    return resolve_model_path("smollm2-135m")


def _force_cpu_variant(variant: str, monkeypatch) -> str:
    """Treat this CPU as `variant` (LOWBIT_CPU_ISA); skipped, saying so, where the CPU lacks it."""
    from lowbit.calibrate.hardware import ISAS, cpu_info

    native = cpu_info().native_isa
    if ISAS.index(variant) < ISAS.index(native):
        pytest.skip(f"CPU without {variant} (its best kernel variant: {native})")
    monkeypatch.setenv("LOWBIT_CPU_ISA", variant)
    return variant


@pytest.fixture(params=["avx512", "avx2"])
def kernel_variant(request, monkeypatch):
    """Each CPU kernel variant this CPU can run, forced in turn."""
    return _force_cpu_variant(request.param, monkeypatch)


@pytest.fixture(params=["avx512", "avx2", "none"])
def cpu_variant(request, monkeypatch):
    """kernel_variant, plus none: no kernels, the reference path (as on ARM or old x86)."""
    return _force_cpu_variant(request.param, monkeypatch)
