"""A KV-cache scheme survives export: scales in the file, the quantized cache re-attached on load."""
import json

import pytest
import torch

from export_helpers import compare_logits, load_without_tokenizer, quantized_tiny, token_ids
from lowbit.calibrate.arch import arch_for
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.quantize.runtime import kv_cache
from lowbit.quantize.steps import kv_cache as kv_cache_step
from lowbit.quantize.grids.kv import KVCacheConfig
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.steps.context import StepContext


def with_kv(cfg: KVCacheConfig):
    model = quantized_tiny(IntScheme(bits=8, strategy="channel"))
    batches = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(1))
    kv_cache_step.apply(StepContext(model, arch_for(model), ("lm_head",), lambda: batches), cfg)
    return model


@pytest.mark.parametrize("cfg", [KVCacheConfig("int8", "tensor"), KVCacheConfig("fp8", "head"),
                                 KVCacheConfig("int8", "token")], ids=str)
def test_kv_scheme_round_trips_through_lowbit(tmp_path, cfg):
    model = with_kv(cfg)
    out = checkpoint.save(model, None, tmp_path / "ckpt", ExportConfig(dtype="float32"))
    config = json.loads((out / "config.json").read_text())
    scheme = config["quantization_config"]["kv_cache_scheme"]
    assert scheme["num_bits"] == 8 and scheme["dynamic"] is (cfg.strategy == "token")
    loaded, _ = load_without_tokenizer(out)
    assert loaded.lowbit_kv_cache == cfg
    attn = loaded.get_submodule("model.layers.1.self_attn")
    if cfg.static:
        assert torch.equal(attn.k_scale, model.get_submodule("model.layers.1.self_attn").k_scale)
    agree, diff = compare_logits(model, loaded, token_ids())
    assert agree == 1.0 and diff < 1e-5
    kv_cache.detach(loaded)  # the float cache gives different logits: the KV scheme is really in use
    assert compare_logits(model, loaded, token_ids())[1] > 1e-5


def test_transformers_loads_an_export_with_a_kv_scheme(tmp_path):
    from transformers import AutoModelForCausalLM

    model = with_kv(KVCacheConfig("fp8", "tensor"))
    out = checkpoint.save(model, None, tmp_path / "ckpt", ExportConfig(dtype="float32"))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # compressed-tensors quantizes K/V itself (a `kv_cache` module on each attention) only where the
    # attention names its cache `past_key_values` (transformers 5.17); where it is `cache` (newer
    # 5.x) transformers keeps a float cache. Either way, compare like with like
    if not any(name.endswith("self_attn.kv_cache") for name, _ in hf.named_modules()):
        kv_cache.detach(model)
    agree, diff = compare_logits(model, hf, token_ids())
    assert agree >= 0.999 and diff < 1e-4
