"""evaluate.device / evaluate.dtype: resolved per machine, the model and its reference placed
alike, the dtype recorded, and a baseline measured in one dtype never served for another."""
import pytest
import torch

from lowbit.evaluate import baseline
from lowbit.evaluate.config import EvaluateConfig, KLConfig, MemoryConfig, PerplexityProtocol
from lowbit.evaluate.evaluation import evaluate
from lowbit.evaluate.placement import placement_of, resolve_placement
from lowbit.evaluate.suite import Reference
from tiny_models import save_tiny_llama


def test_auto_is_the_cpu_in_float32_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_placement().describe() == {"device": "cpu", "dtype": "float32"}
    assert resolve_placement("cpu", "bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="evaluate.device is cuda but torch sees no GPU"):
        resolve_placement("cuda")
    with pytest.raises(ValueError, match="evaluate.dtype must be auto or one of"):
        resolve_placement("cpu", "int8")


def test_auto_is_a_gpu_in_bfloat16_where_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_placement().describe() == {"device": "cuda", "dtype": "bfloat16"}
    assert resolve_placement("cuda", "float16").dtype == torch.float16
    assert resolve_placement("cpu").describe() == {"device": "cpu", "dtype": "float32"}


def test_baseline_cache_keeps_dtypes_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    proto = PerplexityProtocol()
    cpu32 = {"device": "cpu", "dtype": "float32"}
    bf16 = {"device": "cuda", "dtype": "bfloat16"}
    assert baseline.cache_key("m", proto) == baseline.cache_key("m", proto, cpu32)  # former keys stay valid
    assert baseline.cache_key("m", proto, bf16) != baseline.cache_key("m", proto, cpu32)
    calls = []
    measure = lambda: calls.append(1) or {"perplexity": float(len(calls))}  # noqa: E731
    assert baseline.cached_baseline("m", proto, measure, cpu32)["perplexity"] == 1.0
    assert baseline.cached_baseline("m", proto, measure, bf16)["perplexity"] == 2.0
    assert baseline.cached_baseline("m", proto, measure, bf16)["cached"] is True


def test_evaluation_runs_model_and_reference_in_the_asked_dtype(tmp_path, monkeypatch):
    """bfloat16 on the CPU: the model and its loaded reference both in bfloat16, the dtype in the
    results, the baseline measured in bfloat16 (not taken from a float32 figure), and perplexity
    within bfloat16's rounding of the float32 evaluation."""
    folder = save_tiny_llama(tmp_path / "tiny")  # before the empty cache: the tokenizer comes from the shared one
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    loaded = []

    def load():
        from lowbit.calibrate.models import load_model

        loaded.append(load_model(str(folder))[0])
        return loaded[-1]

    proto = PerplexityProtocol(context_len=64, stride=64, max_tokens=256)
    results = {}
    for dtype in ("float32", "bfloat16"):
        cfg = EvaluateConfig(device="cpu", dtype=dtype, perplexity=proto, kl=KLConfig(max_tokens=128),
                             memory=MemoryConfig(measure_peak=False))
        results[dtype] = evaluate(folder, cfg, Reference(str(folder), load))
    assert [placement_of(m) for m in loaded] == [{"device": "cpu", "dtype": d} for d in ("float32", "bfloat16")]
    f32, b16 = results["float32"], results["bfloat16"]
    assert (f32.model.dtype, b16.model.dtype) == ("float32", "bfloat16")
    assert b16.quality.protocol["dtype"] == "bfloat16" and b16.quality.protocol["device"] == "cpu"
    # the same model as its own reference: its baseline is its perplexity in each dtype
    assert f32.quality.baseline_perplexity == pytest.approx(f32.quality.perplexity, rel=1e-6)
    assert b16.quality.baseline_perplexity == pytest.approx(b16.quality.perplexity, rel=1e-6)
    assert b16.quality.perplexity != f32.quality.perplexity
    assert b16.quality.perplexity == pytest.approx(f32.quality.perplexity, rel=0.02)
    assert b16.quality.kl["kl_mean"] == pytest.approx(0.0, abs=1e-6)
