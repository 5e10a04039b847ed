"""Reading back: compressed-tensors checkpoints written by compressed-tensors itself, and the
`lowbit export` conversion between formats."""
import json

import pytest
import torch

from export_helpers import compare_logits, load_without_tokenizer, quantized_tiny, token_ids
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.quantize.grids.integer import IntScheme, compute_scale_zero
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.app.cli import main
from tiny_models import make_tiny_model


def write_with_compressed_tensors(folder, scheme: IntScheme):
    """A pack-quantized, sharded checkpoint produced by compressed-tensors' own API (as
    llm-compressor does), with lowbit's min/max scales so the result is known exactly."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)

    model = make_tiny_model("llama")
    args = QuantizationArgs(num_bits=scheme.bits, symmetric=scheme.symmetric, strategy=scheme.strategy,
                            group_size=scheme.group_size)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["re:.*_proj$"], weights=args)},
                                ignore=["lm_head"], format="pack-quantized")
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                scale, zero = compute_scale_zero(module.weight, scheme)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                if zero is not None:
                    module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(model)
    model.save_pretrained(folder, max_shard_size="300KB")
    compressor.update_config(folder)
    return folder


@pytest.mark.parametrize("scheme", [IntScheme(4, True, "group", 32), IntScheme(8, False, "channel")], ids=str)
def test_lowbit_reads_a_checkpoint_written_by_compressed_tensors(tmp_path, scheme):
    folder = write_with_compressed_tensors(tmp_path / "ct", scheme)
    assert (folder / "model.safetensors.index.json").is_file()  # sharded, as large exports are
    loaded, _ = load_without_tokenizer(folder)
    reference = quantized_tiny(scheme)  # the same min/max grid, quantized by lowbit
    quantized = [n for n, m in loaded.named_modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 14 and "lm_head" not in quantized
    for name in quantized:
        assert torch.equal(loaded.get_submodule(name).weight_codes, reference.get_submodule(name).weight_codes), name
    agree, diff = compare_logits(reference, loaded, token_ids())
    assert agree >= 0.999 and diff < 1e-5


def test_reader_names_the_file_when_quant_method_is_unknown(tmp_path):
    out = checkpoint.save(quantized_tiny(), None, tmp_path / "ckpt", ExportConfig())
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "awq"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: quantized tensors .* 'awq'; lowbit reads"):
        load_without_tokenizer(out)


def test_cli_export_converts_between_formats(tmp_path, tiny_tokenizer_dir, capsys):
    from transformers import AutoTokenizer

    model = quantized_tiny(IntScheme(4, False, "group", 64))
    source = checkpoint.save(model, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), tmp_path / "ct",
                             ExportConfig(dtype="float16"), extra_files={"recipe.yaml": "name: x\n"})
    gptq, back = tmp_path / "gptq", tmp_path / "back"
    assert main(["export", str(source), "--format", "gptq", "--output", str(gptq)]) == 0
    assert main(["export", str(gptq), "--format", "compressed-tensors", "--output", str(back)]) == 0
    assert json.loads((gptq / "quantize_config.json").read_text())["sym"] is False
    assert (gptq / "recipe.yaml").is_file() and (gptq / "manifest.json").is_file()
    original, again = checkpoint.read_tensors(source), checkpoint.read_tensors(back)
    assert again.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(again[name], tensor), name  # float16 kept: bit-exact both ways
    assert main(["export", str(source), "--format", "gptq", "--output", str(gptq)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_cli_export_refuses_a_source_that_fails_its_manifest(tmp_path, capsys):
    source = checkpoint.save(quantized_tiny(), None, tmp_path / "ct", ExportConfig())
    (source / "config.json").write_text((source / "config.json").read_text() + " ")
    assert main(["export", str(source), "--format", "gptq", "--output", str(tmp_path / "gptq")]) == 2
    assert "config.json: differs from manifest.json" in capsys.readouterr().err
    assert not (tmp_path / "gptq").exists()
