"""GPTQ calibration benchmark on smollm2-135m: wall time, peak RSS and perplexity.

    python bench/calibration.py                 # W4A16 group 64, 64 x 512 wiki
    python bench/calibration.py --json --samples 16 --no-eval

calibration_s is wall time; calibration_cpu_s the CPU time of all threads (a steadier figure
when other work shares the cores). Peak RSS is the process's high-water mark (resource.getrusage), model loading included.
Perplexity is measured on the quantized model in memory under the pinned protocol.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch

from lowbit.quantize.grids.integer import IntScheme
from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.data import CalibrationConfig, calibration_batches
from lowbit.calibrate.models import load_model
from lowbit.evaluate.config import PerplexityProtocol
from lowbit.evaluate.perplexity import perplexity
from lowbit.quantize.steps import gptq
from lowbit.quantize.steps.context import StepContext


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dataset", default="wiki", help="calibration text")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64, help="0 for per-channel")
    p.add_argument("--actorder", default="static", choices=["none", "static", "group"])
    p.add_argument("--dampening-frac", type=float, default=0.1)
    p.add_argument("--scale-search", default="mse", choices=["minmax", "mse"])
    p.add_argument("--forward-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--true-sequential", action="store_true",
                   help="re-record inputs after each linear group (the recipe does not)")
    p.add_argument("--eval-dataset", default="wiki", help="comma-separated: wiki,news evaluates both")
    p.add_argument("--no-eval", action="store_true", help="skip the perplexity evaluation")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    return p.parse_args(argv)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main(argv=None) -> dict:
    args = parse_args(argv)
    model, tokenizer, _ = load_model(args.model)
    calib = CalibrationConfig(dataset=args.dataset, samples=args.samples, seq_len=args.seq_len)
    batches = calibration_batches(calib, tokenizer)
    grouped = args.group_size > 0
    cfg = gptq.GPTQConfig(scheme=IntScheme(args.bits, True, "group" if grouped else "channel", args.group_size if grouped else None), actorder=args.actorder, dampening_frac=args.dampening_frac, scale_search=args.scale_search, forward_dtype=args.forward_dtype, true_sequential=args.true_sequential)
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: batches)
    start, cpu_start = time.perf_counter(), cpu_seconds()
    detail = gptq.apply(ctx, cfg)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    out = {"model": args.model, "samples": args.samples, "seq_len": args.seq_len,
           "calibration_dataset": args.dataset, "bits": args.bits, "group_size": args.group_size,
           "actorder": args.actorder, "dampening_frac": args.dampening_frac, "scale_search": args.scale_search,
           "forward_dtype": detail["forward_dtype"], "true_sequential": cfg.true_sequential,
           "calibration_s": round(wall, 2), "calibration_cpu_s": round(cpu, 2), "peak_rss_mb": round(peak_rss_mb()),
           "threads": torch.get_num_threads(), "damping_retries": len(detail["damping_retries"])}
    if not args.no_eval:
        for dataset in args.eval_dataset.split(","):
            measured = perplexity(model, tokenizer, PerplexityProtocol(dataset=dataset))
            out[f"perplexity_{dataset}"] = round(measured["perplexity"], 4)
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>22}: {value}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
