"""KL against a reference streamed one decoder layer at a time equals KL against it resident."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

import lowbit.evaluate.perplexity_streamed as streamed_module
from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.models import load_model, resolve_model_path
from lowbit.calibrate.streaming import is_resident
from lowbit.evaluate.config import KLConfig, PerplexityProtocol
from lowbit.evaluate.kl import kl_divergence
from lowbit.evaluate.kl_streamed import streamed_kl_divergence
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.steps import rtn
from lowbit.quantize.steps.context import StepContext
from streaming_models import save_sharded_tiny

# 7 windows of 64: a batch of 4 and a batch of 3 whose last window is shorter, so padded
SMALL = PerplexityProtocol(context_len=64, stride=64, max_tokens=1024)
KL = KLConfig(max_tokens=410)
W4 = IntScheme(bits=4, symmetric=True, strategy="group", group_size=32)


@pytest.fixture(scope="module")
def tokenizer_dir():
    return resolve_model_path("smollm2-135m")


def rtn_copy(folder):
    """The model in `folder` loaded and RTN-quantized to 4 bits (its head kept), as `lowbit run` would."""
    model = load_model(str(folder))[0]
    rtn.apply(StepContext(model, arch_for(model), ("lm_head",), lambda: None), rtn.RTNConfig(W4))
    return model


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text", "opt", "gpt2", "phi3"])
def test_streamed_kl_equals_resident(model_type, tokenizer_dir, tmp_path):
    """Tied heads (gemma3, opt, gpt2) and untied (llama, qwen2, phi3): every figure the same."""
    folder = save_sharded_tiny(tmp_path / model_type, model_type, tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    quantized = rtn_copy(folder)
    resident = kl_divergence(load_model(str(folder))[0], quantized, tokenizer, SMALL, KL)
    streamed = streamed_kl_divergence(folder, quantized, tokenizer, SMALL, KL)
    assert resident["kl_mean"] > 0 and resident["top1_agreement"] < 1  # the quantized copy differs
    assert resident["tokens"] == KL.max_tokens
    assert streamed == resident


def test_only_the_head_is_resident_while_the_model_runs(tokenizer_dir, tmp_path, monkeypatch):
    """While the evaluated model runs, the reference holds its head and no layer or embedding; while a
    reference layer runs, only that layer; once done, nothing; the model runs once per batch."""
    folder = save_sharded_tiny(tmp_path / "llama", "llama", tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    quantized = rtn_copy(folder)
    models, layer_seen, model_seen = [], [], []
    original_empty, original_forward = streamed_module.empty_model, streamed_module.layer_forward

    def parts(model):
        return [is_resident(m) for m in (*model.model.layers, model.get_input_embeddings(), model.lm_head)]

    def empty(*args, **kwargs):
        models.append(original_empty(*args, **kwargs))
        return models[-1]

    def watched(layer, inputs, device=None):
        layer_seen.append(parts(models[0]))
        return original_forward(layer, inputs, device)

    monkeypatch.setattr(streamed_module, "empty_model", empty)
    monkeypatch.setattr(streamed_module, "layer_forward", watched)
    quantized.register_forward_pre_hook(lambda module, args: model_seen.append(parts(models[0])))
    streamed_kl_divergence(folder, quantized, tokenizer, SMALL, KL)
    assert layer_seen == [[True, False, False, False], [False, True, False, False]]
    assert model_seen == [[False, False, False, True]] * 2  # two batches of windows
    assert all(p.is_meta for p in models[0].parameters())


def test_cli_streamed_baseline_reports_kl(tokenizer_dir, tmp_path, monkeypatch):
    """lowbit eval --stream-baseline: KL of another model against a baseline that is never loaded,
    the figures of resident KL."""
    from lowbit.evaluate.suite import Reference
    from lowbit.app.cli import main

    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    baseline = save_sharded_tiny(tmp_path / "base", "llama", tokenizer_dir)
    target = save_sharded_tiny(tmp_path / "other", "llama", tokenizer_dir, seed=1)

    def never(self):
        raise AssertionError("the streamed baseline was loaded")

    monkeypatch.setattr(Reference, "get", never)
    quick = ["evaluate.perplexity.context_len=64", "evaluate.perplexity.stride=64",
             "evaluate.perplexity.max_tokens=300", "evaluate.kl.max_tokens=200", "evaluate.memory.measure_peak=false"]
    code = main(["eval", str(target), "--baseline", str(baseline), "--stream-baseline",
                 "--output", str(tmp_path / "ev"), *[x for item in quick for x in ("--set", item)]])
    assert code == 0
    kl = json.loads((tmp_path / "ev" / "results.json").read_text())["quality"]["kl"]
    tokenizer = AutoTokenizer.from_pretrained(baseline)
    protocol = PerplexityProtocol(context_len=64, stride=64, max_tokens=300)
    expected = kl_divergence(load_model(str(baseline))[0], load_model(str(target))[0], tokenizer, protocol,
                             KLConfig(max_tokens=200))
    assert kl == expected and kl["kl_mean"] > 0


def test_smollm2_streamed_kl_equals_resident(smollm2):
    import copy

    model, tokenizer = smollm2
    quantized = copy.deepcopy(model)  # the session's model stays the baseline
    rtn.apply(StepContext(quantized, arch_for(quantized), ("lm_head",), lambda: None), rtn.RTNConfig(W4))
    protocol, cfg = PerplexityProtocol(), KLConfig(max_tokens=1024)
    resident = kl_divergence(model, quantized, tokenizer, protocol, cfg)
    assert resident["kl_mean"] > 0
    assert streamed_kl_divergence(resolve_model_path("smollm2-135m"), quantized, tokenizer, protocol, cfg) == resident
