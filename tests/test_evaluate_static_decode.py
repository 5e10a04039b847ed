"""Static-cache and compiled decoding for the speed measurement (evaluate/static_decode.py) on a
tiny random llama: the same greedy tokens as eager decoding, the mode that ran recorded, and a
fallback to eager (saying why) where the model cannot decode that way.

Inductor compiles once in this file (the `compiled` fixture; tens of seconds on a small CPU); the
other compiled cases reuse its graph or fail in dynamo's tracing, before inductor."""
import pytest
import torch
from torch._dynamo.utils import counters

from tiny_models import TINY

from lowbit.evaluate import static_decode
from lowbit.evaluate.config import SpeedConfig
from lowbit.evaluate.speed import compare_speed, speed_at_batch, timed_generation
from lowbit.evaluate.static_decode import prepared_decoder, resolve_decode_mode

BATCH, PROMPT_LEN, NEW_TOKENS = 2, 8, 4
ROW_KEYS = {"batch", "prefill_tok_s", "ttft_s", "tpot_s", "decode_tok_s", "bytes_per_step", "achieved_gbs",
            "roofline_tpot_s", "roofline_decode_tok_s", "decode"}


def speed_cfg(decode: str, **kw) -> SpeedConfig:
    return SpeedConfig(enabled=True, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, batch_sizes=(BATCH,),
                       warmup=0, repeats=1, decode=decode, **kw)


@pytest.fixture(scope="module")
def model():
    """A tiny random llama (hidden 64, 2 layers, vocabulary 256)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**TINY, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256},
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    # speed_at_batch's prompts for seed 0: a compiled graph made here serves it too
    return torch.randint(0, 256, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def eager_tokens(model, prompts):
    return timed_generation(model, prompts, NEW_TOKENS)["tokens"]


@pytest.fixture(scope="module")
def compiled(model, prompts):
    """(decoder, recorded mode, dynamo graphs made so far) after the file's one inductor compile."""
    decoder, decode = prepared_decoder(model, "compiled", prompts, NEW_TOKENS)
    return decoder, decode, counters["stats"]["unique_graphs"]


def test_auto_is_compiled_on_cuda_and_eager_on_the_cpu():
    assert resolve_decode_mode("auto", torch.device("cuda")) == "compiled"
    assert resolve_decode_mode("auto", torch.device("cpu")) == "eager"
    assert resolve_decode_mode("static", torch.device("cpu")) == "static"
    with pytest.raises(ValueError, match="decode mode"):
        resolve_decode_mode("graphs", torch.device("cpu"))


def test_static_decode_gives_the_eager_tokens(model, prompts, eager_tokens):
    decoder, decode = prepared_decoder(model, "static", prompts, NEW_TOKENS)
    assert decode == {"decode": "static"}
    for layer in decoder.cache.layers:  # allocated by prepare: the batch, prompt + new tokens, the model's dtype
        assert layer.keys.shape[0] == BATCH and layer.keys.shape[2] == PROMPT_LEN + NEW_TOKENS
        assert layer.keys.dtype == layer.values.dtype == torch.float32
    for _ in range(2):  # the cache is reset and reused between runs
        run = timed_generation(model, prompts, NEW_TOKENS, decoder)
        assert torch.equal(run["tokens"], eager_tokens)
        assert run["prefill_s"] > 0 and len(run["step_s"]) == NEW_TOKENS - 1
    assert eager_tokens.shape == (BATCH, NEW_TOKENS)


def test_compiled_decode_gives_the_eager_tokens_without_compiling_in_timed_runs(model, prompts, eager_tokens,
                                                                               compiled):
    decoder, decode, graphs = compiled
    assert decode == {"decode": "compiled"}, decode
    assert graphs >= 1
    for _ in range(2):
        run = timed_generation(model, prompts, NEW_TOKENS, decoder)
        assert torch.equal(run["tokens"], eager_tokens)
        assert len(run["step_s"]) == NEW_TOKENS - 1
    # a fresh decoder of the same model and batch (as speed_at_batch makes) reuses the graph
    row = speed_at_batch(model, speed_cfg("compiled"), BATCH, bandwidth=1e10)
    assert row["decode"] == "compiled" and "decode_fallback" not in row
    assert row["tpot_s"] > 0 and row["decode_tok_s"] == BATCH / row["tpot_s"]
    assert counters["stats"]["unique_graphs"] == graphs  # prepared once: timed runs compiled nothing


def test_a_quantized_kv_cache_falls_back_to_eager_and_says_why(model, prompts, eager_tokens):
    from lowbit.quantize.grids.kv import KVCacheConfig
    from lowbit.quantize.runtime import kv_cache

    kv_cache.attach(model, KVCacheConfig("int8", "token"))  # dynamic scales: no calibration needed
    try:
        decoder, decode = prepared_decoder(model, "compiled", prompts, NEW_TOKENS)
        row = speed_at_batch(model, speed_cfg("static"), BATCH, bandwidth=1e10)
    finally:
        kv_cache.detach(model)
    assert decoder is None and decode["decode"] == "eager"
    assert "quantized KV cache" in decode["decode_fallback"]
    assert row["decode"] == "eager" and row["decode_fallback"].startswith("static unsupported:")
    assert row["tpot_s"] > 0 and row["ttft_s"] > 0


def test_a_graph_break_falls_back_to_eager_and_says_why(model, prompts, monkeypatch):
    def breaking_step(model, inputs, extra):
        torch._dynamo.graph_break()
        return static_decode.step_logits(model, inputs, extra)

    # dynamo stops at the break, before any backend compiles: a real failure at no inductor cost
    monkeypatch.setattr(static_decode, "compiled_step_logits",
                        lambda device: torch.compile(breaking_step, fullgraph=True, backend="eager"))
    row = speed_at_batch(model, speed_cfg("compiled"), BATCH, bandwidth=1e10)
    assert row["decode"] == "eager"
    assert row["decode_fallback"].startswith("compiled failed: ") and "break" in row["decode_fallback"].lower()
    assert row["tpot_s"] > 0


def test_compare_speed_static_reports_the_usual_figures(model):
    cfg = SpeedConfig(enabled=True, prompt_len=PROMPT_LEN, new_tokens=3, batch_sizes=(1, 2), warmup=1, repeats=1,
                      decode="static")
    out = compare_speed({"model": model, "baseline": model}, cfg)
    assert out["bandwidth_gbs"] > 0 and out["new_tokens"] == 3
    for name in ("model", "baseline"):
        assert set(out[name]) == {"1", "2"}
        for batch, row in out[name].items():
            assert set(row) == ROW_KEYS and row["decode"] == "static" and row["batch"] == int(batch)
            assert row["decode_tok_s"] == int(batch) / row["tpot_s"]
            assert abs(row["roofline_decode_tok_s"] * row["roofline_tpot_s"] - int(batch)) < 1e-9
