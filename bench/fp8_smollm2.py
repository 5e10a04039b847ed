"""FP8 W8A8 perplexity on smollm2-135m (pinned wiki protocol), in memory.

Usage: python bench/fp8_smollm2.py WEIGHTS(tensor|channel|block) ACTIVATIONS(dynamic|static|none) [CALIB_SAMPLES]
"""
import sys, time, torch
from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.data import CalibrationConfig, calibration_batches
from lowbit.calibrate.models import load_model
from lowbit.evaluate.config import PerplexityProtocol
from lowbit.evaluate.perplexity import perplexity
from lowbit.quantize import fp8_step
from lowbit.quantize.step import StepContext

weights, acts = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model, tok, _ = load_model("smollm2-135m")
cal = CalibrationConfig(samples=int(sys.argv[3]) if len(sys.argv) > 3 else 64)
ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: calibration_batches(cal, tok))
fp8_step.apply(ctx, fp8_step.FP8Config(weights=weights, activations=acts))
t = time.time()
r = perplexity(model, tok, PerplexityProtocol())
print(f"fp8 weights={weights} activations={acts}: ppl {r['perplexity']:.3f} ({100*(r['perplexity']/16.687-1):+.2f}% vs 16.687) [{time.time()-t:.0f}s]")
