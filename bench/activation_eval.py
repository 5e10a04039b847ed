"""Prefill-sized evaluation speed of W8A8 (INT8 and FP8) against the float32 model, smollm2-135m.

    python bench/activation_eval.py                       # this CPU as it is
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 LOWBIT_CPU_ISA=avx2 python bench/activation_eval.py
    ... --int8-matmul int_mm --torch-mkldnn off   # what W8A8 did before on an AVX2 CPU: torch._int_mm
        # as such a CPU runs it, a scalar loop (torch uses oneDNN only with AVX512-VNNI, which the
        # variables above cannot hide; with oneDNN off it takes the loop here too)

Each model scores the same perplexity windows (the pinned wiki protocol, cut to --tokens); the
models take turns, --rounds times, after one warm-up each, and the median wall time is reported
with its ratio to float32 (a ratio, because other work on the cores moves absolute times; with
more threads than free cores, every parallel op can wait a scheduler slice: --threads 1 then
measures the work more faithfully).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.hardware import cpu_info
from lowbit.calibrate.models import load_model
from lowbit.evaluate.config import PerplexityProtocol
from lowbit.evaluate.perplexity import perplexity
from lowbit.quantize.runtime import int8_inputs as activation
from lowbit.quantize.steps import fp8 as fp8_step
from lowbit.quantize.steps import int8_inputs as input_quant
from lowbit.quantize.steps import rtn
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.steps.context import StepContext


def quantized_twins(model) -> dict:
    """float32, W8A8 int8 (per-channel weights, per-token dynamic inputs) and FP8 dynamic."""
    int8, fp8 = copy.deepcopy(model), copy.deepcopy(model)
    ctx = StepContext(int8, arch_for(int8), ("lm_head",), lambda: None)
    rtn.apply(ctx, rtn.RTNConfig(IntScheme(8, strategy="channel")))
    input_quant.apply(ctx, input_quant.InputQuantConfig())
    fp8_step.apply(StepContext(fp8, arch_for(fp8), ("lm_head",), lambda: None), fp8_step.FP8Config())
    return {"float32": model, "w8a8-int8": int8, "w8a8-fp8": fp8}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="evaluation tokens (512-token windows)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--torch-mkldnn", choices=["on", "off"], default="on")
    p.add_argument("--int8-matmul", choices=["auto", "int_mm"], default="auto",
                   help="int_mm: torch._int_mm whatever the CPU (the path before calibrate.hardware chose)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", action="store_true", help="one JSON line per model")
    args = p.parse_args(argv)
    torch.backends.mkldnn.enabled = args.torch_mkldnn == "on"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.int8_matmul == "int_mm":
        activation.int_mm_fast = lambda module, x2d: True
    model, tokenizer, _ = load_model("smollm2-135m")
    models = quantized_twins(model)
    protocol = PerplexityProtocol(max_tokens=args.tokens)
    seconds = {name: [] for name in models}
    ppl = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, m in models.items():
            start = time.perf_counter()
            ppl[name] = perplexity(m, tokenizer, protocol)["perplexity"]
            if round_:
                seconds[name].append(time.perf_counter() - start)
    base = statistics.median(seconds["float32"])
    rows = [{"model": name, "seconds": round(statistics.median(s), 2),
             "ratio_to_float32": round(statistics.median(s) / base, 2), "perplexity": round(ppl[name], 3),
             "tokens": args.tokens, "cpu": cpu_info().describe(), "torch_isa": torch.backends.cpu.get_cpu_capability(),
             "torch_mkldnn": args.torch_mkldnn, "int8_matmul": args.int8_matmul, "threads": torch.get_num_threads()} for name, s in seconds.items()]
    for row in rows:
        print(json.dumps(row) if args.json else
              f"{row['model']:>10}: {row['seconds']:6.2f} s  x{row['ratio_to_float32']:.2f}  ppl {row['perplexity']}")
    if not args.json:
        print(f"CPU: {rows[0]['cpu']}; torch {rows[0]['torch_isa']}, mkldnn {args.torch_mkldnn}, "
              f"int8 matmul {args.int8_matmul}, {rows[0]['threads']} threads, median of {args.rounds}")
    return rows


if __name__ == "__main__":
    main()
