"""KV-cache schemes on smollm2-135m: memory after a 2000-token prefill + 4 decode steps, and
perplexity (pinned wiki protocol) with float weights and the quantized KV cache alone.

Usage: python bench/kv_cache_smollm2.py CALIB_SAMPLES SCHEME/STRATEGY...  (e.g. 32 int8/tensor fp8/tensor)
"""
import json, sys, time, torch
from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.data import CalibrationConfig, calibration_batches
from lowbit.calibrate.models import load_model
from lowbit.calibrate.observers import cached_kv_absmax
from lowbit.evaluate.baseline import cached_baseline
from lowbit.evaluate.config import PerplexityProtocol
from lowbit.evaluate.kv_cache import measure_kv_cache
from lowbit.evaluate.perplexity import eval_tokens, perplexity
from lowbit.quantize.runtime import kv_cache
from lowbit.quantize.steps import kv_cache as kv_cache_step
from lowbit.quantize.grids.kv import KVCacheConfig

model, tok, _ = load_model("smollm2-135m")
proto = PerplexityProtocol()
base = cached_baseline("smollm2-135m", proto, lambda: perplexity(model, tok, proto))["perplexity"]  # float weights, float cache
batches = calibration_batches(CalibrationConfig(samples=int(sys.argv[1])), tok)
t = time.time(); stats = cached_kv_absmax(model, batches); print(f"calibrated on {tuple(batches.shape)} [{time.time()-t:.0f}s]", flush=True)
attns = kv_cache.attention_modules(model, arch_for(model))
prompt = eval_tokens(tok, proto)[:2000][None]
print(json.dumps({"float": measure_kv_cache(model, prompt)}), flush=True)
for spec in sys.argv[2:]:
    scheme, strategy = spec.split("/")
    cfg = KVCacheConfig(scheme, strategy)
    kv_cache_step.set_scales(attns, stats, cfg)
    kv_cache.attach(model, cfg)
    mem = measure_kv_cache(model, prompt)
    t = time.time(); p = perplexity(model, tok, proto)["perplexity"]
    print(json.dumps({spec: {"perplexity": round(p, 4), "baseline": round(base, 4), "vs_baseline_pct": round(100 * (p / base - 1), 3),
                             "ppl_s": round(time.time() - t), **mem}}), flush=True)
    kv_cache.detach(model)
