"""GPTQ-format export: checked by a dequantization written here from the format's definition."""
import json

import pytest
import torch

from export_helpers import (W4_GROUP, act_order_tiny, compare_logits, load_without_tokenizer,
                            quantized_tiny, token_ids)
from lowbit.export import checkpoint
from lowbit.export.formats import gptq as gptq_format
from lowbit.export.config import ExportConfig
from lowbit.quantize.grids.integer import IntScheme, quantize_rtn
from lowbit.quantize.runtime.qlinear import QuantLinear


def unpack_rows(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Independent reference: codes along dim 0 of an int32 (words, cols) tensor, read bit by bit
    from the little-endian stream (code i at bits i*bits .. i*bits+bits-1)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(n, packed.shape[1], dtype=torch.int64)
    for i in range(n):
        for b in range(bits):
            pos = i * bits + b
            out[i] |= ((words[pos // 32] >> (pos % 32)) & 1) << b
    return out


def dequantize_gptq(t: dict, bits: int) -> torch.Tensor:
    """W (out, in) = scales[g, o] * (q[i, o] - (qzeros[g, o] + 1)), g = g_idx[i]."""
    g_idx = t["g_idx"].long()
    q = unpack_rows(t["qweight"], bits, g_idx.numel())  # (in, out)
    out_f = t["scales"].shape[1]
    zeros = unpack_rows(t["qzeros"].t().contiguous(), bits, out_f).t() + 1  # (G, out)
    return ((q - zeros[g_idx]).float() * t["scales"].float()[g_idx]).t()


CASES = [
    IntScheme(bits=4, symmetric=True, strategy="group", group_size=32),
    IntScheme(bits=4, symmetric=False, strategy="group", group_size=64),
    IntScheme(bits=8, symmetric=True, strategy="channel"),
    IntScheme(bits=8, symmetric=False, strategy="group", group_size=32),
    IntScheme(bits=3, symmetric=False, strategy="group", group_size=32),
    IntScheme(bits=2, symmetric=True, strategy="channel"),
    IntScheme(bits=4, symmetric=False, strategy="tensor"),
]


@pytest.mark.parametrize("scheme", CASES, ids=str)
@pytest.mark.parametrize("act_order", [False, True])
def test_independent_dequantization_is_bit_exact(scheme, act_order):
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    qw = quantize_rtn(w, scheme)
    if act_order and scheme.strategy == "group":
        qw.g_idx = (torch.arange(128) // scheme.group_size)[torch.randperm(128)]  # any grouping
    module = QuantLinear.from_quantized(qw, torch.randn(64))
    tensors = gptq_format.module_tensors("m", module, torch.float32)
    got = dequantize_gptq({k[2:]: v for k, v in tensors.items()}, scheme.bits)
    assert torch.equal(got, module.dequantized_weight())
    assert tensors["m.qweight"].shape == (128 * scheme.bits // 32, 64)
    assert tensors["m.g_idx"].dtype == torch.int32 and torch.equal(tensors["m.bias"], module.bias)


def test_symmetric_zero_points_use_the_v1_convention():
    module = QuantLinear.from_quantized(quantize_rtn(torch.randn(16, 64), W4_GROUP), None)
    qzeros = gptq_format.module_tensors("m", module, torch.float16)["m.qzeros"]
    assert (qzeros == 0x77777777).all()  # stored zero 7 = 8 - 1 in every nibble


def test_zero_point_zero_is_refused_in_v1():
    w = torch.rand(8, 32) + 0.5  # all positive: the asymmetric zero point lands on 0
    module = QuantLinear.from_quantized(quantize_rtn(w, IntScheme(4, False, "group", 32)), None)
    with pytest.raises(ValueError, match="layer m: .*zero point 0.*v1"):
        gptq_format.module_tensors("m", module, torch.float16)


def test_checkpoint_files_and_config(tmp_path):
    out = checkpoint.save(act_order_tiny(), None, tmp_path / "ckpt", ExportConfig(format="gptq"))
    qc = json.loads((out / "quantize_config.json").read_text())
    assert qc == json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"]) == (4, 32, True, True)
    assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq"
    tensors = checkpoint.read_tensors(out)
    prefix = "model.layers.1.mlp.down_proj"
    assert tensors[f"{prefix}.qweight"].shape == (256 // 8, 128)
    assert tensors[f"{prefix}.scales"].dtype == torch.bfloat16 and tensors[f"{prefix}.scales"].shape == (8, 128)
    assert "lm_head.weight" in tensors and not any(k.endswith("weight_packed") for k in tensors)


@pytest.mark.parametrize("model_fn", [act_order_tiny, lambda: quantized_tiny(IntScheme(8, False, "channel"))],
                         ids=["w4-act-order", "w8-asym-channel"])
def test_lowbit_reads_its_gptq_export_back_exactly(tmp_path, model_fn):
    model = model_fn()
    out = checkpoint.save(model, None, tmp_path / "ckpt", ExportConfig(format="gptq", dtype="float32"))
    loaded, _ = load_without_tokenizer(out)
    assert compare_logits(model, loaded, token_ids()) == (1.0, 0.0)


def test_mixed_schemes_are_refused(tmp_path):
    model = quantized_tiny()
    head = model.get_submodule("model.layers.0.mlp.down_proj")
    model.set_submodule("model.layers.0.mlp.down_proj", QuantLinear.from_quantized(
        quantize_rtn(head.dequantized_weight(), IntScheme(8, True, "channel")), None))
    with pytest.raises(ValueError, match="one bit-width and group size"):
        checkpoint.save(model, None, tmp_path / "ckpt", ExportConfig(format="gptq"))


@pytest.mark.parametrize("model_fn", [quantized_tiny, act_order_tiny], ids=["w4-group", "w4-act-order"])
def test_gptqmodel_dequantizes_like_lowbit(tmp_path, model_fn, tiny_tokenizer_dir):
    """The GPTQ ecosystem's reader (runs only where gptqmodel is installed; see the report on
    installing it without CUDA). Asymmetric v1 files are refused by gptqmodel unless stamped as
    its own output, which lowbit does not claim."""
    gptqmodel = pytest.importorskip("gptqmodel")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    out = checkpoint.save(model_fn(), tok, tmp_path / "ckpt", ExportConfig(format="gptq", dtype="float16"))
    theirs = gptqmodel.GPTQModel.load(str(out), device="cpu", backend=gptqmodel.BACKEND.TORCH, dtype=torch.float16)
    ours, _ = checkpoint.load(out)
    layers = [(n, m) for n, m in theirs.model.named_modules() if hasattr(m, "qweight")]
    assert len(layers) == 14
    for name, module in layers:
        expected = ours.get_submodule(name).dequantized_weight().half()
        assert torch.equal(module.dequantize_weight().t(), expected), name
