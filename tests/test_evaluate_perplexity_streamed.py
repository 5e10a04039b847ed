"""Perplexity streamed one decoder layer at a time equals the resident figure, bit for bit."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

import lowbit.evaluate.perplexity_streamed as streamed_module
from lowbit.calibrate.models import load_model, resolve_model_path
from lowbit.calibrate.streaming import is_resident
from lowbit.evaluate.config import PerplexityProtocol
from lowbit.evaluate.perplexity import perplexity
from lowbit.evaluate.perplexity_streamed import streamed_perplexity
from streaming_models import save_sharded_tiny

# 7 windows: a batch of 4 and a batch of 3 whose last window is shorter, so padded
SMALL = PerplexityProtocol(context_len=64, stride=64, max_tokens=410)


@pytest.fixture(scope="module")
def tokenizer_dir():
    return resolve_model_path("smollm2-135m")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text", "opt", "gpt2", "phi3"])
def test_streamed_equals_resident(model_type, tokenizer_dir, tmp_path):
    folder = save_sharded_tiny(tmp_path / model_type, model_type, tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    resident = perplexity(load_model(str(folder))[0], tokenizer, SMALL)
    streamed = streamed_perplexity(folder, tokenizer, SMALL)
    assert streamed == resident


def test_at_most_one_layer_is_resident(tokenizer_dir, tmp_path, monkeypatch):
    """While a layer runs, no other layer and neither embedding nor head hold weights; after, nothing."""
    folder = save_sharded_tiny(tmp_path / "llama", "llama", tokenizer_dir)
    models, seen = [], []
    original_empty, original_forward = streamed_module.empty_model, streamed_module.layer_forward

    def empty(*args, **kwargs):
        models.append(original_empty(*args, **kwargs))
        return models[-1]

    def watched(layer, inputs, device=None):
        model = models[0]
        seen.append([is_resident(m) for m in (*model.model.layers, model.get_input_embeddings(), model.lm_head)])
        return original_forward(layer, inputs, device)

    monkeypatch.setattr(streamed_module, "empty_model", empty)
    monkeypatch.setattr(streamed_module, "layer_forward", watched)
    streamed_perplexity(folder, AutoTokenizer.from_pretrained(folder), SMALL)
    assert seen == [[True, False, False, False], [False, True, False, False]]
    assert all(p.is_meta for p in models[0].parameters())


def test_cli_streamed_baseline(tokenizer_dir, tmp_path, monkeypatch):
    """lowbit eval --stream-baseline: the baseline figure without loading the baseline, and its bytes
    from the shards' headers."""
    import json

    from lowbit.evaluate.suite import Reference
    from lowbit.app.cli import main

    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    folder = save_sharded_tiny(tmp_path / "llama", "llama", tokenizer_dir)

    def never(self):
        raise AssertionError("the streamed baseline was loaded")

    monkeypatch.setattr(Reference, "get", never)
    quick = [f"evaluate.perplexity.{k}" for k in ("context_len=64", "stride=64", "max_tokens=300")]
    code = main(["eval", str(folder), "--baseline", str(folder), "--stream-baseline", "--output", str(tmp_path / "ev"),
                 *[x for item in quick for x in ("--set", item)], "--set", "evaluate.memory.measure_peak=false"])
    assert code == 0
    results = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert results["quality"]["baseline_perplexity"] == results["quality"]["perplexity"]
    params = sum(p.numel() for p in load_model(str(folder))[0].parameters())
    assert results["memory"]["baseline_weight_bytes"] == 2 * params


def test_cli_streamed_baseline_needs_a_folder(capsys):
    from lowbit.app.cli import main

    assert main(["eval", "smollm2-135m", "--baseline", "org/not-a-folder", "--stream-baseline"]) != 0
    assert "local folder" in capsys.readouterr().err


def test_smollm2_streamed_equals_resident(smollm2):
    model, tokenizer = smollm2
    protocol = PerplexityProtocol(max_tokens=1024)
    resident = perplexity(model, tokenizer, protocol)
    assert streamed_perplexity(resolve_model_path("smollm2-135m"), tokenizer, protocol) == resident
