"""The dense format: a quantized model written as a plain 16-bit transformers checkpoint, which
transformers alone loads (checked in a fresh process, without lowbit) to lowbit's logits."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from audit_agreement import assert_audits_agree
from export_helpers import compare_logits, load_without_tokenizer, quantized_tiny, token_ids
from tiny_models import save_tiny_llama
from lowbit.evaluate.memory import checkpoint_weight_bytes, model_weight_bytes
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.quantize.grids.integer import IntScheme, quantize_rtn
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.app.cli import main

PLAIN_LOAD = """
import json, sys, torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
folder, ids, out = sys.argv[1:]
model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
with torch.no_grad():
    logits = model(load_file(ids)["ids"]).logits
save_file({"logits": logits.contiguous()}, out)
print(json.dumps({"info": {k: sorted(map(str, v)) for k, v in info.items()},
                  "lowbit": any(m.startswith("lowbit") for m in sys.modules),
                  "quantization_config": hasattr(model.config, "quantization_config")}))
"""


def plain_transformers_logits(folder: Path, ids: torch.Tensor, tmp: Path) -> tuple[torch.Tensor, dict]:
    """Logits of `folder` loaded by AutoModelForCausalLM.from_pretrained in a fresh process."""
    save_file({"ids": ids}, tmp / "ids.safetensors")
    run = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(folder), str(tmp / "ids.safetensors"),
                          str(tmp / "logits.safetensors")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return load_file(tmp / "logits.safetensors")["logits"], json.loads(run.stdout.strip().splitlines()[-1])


def assert_plain_transformers_agrees(folder: Path, tmp: Path) -> None:
    """Plain transformers loads `folder` with no key missing or unexpected, to lowbit's own logits
    (within 1e-4 of the largest)."""
    ids = token_ids(batch=2, length=32)
    plain, loaded = plain_transformers_logits(folder, ids, tmp)
    assert loaded["info"]["missing_keys"] == [] and loaded["info"]["unexpected_keys"] == []
    lowbit_model, _ = load_without_tokenizer(folder)
    with torch.no_grad():
        ours = lowbit_model(ids).logits
    assert (plain - ours).abs().max() / ours.abs().max() < 1e-4


def weights_in_bf16(model: nn.Module) -> nn.Module:
    """lowbit's loaded model with each QuantLinear replaced by a Linear whose weight is its
    dequantized weight rounded to bf16: what the dense file holds, computed in float32."""
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]:
        dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        dense.weight.data = module.dequantized_weight().to(torch.bfloat16).float()
        if module.bias is not None:
            dense.bias.data = module.bias.to(torch.bfloat16).float()
        model.set_submodule(name, dense)
    return model


@pytest.fixture
def w4_source(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    model = quantized_tiny(IntScheme(4, False, "group", 32))
    return checkpoint.save(model, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), tmp_path / "w4", ExportConfig())


def test_cli_export_dense_loads_in_plain_transformers_to_lowbits_logits(w4_source, tmp_path):
    dense = tmp_path / "dense"
    assert main(["export", str(w4_source), "--format", "dense", "--output", str(dense)]) == 0
    config = json.loads((dense / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    ids = token_ids()
    logits, loaded = plain_transformers_logits(dense, ids, tmp_path)
    assert loaded == {"info": {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []},
                      "lowbit": False, "quantization_config": False}
    lowbit_model, _ = load_without_tokenizer(w4_source)
    with torch.no_grad():
        quantized = lowbit_model(ids).logits
        rounded = weights_in_bf16(lowbit_model)(ids).logits
    # the file holds lowbit's dequantized weights rounded to bf16 (embeddings and norms were bf16
    # already): with those weights, the float32 forward is the same up to float32 summation order
    torch.testing.assert_close(logits, rounded, rtol=0, atol=1e-5)
    # against lowbit's unrounded weights, each weight moves by at most 2^-9 of itself (bf16's
    # 8-bit significand): the logits move by a small fraction of their range, the argmax hardly
    agree = (logits.argmax(-1) == quantized.argmax(-1)).float().mean().item()
    drift = ((logits - quantized).abs().max() / quantized.abs().max()).item()
    print(f"bf16 rounding of the dequantized weights: top-1 agreement {agree:.4f}, max drift {drift:.2e}")
    assert agree >= 0.98 and drift < 2 ** -6, (agree, drift)  # measured: 0.992, 2.4e-3 (near-ties on random weights)


def test_dense_weight_bytes_are_the_16_bit_size(w4_source, tmp_path):
    dense = tmp_path / "dense"
    assert main(["export", str(w4_source), "--format", "dense", "--output", str(dense)]) == 0
    model, _ = load_without_tokenizer(dense)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert checkpoint_weight_bytes(dense) == model_weight_bytes(model, bytes_per_param=2)
    assert checkpoint_weight_bytes(dense) > checkpoint_weight_bytes(w4_source)


def test_dense_writes_a_quantized_head_apart_from_the_tied_embedding(tmp_path):
    model = quantized_tiny()
    w8 = IntScheme(8, True, "channel", None)
    head = QuantLinear.from_quantized(quantize_rtn(model.lm_head.weight.detach(), w8), None)
    model.lm_head = head
    out = checkpoint.save(model, None, tmp_path / "dense", ExportConfig(format="dense"))
    tensors = checkpoint.read_tensors(out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert torch.equal(tensors["lm_head.weight"], head.dequantized_weight().to(torch.bfloat16))
    agree, diff = compare_logits(load_without_tokenizer(out)[0], weights_in_bf16(model), token_ids())
    assert agree == 1.0 and diff < 1e-2


def test_run_with_export_format_dense(tmp_path, capsys):
    model_dir = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "run"
    small = ["calibration.samples=4", "calibration.seq_len=64", "evaluate.baseline=false",
             "evaluate.kl.enabled=false", "evaluate.memory.measure_peak=false",
             "evaluate.perplexity.max_tokens=256", "evaluate.perplexity.context_len=128",
             "evaluate.perplexity.stride=128", "export.format=dense"]
    code = main(["run", "w4a16-rtn", "--model", str(model_dir), "--output", str(out), *[f"--set={s}" for s in small]])
    said = capsys.readouterr()
    assert code == 0, said.err
    # quantized in memory, written dequantized: a float export, and `lowbit audit` says what the run said
    audit = assert_audits_agree(out, said.out, capsys)
    assert audit["float_export"] == ("a float export (export.format dense): the rtn int4 sym group 64 weights "
                                     "written dequantized to bfloat16")
    results = json.loads((out / "results.json").read_text())
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    params = sum(t.numel() for t in load_file(out / "model.safetensors").values())
    assert results["memory"]["weight_bytes"] == 2 * params == checkpoint_weight_bytes(out)
    card = (out / "README.md").read_text()
    assert "| Format | float safetensors (bfloat16, no quantization_config) |" in card
    assert "model = AutoModelForCausalLM.from_pretrained(path)" in card
    logits, loaded = plain_transformers_logits(out, token_ids(1, 16), tmp_path)
    assert loaded["info"]["missing_keys"] == [] and loaded["info"]["unexpected_keys"] == []
    assert torch.isfinite(logits).all()
