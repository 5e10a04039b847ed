"""Every runtime backend must give the reference path's output (dequantize + F.linear).

The CPU tests run once per kernel variant this CPU has (conftest's kernel_variant / cpu_variant
force each with LOWBIT_CPU_ISA), and for cpu_variant once more with none: the reference path."""
from __future__ import annotations

import re
import shutil
import subprocess
import warnings

import pytest
import torch
from torch import nn

from lowbit.calibrate.hardware import cpu_info
from lowbit.quantize.runtime import backends
from lowbit.quantize.runtime import cpu_kernels
from lowbit.quantize.grids.integer import IntScheme, quantize_rtn
from lowbit.quantize.runtime.qlinear import QuantLinear

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

SCHEMES = [
    IntScheme(4, True, "group", 32),
    IntScheme(4, False, "group", 128),
    IntScheme(4, True, "group", 16),
    IntScheme(4, False, "channel"),
    IntScheme(3, False, "group", 64),
    IntScheme(8, True, "channel"),
    IntScheme(8, False, "group", 64),
    IntScheme(8, True, "tensor"),
    IntScheme(6, True, "group", 32),
]
# (out, in); 200 rows: uneven split across threads; 1088 inputs: a partial last column tile;
# 66 rows: the last four-row tile of the bf16 kernel is padded
SHAPES = [(64, 256), (200, 512), (48, 1024), (40, 1088), (66, 192)]


def make_layer(out: int, inp: int, scheme: IntScheme, bias: bool = True, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05 + 0.01  # an offset exercises zero points
    b = torch.randn(out, generator=g) if bias else None
    return QuantLinear.from_quantized(quantize_rtn(w, scheme), b)


def cpu_backend(variant: str) -> str:
    return "auto" if variant == "none" else f"cpu_{variant}"


def assert_matches_reference(layer: QuantLinear, x: torch.Tensor, backend: str, rtol: float = 1e-5):
    """The kernel's output equals the reference path's to rtol (of the largest output). A kernel
    with bf16 dot products (4-bit; 8-bit in batches) rounds x to bf16 first (16-bit activations);
    it must then equal the reference on that rounded x just as tightly (1e-4: fp32 sums in
    another order), and the unrounded reference to bf16 precision. "auto" on a CPU treated as
    having no kernel variant must keep the reference path and say why."""
    expected = layer(x)  # no kernel attached yet: the reference path
    expected_bf16_x = layer(x.bfloat16().to(x.dtype))
    chosen = backends.prepare(layer, backend)
    if backend == "auto" and x.is_cpu:
        assert chosen[""].startswith("reference (no CPU kernel variant: LOWBIT_CPU_ISA=none"), chosen
        assert layer.kernel is None and torch.equal(layer(x), expected)
        return
    assert chosen[""] == backend, chosen
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    scale = expected.abs().max().item()
    layout = getattr(layer.kernel, "layout", None)
    if layout is not None and layout.bf16_activations(x.numel() // x.shape[-1]):
        assert (got - expected_bf16_x).abs().max().item() <= max(rtol, 1e-4) * scale + 1e-6
        rtol = max(rtol, 1e-2)
    assert (got - expected).abs().max().item() <= rtol * scale + 1e-6


# every scheme with every shape whose in_features its groups divide (no skipped combinations)
SCHEME_SHAPES = [(s, shape) for s in SCHEMES for shape in SHAPES if not (s.group_size and shape[1] % s.group_size)]


@pytest.mark.parametrize("scheme, shape", SCHEME_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_cpu_kernels_match_reference(scheme, shape, rows, cpu_variant):
    layer = make_layer(*shape, scheme)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1))
    assert_matches_reference(layer, x, cpu_backend(cpu_variant))


@pytest.mark.parametrize("leading", [(3,), (2, 5), (1, 1)])
def test_cpu_kernels_take_any_leading_shape_and_odd_row_counts(leading, cpu_variant):
    layer = make_layer(96, 256, IntScheme(4, False, "group", 32))
    x = torch.randn(*leading, 256)
    assert_matches_reference(layer, x, cpu_backend(cpu_variant))


def test_cpu_kernels_keep_bf16_activations_in_bf16(cpu_variant):
    layer = make_layer(64, 256, IntScheme(4, True, "group", 64))
    x = torch.randn(2, 256).bfloat16()
    assert_matches_reference(layer, x, cpu_backend(cpu_variant), rtol=1e-2)


@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_kernels_follow_act_order_groups(bits, cpu_variant):
    scheme = IntScheme(bits, False, "group", 32)
    layer = make_layer(64, 256, scheme)
    g_idx = torch.randperm(256, generator=torch.Generator().manual_seed(2)) // 32  # shuffled groups
    layer.weight_g_idx = g_idx.to(torch.int32)
    assert_matches_reference(layer, torch.randn(3, 256), cpu_backend(cpu_variant))


@pytest.mark.parametrize("group", [64, 128, None])
def test_4bit_layers_use_bf16_dot_products_where_the_cpu_has_them(group, kernel_variant, monkeypatch):
    scheme = IntScheme(4, group is None, "channel" if group is None else "group", group)
    layer = make_layer(72, 512, scheme)
    backend = cpu_backend(kernel_variant)
    backends.prepare(layer, backend)
    expected = (kernel_variant == "avx512" and cpu_kernels.load("avx512").has_avx512_bf16()
                and cpu_info().bf16_native)  # e.g. not under an ONEDNN_MAX_CPU_ISA cap
    assert layer.kernel.layout.bf16_dot == expected == cpu_kernels.bf16_dot_available()
    monkeypatch.setenv("LOWBIT_CPU_BF16_DOT", "0")  # the opt-out gives the float32-activation kernel
    backends.prepare(layer, backend)
    assert not layer.kernel.layout.bf16_dot
    assert_matches_reference(make_layer(72, 512, scheme), torch.randn(3, 512), backend)


def test_large_batches_take_the_reference_path(kernel_variant):
    layer = make_layer(64, 256, IntScheme(4, True, "group", 32))
    backends.prepare(layer, cpu_backend(kernel_variant))
    x = torch.randn(cpu_kernels.MAX_ROWS + 1, 256)
    assert not layer.kernel.accepts(x)
    assert layer.kernel.accepts(x[:1])


def test_auto_picks_the_cpu_variant_and_reference_clears_it(kernel_variant):
    layer = make_layer(64, 256, IntScheme(4, True, "group", 32))
    assert backends.prepare(layer, "auto") == {"": f"cpu_{kernel_variant}"}
    assert layer.kernel.variant == kernel_variant
    assert backends.prepare(layer, "reference") == {"": "reference"}
    assert layer.kernel is None


def test_a_variant_above_the_forced_one_is_refused_with_the_reason(monkeypatch):
    layer = make_layer(64, 256, IntScheme(4, True, "group", 32))
    monkeypatch.setenv("LOWBIT_CPU_ISA", "none")
    chosen = backends.prepare(layer, "cpu_avx2")[""]
    assert layer.kernel is None
    native = cpu_kernels.cpu_info().native_isa
    if native == "none":
        assert chosen.startswith("reference (cpu_avx2: this ") and "CPU has no avx2" in chosen
    else:
        assert chosen == "reference (cpu_avx2: LOWBIT_CPU_ISA=none limits this CPU to none)"


def test_the_avx2_module_holds_no_avx512_instruction(kernel_variant):
    """Built with -mavx2 -mfma -mf16c only: no zmm register and no opmask anywhere in its code, so
    a CPU without AVX-512 never meets an illegal instruction."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump on PATH")
    disassembly = subprocess.run([objdump, "-d", cpu_kernels.load(kernel_variant).__file__], check=True,
                                 capture_output=True, text=True).stdout
    uses_avx512 = re.search(r"%zmm|%k[0-7]\b|\{%k", disassembly) is not None
    assert uses_avx512 == (kernel_variant == "avx512")  # the avx512 module must show them: the check sees them


def test_unsupported_layers_keep_the_reference_path_and_say_why():
    layer = make_layer(64, 200, IntScheme(4, True, "group", 40))  # 40-column groups: no kernel
    chosen = backends.prepare(layer, "auto")
    assert layer.kernel is None and chosen[""].startswith("reference (")
    cuda = backends.prepare(layer, "cuda_int4")
    assert "not a CUDA device" in cuda[""]


def test_unknown_backend_names_the_valid_ones():
    with pytest.raises(ValueError, match="cpu_avx512"):
        backends.prepare(nn.Linear(4, 4), "avx9000")


def test_a_failed_build_warns_and_falls_back(kernel_variant, monkeypatch):
    def broken(variant):
        raise OSError(f"no compiler for {variant}")

    monkeypatch.setattr(cpu_kernels, "_build", broken)
    cpu_kernels._warn_once.cache_clear()  # warned once per reason: this test must see it
    with pytest.warns(RuntimeWarning, match=f"no compiler for {kernel_variant}"):
        assert cpu_kernels.load() is None
    layer = make_layer(64, 256, IntScheme(4, True, "group", 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = backends.prepare(layer, "auto")[""]
    assert chosen == f"reference (cpu_{kernel_variant}: the extension did not build (see the warning))"


def test_prepared_model_gives_the_same_logits(tiny_llama, kernel_variant):
    from lowbit.calibrate.arch import arch_for
    from lowbit.quantize.steps import rtn
    from lowbit.quantize.steps.context import StepContext

    ctx = StepContext(tiny_llama, arch_for(tiny_llama), (), lambda: None)
    rtn.apply(ctx, rtn.RTNConfig(IntScheme(4, False, "group", 32)))
    ids = torch.randint(0, 512, (2, 7))
    with torch.no_grad():
        expected = tiny_llama(ids[:, :1]).logits
        chosen = backends.prepare(tiny_llama, "auto")
        got = tiny_llama(ids[:, :1]).logits
    assert set(chosen.values()) == {f"cpu_{kernel_variant}"}
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("backend,scheme", [("cuda_int4", IntScheme(4, False, "group", 128)),
                                            ("cuda_int4", IntScheme(4, True, "group", 32)),
                                            ("cuda_int8", IntScheme(8, True, "channel"))])
@pytest.mark.parametrize("rows", [1, 8])
def test_cuda_kernels_match_reference(backend, scheme, rows):
    layer = make_layer(256, 1024, scheme).cuda()
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_matches_reference(layer, x, backend, rtol=2e-2)
