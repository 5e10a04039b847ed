"""Measured peak memory in a fresh process: what a prefill really adds, beside the prediction."""
import subprocess
import sys
import textwrap

import pytest

from lowbit.evaluate.config import MemoryConfig
from lowbit.evaluate.memory import ModelShape, predicted_total
from lowbit.evaluate.peak_probe import Loadable, measure_in_subprocess
from lowbit.evaluate.suite import measured_prefill_peak
from tiny_models import save_tiny_llama

MIB = 2**20


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A 4-layer tiny llama folder (26 MiB of float32 weights, smollm2's tokenizer)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", layers=4)


def test_measure_peak_in_a_fresh_process_sees_a_large_allocation(tmp_path):
    """Replaces the in-process check that was flaky after export tests (pages earlier tests
    freed stayed resident); in a fresh interpreter, as evaluation now measures, 256 MiB shows."""
    script = textwrap.dedent("""
        import torch
        from lowbit.evaluate.memory import measure_peak
        def allocate():
            t = torch.ones(256 * 2**20 // 4)  # float32, touched so the pages are resident
            return float(t[-1])
        result, peak = measure_peak(allocate, torch.device("cpu"))
        print(result, peak["increase_bytes"], peak["peak_bytes"] - peak["before_bytes"])
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True)
    result, increase, span = done.stdout.split()
    assert float(result) == 1.0
    assert int(increase) == int(span) >= 256 * MIB


def test_a_prefill_that_caches_more_shows_at_least_that_much_more(tiny_folder):
    """Batch 8 caches N more bytes than batch 1 (the probe weighs the cache tensors); the
    measured increase grows by at least N. The loaded model is counted apart from the prefill."""
    small = measure_in_subprocess(Loadable(str(tiny_folder)), batch=1, context=1024, decode_tokens=2)
    large = measure_in_subprocess(Loadable(str(tiny_folder)), batch=8, context=1024, decode_tokens=2)
    more_cache = large["cache_bytes"] - small["cache_bytes"]
    assert more_cache == 7 * 4 * 2 * 2 * 32 * 4 * 1026  # 7 more sequences x 4 layers x K,V x 2 heads x 32 x fp32
    assert large["increase_bytes"] - small["increase_bytes"] >= more_cache
    for r in (small, large):
        assert r["process"] == "fresh subprocess" and r["peak_bytes"] >= r["before_bytes"] + r["increase_bytes"] - 1
        # the weights are resident before the prefill starts, not in its increase
        assert r["model_tensor_bytes"] <= r["model_resident_bytes"] < r["model_tensor_bytes"] + 100 * MIB


def test_prediction_and_measurement_agree_within_a_factor_of_two(tiny_folder):
    """The formula (KV cache exact, activations an estimate) against the fresh process's measured
    increase for a 4 x 2048 prefill + 4 decoded tokens of the tiny llama: measured 1.24-1.33x the
    prediction here (SDPA and rotary temporaries the estimate leaves out); the test allows 1-2x."""
    from transformers import AutoModelForCausalLM

    cfg = MemoryConfig(batch=4, context=2048, measure_context=2048, measure_decode_tokens=4)
    model = AutoModelForCausalLM.from_pretrained(tiny_folder)  # as evaluation holds it: float32
    shape = ModelShape.from_config(model.config)
    peak = measured_prefill_peak(model, shape, cfg, Loadable(str(tiny_folder)))
    assert peak["predicted_kv_cache"] == predicted_total(0, shape, 4, 2052, 4, 4)["kv_cache"] == peak["cache_bytes"]
    ratio = peak["increase_bytes"] / peak["predicted_kv_plus_activations"]
    assert 1.0 <= ratio <= 2.0, ratio


def test_a_failing_subprocess_is_an_error_naming_the_target(tmp_path):
    with pytest.raises(RuntimeError, match=r"peak-memory subprocess for .*nowhere.* exited with status 1"):
        measure_in_subprocess(Loadable(str(tmp_path / "nowhere")), batch=1, context=8, decode_tokens=1)

