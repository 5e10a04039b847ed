"""compressed-tensors export, proven against the compressed-tensors package and transformers."""
import json

import pytest
import torch

from export_helpers import (W4_GROUP, act_order_tiny, compare_logits, dense_in, load_without_tokenizer,
                            quantized_tiny, rounded_like_export, token_ids)
from lowbit.export import checkpoint
from lowbit.export.formats.compressed_tensors import packed as ct_packed
from lowbit.export.config import ExportConfig
from lowbit.quantize.grids.integer import IntScheme, pack_codes, quantize_rtn, unpack_codes
from lowbit.quantize.runtime.qlinear import QuantLinear

ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")

SCHEMES = [
    IntScheme(bits=4, symmetric=True, strategy="group", group_size=32),
    IntScheme(bits=4, symmetric=False, strategy="group", group_size=32),
    IntScheme(bits=8, symmetric=True, strategy="channel"),
    IntScheme(bits=8, symmetric=False, strategy="channel"),
    IntScheme(bits=3, symmetric=False, strategy="group", group_size=16),
    IntScheme(bits=2, symmetric=True, strategy="group", group_size=64),
    IntScheme(bits=5, symmetric=False, strategy="tensor"),
    IntScheme(bits=6, symmetric=True, strategy="tensor"),
]


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("shape", [(6, 64), (3, 77), (40, 5)])
def test_dense_packing_matches_compressed_tensors(bits, shape):
    codes = torch.randint(0, 2**bits, shape)
    signed = (codes - 2 ** (bits - 1)).to(torch.int8)
    assert torch.equal(pack_codes(codes, bits), ct_helpers.pack_to_int32(signed, bits))
    assert torch.equal(pack_codes(codes.t(), bits).t(), ct_helpers.pack_to_int32(signed, bits, packed_dim=0))
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, shape[1]).long(), codes)


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_module_tensors_equal_the_compressed_tensors_compressor(scheme):
    """Our tensors, bit for bit, are what compressed-tensors' own compressor writes for them."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    torch.manual_seed(0)
    qw = quantize_rtn(torch.randn(96, 128), scheme)
    ours = ct_packed.module_tensors("m", QuantLinear.from_quantized(qw, None), torch.float32)
    args = QuantizationArgs(num_bits=scheme.bits, symmetric=scheme.symmetric, strategy=scheme.strategy,
                            group_size=scheme.group_size)
    state = {"weight": qw.dequantize(), "weight_scale": ours["m.weight_scale"]}
    if qw.zero is not None:
        state["weight_zero_point"] = qw.zero.to(torch.int8).reshape(ours["m.weight_scale"].shape)
    theirs = PackedQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args))
    assert set(theirs) == {k.removeprefix("m.") for k in ours}
    for key, tensor in theirs.items():
        assert torch.equal(ours[f"m.{key}"], tensor), key


def test_quantization_config_validates_with_compressed_tensors(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    out = checkpoint.save(quantized_tiny(), None, tmp_path / "ckpt", ExportConfig())
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qconfig)
    assert parsed.format == "pack-quantized" and parsed.ignore == ["lm_head"]
    assert parsed.config_groups["group_0"].weights.group_size == 32


ROUND_TRIP = [
    (IntScheme(bits=4, symmetric=True, strategy="group", group_size=32), False),
    (IntScheme(bits=4, symmetric=False, strategy="group", group_size=32), True),
    (IntScheme(bits=8, symmetric=True, strategy="channel"), False),
    (IntScheme(bits=3, symmetric=False, strategy="group", group_size=32), True),
]


@pytest.mark.parametrize("scheme,dequantize", ROUND_TRIP, ids=lambda v: str(v))
def test_transformers_loads_the_export(tmp_path, scheme, dequantize):
    """Plain transformers + compressed-tensors loads the export and matches lowbit's logits.

    The reference is lowbit's model rounded the way the bf16 file and the consumer round it:
    float tensors through bf16 and, on the dequantize=True path, (q - zero) * scale computed in
    bf16. Against the unrounded model only bf16 rounding separates them (looser bound).

    Asymmetric schemes load with dequantize=True: compressed-tensors 0.20.1's default (compressed)
    path allocates weight_zero_point unpacked and rejects the packed tensors it writes itself
    (see test_default_path_rejects_packed_zero_points_from_compressed_tensors_itself)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = quantized_tiny(scheme)
    out = checkpoint.save(model, None, tmp_path / "ckpt", ExportConfig())  # bfloat16 file
    extra = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **extra).eval()
    ids = token_ids()
    reference = dense_in(model) if dequantize else rounded_like_export(model)
    agree, diff = compare_logits(reference, hf, ids)
    assert agree >= 0.999 and diff < 1e-4
    agree, diff = compare_logits(model, hf, ids)  # the unrounded model: bf16 rounding only
    assert agree >= 0.95 and diff < 0.02
    dense = hf.get_submodule("model.layers.0.mlp.down_proj")
    assert dense.weight.shape == (128, 256) and dense.weight.dtype == torch.float32


def test_float32_export_is_exact_through_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = quantized_tiny()
    out = checkpoint.save(model, None, tmp_path / "ckpt", ExportConfig(dtype="float32"))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    agree, diff = compare_logits(model, hf, token_ids())
    assert agree == 1.0 and diff < 1e-5


def test_default_path_rejects_packed_zero_points_from_compressed_tensors_itself(tmp_path):
    """Documents the consumer bug the asymmetric round trip works around; when a new
    compressed-tensors fixes it, this fails and the dequantize=True workaround can go."""
    from transformers import AutoModelForCausalLM

    out = checkpoint.save(quantized_tiny(IntScheme(4, False, "group", 32)), None, tmp_path / "ckpt",
                          ExportConfig())
    with pytest.raises(RuntimeError, match="mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)


def test_plain_act_order_grouping_is_written_without_g_idx(tmp_path):
    from transformers import AutoModelForCausalLM

    model = quantized_tiny()
    for module in model.modules():  # a g_idx that only restates contiguous groups
        if isinstance(module, QuantLinear):
            module.weight_g_idx = (torch.arange(module.in_features) // 32).to(torch.int32)
    out = checkpoint.save(model, None, tmp_path / "ckpt", ExportConfig(dtype="float32"))
    tensors = checkpoint.read_tensors(out)
    assert not [k for k in tensors if k.endswith("weight_g_idx")]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert compare_logits(model, hf, token_ids())[0] == 1.0


def test_permuted_act_order_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"layer model\.layers\.0\.self_attn\.q_proj: act-order.*--format gptq"):
        checkpoint.save(act_order_tiny(), None, tmp_path / "ckpt", ExportConfig())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("scheme", [W4_GROUP, IntScheme(8, False, "tensor"), IntScheme(3, False, "group", 32)],
                         ids=str)
def test_lowbit_reads_its_export_back_exactly(tmp_path, scheme):
    model = quantized_tiny(scheme)
    out = checkpoint.save(model, None, tmp_path / "ckpt", ExportConfig(dtype="float32"))
    loaded, _ = load_without_tokenizer(out)
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            again = loaded.get_submodule(name)
            assert again.scheme == scheme and torch.equal(again.weight_codes, module.weight_codes)
    assert compare_logits(model, loaded, token_ids()) == (1.0, 0.0)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text", "opt"])
def test_other_architectures_load_in_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    model = quantized_tiny(W4_GROUP, arch)
    out = checkpoint.save(model, None, tmp_path / "ckpt", ExportConfig(dtype="float32"))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    agree, diff = compare_logits(model, hf, token_ids())
    assert agree == 1.0 and diff < 1e-5


def test_gpt2_conv1d_is_refused_rather_than_loaded_as_random_weights(tmp_path):
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn.*Conv1D.*ignore list"):
        checkpoint.save(quantized_tiny(W4_GROUP, "gpt2"), None, tmp_path / "ckpt", ExportConfig())


def test_quantized_head_of_a_tied_model_loads_untied(tmp_path):
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    from lowbit.calibrate.arch import arch_for
    from lowbit.quantize.steps import rtn
    from lowbit.quantize.steps.context import StepContext

    config = tiny_config("llama")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    rtn.apply(StepContext(model, arch_for(model), (), lambda: None), rtn.RTNConfig(W4_GROUP))  # lm_head too
    out = checkpoint.save(model, None, tmp_path / "ckpt", ExportConfig(dtype="float32"))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert compare_logits(model, hf, token_ids()) == (1.0, 0.0)


def test_reader_accepts_g_idx_from_compressed_tensors_before_0_20():
    """Older compressed-tensors wrote actorder 'group' with a weight_g_idx tensor; lowbit still reads it."""
    module = act_order_tiny().get_submodule("model.layers.0.mlp.down_proj")
    tensors = ct_packed.module_tensors("m", module, torch.float32)
    tensors["m.weight_g_idx"] = module.weight_g_idx.clone()
    group = {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                         "group_size": 32, "actorder": "group"}, "format": "pack-quantized"}
    again = ct_packed.build_module("m", tensors, group)
    assert tensors == {} and torch.equal(again.dequantized_weight(), module.dequantized_weight())
