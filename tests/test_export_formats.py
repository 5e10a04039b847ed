"""The format registry: every registered format writes, detects and reads its own checkpoints,
and the names it holds are the only ones ExportConfig, recipes and `lowbit export` accept."""
from __future__ import annotations

import json

import pytest

from export_helpers import compare_logits, load_without_tokenizer, quantized_tiny, token_ids
from gguf_models import gguf_tiny, smollm2_tokenizer
from lowbit.evaluate.memory import checkpoint_weight_bytes
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.export.formats.registry import FORMATS, format_of, format_of_folder
from lowbit.export.model_card import render_card
from lowbit.app.cli import main


def example(name: str):
    """A model and tokenizer the format holds: GGUF holds GGML block grids, and its tokenizer."""
    if name == "gguf":
        return gguf_tiny("llama", types=("q4_0", "q4_k")), smollm2_tokenizer()
    return quantized_tiny(), None


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_detects_and_reads_what_it_writes(name, tmp_path):
    model, tokenizer = example(name)
    out = checkpoint.save(model, tokenizer, tmp_path / name, ExportConfig(format=name, dtype="float32"))
    fmt = FORMATS[name]
    assert format_of_folder(out) is fmt
    assert checkpoint_weight_bytes(out) == fmt.weight_bytes(out) > 0
    loaded, _ = load_without_tokenizer(out)
    agree, diff = compare_logits(model, loaded, token_ids())  # float32 file: the same weights
    assert agree == 1.0 and diff < 1e-5, (name, agree, diff)
    config = json.loads((out / "config.json").read_text())
    card = render_card({}, config, name)
    assert f"| Format | {fmt.describe(config)} |" in card and "\n".join(fmt.loading(config)) in card


def test_formats_detect_disjoint_configs(tmp_path):
    written = {name: json.loads((checkpoint.save(*example(name), tmp_path / name, ExportConfig(format=name))
                                 / "config.json").read_text()) for name in FORMATS}
    for name, config in written.items():
        assert [n for n, f in FORMATS.items() if f.detects(config)] == [name]
    assert format_of({"quantization_config": {"quant_method": "awq"}}) is None


def test_an_unknown_format_is_refused_naming_the_registered_ones(tmp_path, capsys):
    with pytest.raises(ValueError, match=f"unknown export format 'onnx'; valid: {', '.join(FORMATS)}$"):
        ExportConfig(format="onnx")
    source = checkpoint.save(quantized_tiny(), None, tmp_path / "ct", ExportConfig())
    with pytest.raises(SystemExit):
        main(["export", str(source), "--format", "onnx", "--output", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert "invalid choice: 'onnx'" in err and all(repr(name) in err for name in FORMATS)
