"""The CPU FP8 kernel must give FP8Linear's reference output, and decode every FP8 byte exactly,
in every kernel variant this CPU has (conftest's kernel_variant / cpu_variant)."""
from __future__ import annotations

import pytest
import torch

from lowbit.quantize.runtime import backends

from lowbit.quantize.runtime import cpu_kernels
from lowbit.quantize.grids.fp8 import FP8_DTYPES, FP8Weight, quantize_weight_fp8
from lowbit.quantize.runtime.fp8_linear import FP8Linear


def make_fp8_layer(out: int, inp: int, fmt: str, strategy: str, activations: str) -> FP8Linear:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=g) * 0.05
    w[:, 3] *= 40  # an outlier column: block scales differ across the row
    static = torch.tensor(0.03) if activations == "static" else None
    return FP8Linear.from_weight(quantize_weight_fp8(w, strategy, fmt), torch.randn(out, generator=g), activations,
                                 static)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
@pytest.mark.parametrize("activations", ["dynamic", "static", "none"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_cpu_fp8_kernel_matches_reference(fmt, strategy, activations, rows, cpu_variant):
    layer = make_fp8_layer(200, 384, fmt, strategy, activations)  # 384: three 128-column blocks
    x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(1)) * 2
    expected, expected_bf16_x = layer(x), layer(x.bfloat16().float())
    chosen = backends.prepare(layer, "auto")[""]
    if cpu_variant == "none":  # no kernel: FP8Linear's own path, and the reason
        assert chosen.startswith("reference (no CPU kernel variant: LOWBIT_CPU_ISA=none") and layer.kernel is None
        assert torch.equal(layer(x), expected)
        return
    assert chosen == f"cpu_{cpu_variant}" and layer.kernel.variant == cpu_variant
    got = layer(x)
    assert got.shape == expected.shape
    scale = expected.abs().max()
    if layer.kernel.bf16_activations(rows):  # 16-bit inputs in a batch: rounded to bf16 first
        assert (got - expected_bf16_x).abs().max() <= 1e-5 * scale
        assert (got - expected).abs().max() <= 1e-2 * scale
    else:  # FP8-coded inputs are exact in bf16: batches stay as exact as batch 1
        assert (got - expected).abs().max() <= 1e-5 * scale
    assert layer.kernel.bf16_activations(rows) == (activations == "none" and rows > 1
                                                   and cpu_kernels.bf16_dot_available())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_fp8_byte_decodes_exactly(fmt, kernel_variant):
    """Row i of the weight holds byte i in column 0: a unit input reads each decoded value back."""
    codes = torch.zeros(256, 16, dtype=torch.uint8)
    codes[:, 0] = torch.arange(256, dtype=torch.uint8)
    values = codes[:, 0].view(FP8_DTYPES[fmt]).float()
    finite = values.isfinite()
    codes[~finite, 0] = 0  # NaN / inf bytes are never written by a saturating cast
    data = codes.view(FP8_DTYPES[fmt])
    scale = torch.full((256, 1), 0.5)
    layer = FP8Linear.from_weight(FP8Weight(data, scale, fmt, "channel"), None, "none")
    assert backends.prepare(layer, f"cpu_{kernel_variant}") == {"": f"cpu_{kernel_variant}"}
    x = torch.zeros(1, 16)
    x[0, 0] = 1.0
    got = layer(x)[0]
    assert torch.equal(got[finite], values[finite] * 0.5)  # subnormals included, signs kept
    assert (values[finite] != 0).sum() > 200  # the test saw real values, not a zeroed weight


def test_fp8_layers_the_kernel_cannot_take_keep_the_reference_path(kernel_variant):
    layer = make_fp8_layer(64, 200, "e4m3", "block", "dynamic")  # 200 columns: a partial block
    chosen = backends.prepare(layer, "auto")
    assert layer.kernel is None and "128-column weight blocks" in chosen[""]
    assert backends.prepare(make_fp8_layer(64, 256, "e4m3", "channel", "dynamic"), "cuda_int8") == {
        "": "reference (cuda_int8 takes no FP8 layers)"}


def test_prefill_sized_inputs_take_the_reference_path(kernel_variant):
    layer = make_fp8_layer(64, 256, "e4m3", "channel", "dynamic")
    backends.prepare(layer, "auto")
    assert layer.kernel.accepts(torch.randn(1, 256))
    assert not layer.kernel.accepts(torch.randn(cpu_kernels.MAX_ROWS + 1, 256))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("static_scale", [0.0, 0.01])
def test_cpu_fp8_input_quantization_is_bitwise_the_reference(fmt, static_scale, kernel_variant):
    """Rows from 1e-12 to 1e3 in magnitude reach the subnormals, the ties and saturation."""
    from lowbit.quantize.grids.fp8 import dynamic_token_scale, quantize_activation

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 1024, generator=g) * torch.logspace(-12, 3, 16).unsqueeze(1)
    x[1] = 0  # an all-zero row: scale 1
    x[2, :8] = torch.tensor([1e-30, -1e-30, 2.0**-9 * 1.5, -(2.0**-10), 447.0, 440.0, 432.0, -433.0])
    codes, scales = cpu_kernels.load(kernel_variant).quantize_fp8_inputs(x, static_scale, fmt == "e4m3")
    ref_scale = dynamic_token_scale(x, fmt) if static_scale == 0 else torch.full((16, 1), static_scale)
    ref = quantize_activation(x, ref_scale, fmt).float()
    assert torch.equal(codes.view(torch.int32), ref.view(torch.int32))  # signs of zero too
    assert torch.equal(scales, ref_scale)
