"""Runtime modules live on their data's device and keep their number formats through casts.

Without a GPU here, CUDA is a FakeTensorMode device: tensors made on (or moved to) cuda:0 inside
the mode carry the device and dtype but no data, and mixing them with CPU tensors fails as on a GPU.
torch built for the CPU only (2.13.0+cpu) refuses, even on fake tensors, the ops that open a CUDA
device guard: copy_, slicing (q[:, :16]), index assignment, `.cuda()` and `.to("cuda")` without an
index ("PyTorch is not linked with support for cuda devices"). So moves name cuda:0, the data is
quantized for real on the CPU and then moved, and the GGUF types whose packing slices (all but
Q8_0) and int4 KV caches are checked on the meta device, which has the same device rules and
answers every op.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lowbit.quantize.grids.fp8 import quantize_weight_fp8
from lowbit.quantize.grids.gguf import GGUFScheme, quantize_gguf
from lowbit.quantize.grids.inputs import InputQuant
from lowbit.quantize.grids.integer import IntScheme, QuantizedWeight, quantize_rtn
from lowbit.quantize.grids.kv import KVCacheConfig, static_scale
from lowbit.quantize.runtime.buffers import on_device
from lowbit.quantize.runtime.compact import PackedLinear
from lowbit.quantize.runtime.fp8_linear import FP8Linear
from lowbit.quantize.runtime.gguf_linear import GGUFLinear
from lowbit.quantize.runtime.kv_cache import QuantizedKVLayer
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.quantize.steps.int8_inputs import enable_input_quant

OUT, IN = 64, 256
F32, I8 = torch.float32, torch.int8
# each buffer's format; `bias` alone follows a float cast (the compute dtype)
FORMATS = {
    QuantLinear: {"weight_codes": I8, "weight_scale": F32, "weight_zero": F32, "weight_g_idx": torch.int32,
                  "input_scale": F32},
    FP8Linear: {"weight": torch.float8_e4m3fn, "weight_scale": F32, "input_scale": F32},
    GGUFLinear: {"weight": torch.uint8},
}
FAKE_CUDA = torch.device("cuda", 0)
META = torch.device("meta")


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed))


def _int(scheme: IntScheme, act_order: bool = False) -> QuantizedWeight:
    qw = quantize_rtn(_weight(), scheme)
    if act_order:  # columns in a permuted order of groups, as GPTQ's act-order leaves them
        perm = torch.randperm(IN, generator=torch.Generator().manual_seed(1))
        qw.g_idx = perm // scheme.group_size
    return qw


def _int_module(inputs: InputQuant | None = None):
    def build(qw, bias):
        m = QuantLinear.from_quantized(qw, bias)
        if inputs is not None:  # the observers' absmax is a CPU statistic, whatever the model's device
            enable_input_quant(m, inputs, torch.rand(IN, generator=torch.Generator().manual_seed(2)) + 1)
        return m
    return build


def _fp8(strategy: str, activations: str):
    def build(fw, bias):
        scale = torch.tensor(0.01) if activations == "static" else None  # calibrated, on the CPU
        return FP8Linear.from_weight(fw, bias, activations, scale)
    return (lambda: quantize_weight_fp8(_weight(), strategy, "e4m3", 32)), build


def _gguf(kind: str):
    return (lambda: quantize_gguf(_weight(), GGUFScheme(kind))), GGUFLinear.from_weight


G32 = IntScheme(4, True, "group", 32)
# name: (quantized weight on the CPU, module from (weight, bias), buffers it holds besides bias)
CASES = {
    "int4-sym-g32": (lambda: _int(G32), _int_module(), {"weight_codes", "weight_scale"}),
    "int4-asym-g32": (lambda: _int(IntScheme(4, False, "group", 32)), _int_module(),
                      {"weight_codes", "weight_scale", "weight_zero"}),
    "int4-act-order": (lambda: _int(IntScheme(4, False, "group", 32), act_order=True), _int_module(),
                       {"weight_codes", "weight_scale", "weight_zero", "weight_g_idx"}),
    "int8-sym-channel": (lambda: _int(IntScheme(8)), _int_module(), {"weight_codes", "weight_scale"}),
    "int8-asym-tensor": (lambda: _int(IntScheme(8, False, "tensor")), _int_module(),
                         {"weight_codes", "weight_scale", "weight_zero"}),
    "int8-static-inputs": (lambda: _int(IntScheme(8)), _int_module(InputQuant(dynamic=False)),
                           {"weight_codes", "weight_scale", "input_scale"}),
    "int8-dynamic-inputs": (lambda: _int(IntScheme(8)), _int_module(InputQuant()),
                            {"weight_codes", "weight_scale"}),
    "int4-g32-static-inputs": (lambda: _int(G32), _int_module(InputQuant(dynamic=False)),
                               {"weight_codes", "weight_scale", "input_scale"}),
    "fp8-weight-only": (*_fp8("channel", "none"), {"weight", "weight_scale"}),
    "fp8-dynamic": (*_fp8("channel", "dynamic"), {"weight", "weight_scale"}),
    "fp8-static-tensor": (*_fp8("tensor", "static"), {"weight", "weight_scale", "input_scale"}),
    "fp8-block": (*_fp8("block", "dynamic"), {"weight", "weight_scale"}),
    **{f"gguf-{kind}": (*_gguf(kind), {"weight"}) for kind in ("q8_0", "q4_0", "q5_0", "q4_k", "q6_k")},
}
SLICING = {"gguf-q4_0", "gguf-q5_0", "gguf-q4_k", "gguf-q6_k"}  # packing slices: no fake CUDA


@contextlib.contextmanager
def _on(device: torch.device):
    with FakeTensorMode(allow_non_fake_inputs=True) if device.type == "cuda" else contextlib.nullcontext():
        yield


def _data(case: str):
    """The case's quantized weight and a bias (exact in bfloat16), real, on the CPU."""
    return CASES[case][0](), torch.randn(OUT, generator=torch.Generator().manual_seed(6)).bfloat16().float()


def _build(case: str, data, device: torch.device, bias_device: torch.device | None = None):
    """The case's module from its weight moved to device and its bias to bias_device (or device)."""
    weight, bias = data
    return CASES[case][1](on_device(weight, device), bias.to(bias_device or device))


def _check(m: nn.Module, case: str, device: torch.device, float_dtype: torch.dtype) -> None:
    held = {name: (t.device, t.dtype) for name, t in m.named_buffers()}
    assert set(held) == CASES[case][2] | {"bias"}
    want = {name: (device, float_dtype if name == "bias" else FORMATS[type(m)][name]) for name in held}
    assert held == want


def _casts_and_moves(device: torch.device):
    """(what is done, the device and bias dtype after it); applied one after another."""
    steps = [(lambda m: m.to(torch.bfloat16), device, torch.bfloat16),
             (lambda m: m.half(), device, torch.float16),
             (lambda m: m.float(), device, F32),
             (lambda m: m.bfloat16(), device, torch.bfloat16),
             (lambda m: nn.Sequential(m).to(torch.float16)[0], device, torch.float16),
             (lambda m: m.to(device, torch.float32), device, F32)]
    if device.type == "cuda":
        steps += [(lambda m: m.to("cpu"), torch.device("cpu"), F32),
                  (lambda m: m.to(FAKE_CUDA, torch.bfloat16), FAKE_CUDA, torch.bfloat16),
                  (lambda m: nn.Sequential(m).to("meta")[0], META, torch.bfloat16)]
    else:  # out of meta: to_empty, as for a model built without memory
        steps += [(lambda m: m.to_empty(device="cpu"), torch.device("cpu"), F32)]
    return steps


DEVICE_CASES = [(case, META) for case in CASES] + [(case, FAKE_CUDA) for case in CASES if case not in SLICING]


@pytest.mark.parametrize("case,device", DEVICE_CASES, ids=[f"{c}-{d.type}" for c, d in DEVICE_CASES])
def test_modules_are_built_on_their_datas_device_and_keep_formats_through_casts(case, device):
    data = _data(case)
    with _on(device):
        m = _build(case, data, device)
        _check(m, case, device, F32)
        for step, where, float_dtype in _casts_and_moves(device):
            m = step(m)
            _check(m, case, where, float_dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_a_bfloat16_cast_computes_what_the_module_computed_in_bfloat16(case):
    m = _build(case, _data(case), torch.device("cpu"))
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        before = m(x)
        m.to(torch.bfloat16)
        after = m(x)
    _check(m, case, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(before, after)  # the bias is exact in bfloat16: only codes or scales could differ


@pytest.mark.parametrize("case", ["int4-asym-g32", "fp8-block", "gguf-q8_0"])
def test_data_on_two_devices_is_refused_in_one_line(case):
    with pytest.raises(ValueError, match=r"on different devices \(.*bias on cpu\); move them to one device first"):
        _build(case, _data(case), META, bias_device=torch.device("cpu"))


KV_CONFIGS = [KVCacheConfig("fp8", "tensor"), KVCacheConfig("int8", "head"), KVCacheConfig("int8", "token"),
              KVCacheConfig("fp8", "token"), KVCacheConfig("int4", "token")]
KV_CODES = {"fp8": torch.float8_e4m3fn, "int8": I8, "int4": torch.uint8}


@pytest.mark.parametrize("device", [META, FAKE_CUDA], ids=["meta", "cuda"])
@pytest.mark.parametrize("cfg", KV_CONFIGS, ids=[f"{c.format}-{c.strategy}" for c in KV_CONFIGS])
def test_the_quantized_kv_cache_stores_on_the_states_device(cfg, device):
    if device.type == "cuda" and cfg.format == "int4":
        pytest.skip("int4 packs two codes a byte by slicing, which fake CUDA refuses (module docstring)")
    absmax = torch.rand(2, generator=torch.Generator().manual_seed(4)) + 1  # (kv_heads,), a CPU statistic
    scale = static_scale(absmax, cfg) if cfg.static else None
    with _on(device):
        layer = QuantizedKVLayer(cfg, scale, scale)
        for tokens in (5, 1):  # a prompt, then a decode step
            keys, values = layer.update(*(torch.zeros(1, 2, tokens, 32, dtype=torch.bfloat16, device=device)
                                          for _ in range(2)))
        stored = layer._quantized_keys
        assert (keys.device, keys.dtype, keys.shape[-2]) == (device, torch.bfloat16, 6)
        assert (stored.codes.device, stored.codes.dtype) == (device, KV_CODES[cfg.format])
        assert stored.scale.device == device
        assert stored.scale.dtype == (F32 if cfg.static else torch.float16)


def test_the_lean_packed_linear_keeps_its_stored_16bit_scales_through_casts():
    qw = quantize_rtn(_weight(), G32)
    qw.scale = qw.scale.half().float()  # scales as a 16-bit checkpoint stores them
    m = PackedLinear(QuantLinear.from_quantized(qw, torch.randn(OUT).bfloat16().float()))
    assert (m.weight_packed.dtype, m.weight_scale.dtype) == (torch.int32, torch.float16)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.no_grad():
        before = m(x)
        m.to(torch.bfloat16)
        after = m(x)
    assert (m.weight_packed.dtype, m.weight_scale.dtype, m.bias.dtype) == (torch.int32, torch.float16, torch.bfloat16)
    assert torch.equal(before, after)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_integer_codes_pack_and_unpack_on_their_own_device(bits):
    """Export packs codes where the model is (a GPU run's); its work tensors follow them (meta here)."""
    from lowbit.quantize.grids.integer import pack_codes, unpack_codes

    codes = torch.randint(0, 2 ** bits, (4, 70), dtype=torch.uint8)
    packed = pack_codes(codes.to("meta"), bits)
    assert packed.device.type == "meta" and packed.dtype == torch.int32
    assert unpack_codes(packed, bits, 70).device.type == "meta"
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, 70), codes)  # and the same values on the CPU
