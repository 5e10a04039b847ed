"""The Triton weight-only kernels against the reference path: on a GPU for real, elsewhere on the
CPU through Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py), which runs the same
kernel source.

The no-materialization tests watch every aten op of a decode step (TorchDispatchMode) and fail
if any produces a float tensor of a quantized weight's (N, K) shape; the reference backend, which
does build one, is the check's own control."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lowbit.quantize.grids.fp8 import quantize_weight_fp8
from lowbit.quantize.grids.integer import IntScheme, quantize_rtn
from lowbit.quantize.runtime import backends
from lowbit.quantize.runtime.fp8_linear import FP8Linear
from lowbit.quantize.runtime.qlinear import QuantLinear
from tiny_models import make_tiny_model

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def int8_layer(out: int, inp: int, bias: bool = True) -> QuantLinear:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=g) * 0.05
    b = torch.randn(out, generator=g) if bias else None
    return QuantLinear.from_quantized(quantize_rtn(w, IntScheme(8, True, "channel")), b).to(DEVICE)


def fp8_layer(out: int, inp: int, strategy: str) -> FP8Linear:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=g) * 0.05
    w[:, 3] *= 40  # an outlier column
    return FP8Linear.from_weight(quantize_weight_fp8(w, strategy, "e4m3"), torch.randn(out, generator=g),
                                 "none").to(DEVICE)


def assert_kernel_matches_reference(layer, x: torch.Tensor, rtol: float) -> None:
    expected = layer(x).float()  # no kernel attached yet: the reference path
    assert backends.prepare(layer, "triton") == {"": "triton"}
    got = layer(x)
    assert got.dtype == x.dtype and got.shape == expected.shape
    err = (got.float() - expected).abs().max() / expected.abs().max()
    assert err < rtol, f"max error {err:.2e} of the largest output"


# 80 columns: the last 32-column step is half masked; 40 rows: a partial row block;
# 1 / 8 / 33 rows: the 16-, 16- and 64-row blocks (33 leaves 31 rows masked)
@pytest.mark.parametrize("rows", [1, 8, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_channel_kernel_matches_reference(rows, dtype):
    x = torch.randn(rows, 80, device=DEVICE).to(dtype)
    assert_kernel_matches_reference(int8_layer(40, 80), x, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("rows", [1, 5])
def test_fp8_weight_only_kernel_matches_reference(strategy, rows):
    x = torch.randn(2, rows, 96, device=DEVICE)  # a (batch, tokens, features) input
    assert_kernel_matches_reference(fp8_layer(48, 96, strategy), x, 1e-5)


@pytest.mark.parametrize("scheme", [IntScheme(4, True, "group", 32), IntScheme(4, False, "group", 64),
                                    IntScheme(3, True, "group", 128)])
def test_int4_group_gemv_matches_reference(scheme):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 256, generator=g) * 0.05 + 0.01  # an offset exercises zero points
    layer = QuantLinear.from_quantized(quantize_rtn(w, scheme), torch.randn(40, generator=g)).to(DEVICE)
    x = torch.randn(1, 1, 256, device=DEVICE)
    assert_kernel_matches_reference(layer, x, 1e-5)
    assert not layer.kernel.accepts(torch.randn(2, 256, device=DEVICE))  # batch 1 only


def test_layers_the_kernel_cannot_take_say_why():
    layer = QuantLinear.from_quantized(quantize_rtn(torch.randn(32, 64), IntScheme(8, False, "channel")), None)
    assert backends.prepare(layer.to(DEVICE), "triton") == {
        "": "reference (triton: needs symmetric per-channel codes, or <= 4-bit group codes)"}
    w8a8 = FP8Linear.from_weight(quantize_weight_fp8(torch.randn(32, 64), "channel", "e4m3"), None, "dynamic")
    why = backends.prepare(w8a8.to(DEVICE), "triton")[""]
    assert why.startswith("reference (triton: FP8 activations run torch._scaled_mm"), why


def test_prefill_sized_inputs_take_the_reference_path():
    layer = int8_layer(40, 80)
    backends.prepare(layer, "triton")
    x = torch.randn(2, 40, 80, device=DEVICE)  # 80 rows > MAX_ROWS
    assert not layer.kernel.accepts(x)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.dequantized_weight(), layer.bias))


class FloatWeightWatch(TorchDispatchMode):
    """Records every float tensor an aten op returns whose shape is a watched (N, K)."""

    def __init__(self, shapes: set[tuple[int, int]]):
        super().__init__()
        self.shapes, self.seen = shapes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and tuple(t.shape) in self.shapes:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def quantized_tiny_llama(scheme: str):
    from lowbit.calibrate.arch import arch_for
    from lowbit.quantize.steps import fp8, rtn
    from lowbit.quantize.steps.context import StepContext

    model = make_tiny_model("llama").to(DEVICE)
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: None)
    if scheme == "fp8":
        fp8.apply(ctx, fp8.FP8Config(activations="none"))
    else:
        rtn.apply(ctx, rtn.RTNConfig(IntScheme(8, True, "channel")))
    return model


@pytest.mark.parametrize("scheme", ["w8a16", "fp8"])
def test_no_decode_step_materializes_a_float_weight(scheme):
    model = quantized_tiny_llama(scheme)
    shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, (QuantLinear, FP8Linear))}
    assert len(shapes) >= 2
    ids = torch.randint(0, model.config.vocab_size, (1, 1), device=DEVICE)  # one decode token
    with torch.no_grad():
        with FloatWeightWatch(shapes) as control:
            model(ids)
        assert control.seen, "the reference path dequantizes: the watch must see its float weights"
        chosen = backends.prepare(model, "triton")
        assert set(chosen.values()) == {"triton"}, chosen
        with FloatWeightWatch(shapes) as watch:
            model(ids)
    assert watch.seen == []
