"""Memory formulas against measured tensors: a real DynamicCache, the model's own weights."""
import pytest
import torch

from lowbit.evaluate.config import MemoryConfig
from lowbit.evaluate.memory import (GIB, ModelShape, activation_bytes, fit_table, kv_cache_bytes,
                                    measure_peak, model_weight_bytes, packed_tensor_bytes,
                                    predicted_total, resident_tensor_bytes)
from lowbit.evaluate.suite import kv_bytes_per_element
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.quantize.grids.kv import KVCacheConfig
from export_helpers import load_without_tokenizer


def _cache_tensors_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("dtype,kv_bytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_kv_formula_matches_dynamic_cache(tiny_llama, dtype, kv_bytes):
    from transformers import DynamicCache

    from lowbit.calibrate.cached_forward import cached_forward

    model = tiny_llama.to(dtype)
    shape = ModelShape.from_config(model.config)
    cache = DynamicCache(config=model.config)
    batch, prompt, steps = 3, 17, 4
    with torch.no_grad():
        out, _ = cached_forward(model, torch.randint(3, 500, (batch, prompt)), cache)
        for _ in range(steps):  # decode steps append one token each
            nxt = out.logits[:, -1:].argmax(-1)
            out, _ = cached_forward(model, nxt, cache)
    assert cache.get_seq_length() == prompt + steps
    assert kv_cache_bytes(shape, prompt + steps, batch, kv_bytes) == _cache_tensors_bytes(cache)


def test_model_shape_reads_several_config_spellings(tiny_model):
    shape = ModelShape.from_config(tiny_model.config)
    assert shape.layers == 2 and shape.hidden == 128 and shape.vocab == 512
    assert shape.heads * shape.head_dim >= shape.hidden or shape.head_dim == 32


def test_weights_in_prediction_are_the_tensors_bytes(tiny_llama):
    shape = ModelShape.from_config(tiny_llama.config)
    weights = model_weight_bytes(tiny_llama)
    buffers = sum(b.numel() * b.element_size() for b in tiny_llama.buffers())  # rotary inv_freq
    assert resident_tensor_bytes(tiny_llama) == weights + buffers
    total = predicted_total(weights, shape, batch=2, context=64, kv_bytes=2, act_bytes=2)
    assert total["total"] == weights + total["kv_cache"] + total["activations"]
    # hand-computed: mlp width 2*128 + 3*256 = 1024 > attention width; logits 2 x 512 x 4 bytes
    assert total["activations"] == 2 * 64 * 1024 * 2 + 2 * 512 * 4


@pytest.mark.parametrize("bits,group", [(4, 32), (3, 64), (8, None)])
def test_decode_bytes_count_codes_at_their_bit_width_whatever_the_backend(bits, group):
    """A (64, 256) layer: codes bits/8 bytes per weight (not QuantLinear's int8 storage), scales
    float32, bias; the same with the reference path and with every kernel variant attached."""
    from lowbit.quantize.runtime import backends
    from lowbit.quantize.grids.integer import IntScheme, quantize_rtn
    from lowbit.quantize.runtime.qlinear import QuantLinear

    scheme = IntScheme(bits, True, "group" if group else "channel", group)
    layer = QuantLinear.from_quantized(quantize_rtn(torch.randn(64, 256), scheme), torch.zeros(64))
    scales = 64 * (256 // group if group else 1) * 4
    expected = 64 * 256 * bits // 8 + scales + 64 * 4
    assert resident_tensor_bytes(layer) == 64 * 256 + scales + 64 * 4
    for backend in ("reference", "auto", "cpu_avx2"):
        backends.prepare(layer, backend)
        assert packed_tensor_bytes(layer) == expected


def test_fit_table_is_the_largest_that_fits():
    shape = ModelShape(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152)
    weights = int(0.1 * GIB)
    rows = fit_table(weights, shape, (1, 8), fit_context=1024, kv_bytes=2, act_bytes=2)

    def total(b, t):
        return predicted_total(weights, shape, b, t, 2, 2)["total"]

    for row in rows:
        budget = row["budget_gib"] * GIB
        t, b = row["max_context"], row["max_sequences"]
        assert total(1, t) <= budget < total(1, t + 1)
        assert total(b, 1024) <= budget < total(b + 1, 1024)
    assert rows[1]["max_context"] > rows[0]["max_context"]


def test_fit_table_reports_zero_when_weights_exceed_budget():
    shape = ModelShape(2, 64, 128, 4, 2, 16, 100)
    row, = fit_table(2 * GIB, shape, (1,), fit_context=16, kv_bytes=2, act_bytes=2)
    assert row["max_context"] == 0 and row["max_sequences"] == 0


@pytest.mark.parametrize("cfg,expected", [(KVCacheConfig("int8", "tensor"), 1.0), (KVCacheConfig("fp8", "head"), 1.0),
                                          (KVCacheConfig("int4", "token"), 0.5)], ids=str)
def test_kv_bytes_come_from_the_reloaded_checkpoints_kv_cache(tmp_path, cfg, expected):
    """What the checkpoint holds decides, not what a step was called; an explicit kv_bytes does
    not override a cache the checkpoint really quantizes."""
    from test_export_kv_cache import with_kv

    out = checkpoint.save(with_kv(cfg), None, tmp_path / "ckpt", ExportConfig(dtype="float32"))
    loaded, _ = load_without_tokenizer(out)
    assert kv_bytes_per_element(loaded, MemoryConfig()) == expected
    assert kv_bytes_per_element(loaded, MemoryConfig(kv_bytes=4.0)) == expected


def test_kv_bytes_without_a_quantized_cache_are_the_configs_or_16_bit(tiny_llama):
    assert kv_bytes_per_element(tiny_llama, MemoryConfig()) == 2.0
    assert kv_bytes_per_element(tiny_llama, MemoryConfig(kv_bytes=4.0)) == 4.0


def test_measured_peak_is_not_hidden_by_garbage_freed_while_it_runs():
    """Garbage collected inside fn used to drop RSS under the baseline, so a 256 MiB tensor
    read as a 0-byte increase (seen once in CI); the measurement collects garbage first."""
    import gc

    class Cycle:
        pass

    size = 256 * 2**20
    enabled = gc.isenabled()
    gc.disable()
    try:
        garbage = Cycle()
        garbage.me, garbage.t = garbage, torch.ones(2 * size // 4)  # held only by its own cycle
        del garbage

        def allocate():
            gc.collect()  # as an automatic collection running inside fn would
            t = torch.ones(size // 4)
            return float(t[-1])

        _, peak = measure_peak(allocate, torch.device("cpu"))
    finally:
        if enabled:
            gc.enable()
    assert peak["increase_bytes"] >= 0.9 * size
