"""FP8 W8A8 perplexity on smollm2-135m (pinned wiki protocol), in memory, and its parts.

    python bench/fp8_smollm2.py --weights channel --activations dynamic [--rounding gptq]
    python bench/fp8_smollm2.py --weights float --activations dynamic   # activations alone
    python bench/fp8_smollm2.py --weights channel --activations none    # weights alone
"""
import argparse
import time

import torch
from torch import nn

from lowbit.quantize.grids.fp8 import FP8Scheme
from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.data import CalibrationConfig, calibration_batches
from lowbit.calibrate.models import load_model
from lowbit.evaluate.baseline import cached_baseline
from lowbit.evaluate.config import PerplexityProtocol
from lowbit.evaluate.perplexity import perplexity
from lowbit.quantize.steps import fp8 as fp8_step
from lowbit.quantize.grids.fp8 import dynamic_token_scale, fake_quantize_activation
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.targets import replace_module, select_targets


class FP8InputsOnly(nn.Module):
    """A float linear whose inputs are rounded to E4M3 per token: the activations' share alone."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(fake_quantize_activation(x, dynamic_token_scale(x, "e4m3"), "e4m3"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", choices=["tensor", "channel", "block", "float"], default="channel")
    p.add_argument("--activations", choices=["dynamic", "static", "none"], default="dynamic")
    p.add_argument("--rounding", choices=["nearest", "gptq"], default="nearest")
    p.add_argument("--samples", type=int, default=64, help="calibration samples (static, gptq)")
    args = p.parse_args()
    torch.manual_seed(0)
    model, tok, _ = load_model("smollm2-135m")
    protocol = PerplexityProtocol()
    base = cached_baseline("smollm2-135m", protocol, lambda: perplexity(model, tok, protocol))["perplexity"]
    cal = CalibrationConfig(samples=args.samples)
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: calibration_batches(cal, tok))
    start = time.time()
    if args.weights == "float":
        if args.activations != "dynamic":
            p.error("--weights float measures dynamic activations alone")
        for name, module in select_targets(model, ctx.arch, ctx.ignore).linears.items():
            replace_module(model, name, FP8InputsOnly(module))
    else:
        fp8_step.apply(ctx, fp8_step.FP8Config(scheme=FP8Scheme(strategy=args.weights), activations=args.activations, rounding=args.rounding))
    quantize_s = time.time() - start
    ppl = perplexity(model, tok, protocol)["perplexity"]
    print(f"fp8 weights={args.weights} activations={args.activations} rounding={args.rounding}: "
          f"ppl {ppl:.3f} ({100 * (ppl / base - 1):+.2f}% vs the unquantized {base:.3f}) [quantize {quantize_s:.0f}s]")


if __name__ == "__main__":
    main()
