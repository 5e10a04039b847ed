"""One SignRound step on a decoder layer of smollm2-135m, with the integer grid's compiled fake
weight (quantize/runtime/csrc/fake_quant.cpp) and with torch's operations, in one run.

    python bench/signround_step.py [--layer 0] [--batches 1 4] [--steps 20] [--repeats 3] [--json]

For each batch size (samples of 512 tokens per step) the layer learns `--steps` steps of the W4 g64
grid each way, alternately, `--repeats` times after one warm-up each; the seconds per step are the
medians, and the ratio is torch's over the compiled pass's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from lowbit.calibrate.arch import arch_for, linear_weight
from lowbit.calibrate.data import CalibrationConfig, calibration_batches
from lowbit.calibrate.hardware import cpu_info, denormals_flushed
from lowbit.calibrate.models import load_model
from lowbit.calibrate.walker import layer_forward, walk
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.grids.integer_learned import IntLearnedRounding
from lowbit.quantize.runtime import cpu_kernels
from lowbit.quantize.steps import signround

GRID = IntScheme(4, True, "group", 64)


class Stop(Exception):
    """Ends the walk once the layer was timed."""


def seconds_per_step(layer, names: list[str], inputs, wanted, steps: int, kernel) -> float:
    """Seconds per step of `steps` steps, the views fused with `kernel` (None: torch's operations)."""
    modules = {n: layer.get_submodule(n) for n in names}
    views = {n: IntLearnedRounding(linear_weight(m), GRID) for n, m in modules.items()}
    for view in views.values():
        view.fuse(kernel)
    cfg = signround.SignRoundConfig(scheme=GRID, iterations=steps, batch=len(inputs.hidden[0]))
    start = time.perf_counter()
    with signround.learning(layer, modules, views):
        signround.descend(layer, views, inputs, wanted, cfg, None)
    return (time.perf_counter() - start) / steps


def time_layer(model, batches, layer_index: int, batch: int, steps: int, repeats: int, kernel) -> dict:
    arch, found = arch_for(model), {}

    def on_layer(i, prefix, layer, inputs):
        if i < layer_index:
            return {"layer": prefix}
        wanted = layer_forward(layer, inputs, None, None)
        names = list(arch.linears)
        ways = {"compiled": kernel, "torch": None}
        runs = {way: [] for way in ways}
        for fused in ways.values():  # warm-up
            seconds_per_step(layer, names, inputs, wanted, 2, fused)
        for _ in range(repeats):
            for way, fused in ways.items():
                runs[way].append(seconds_per_step(layer, names, inputs, wanted, steps, fused))
        found.update({way: statistics.median(times) for way, times in runs.items()})
        raise Stop

    with denormals_flushed():
        try:
            walk(model, arch, batches, on_layer, label="bench", micro_batch=batch, forward_dtype=torch.bfloat16,
                 final_outputs=False)
        except Stop:
            pass
    return {"batch": batch, "compiled_s": round(found["compiled"], 4), "torch_s": round(found["torch"], 4),
            "torch_over_compiled": round(found["torch"] / found["compiled"], 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = p.parse_args(argv)
    kernel = cpu_kernels.load()
    if kernel is None:
        print("signround_step: no CPU kernel module here (see the warning above); nothing to compare", file=sys.stderr)
        return 1
    model, tokenizer, _ = load_model("smollm2-135m")
    batches = calibration_batches(CalibrationConfig(dataset="wiki", samples=16, seq_len=512), tokenizer)
    rows = [time_layer(model, batches, args.layer, b, args.steps, args.repeats, kernel) for b in args.batches]
    record = {"model": "smollm2-135m", "layer": args.layer, "grid": "int4 g64 symmetric", "tokens_per_sample": 512,
              "steps": args.steps, "repeats": args.repeats, "cpu": cpu_info().describe(),
              "threads": torch.get_num_threads(), "rows": rows}
    if args.json:
        print(json.dumps(record))
    else:
        for row in rows:
            print(f"batch {row['batch']}: {row['compiled_s'] * 1e3:.1f} ms per step compiled, "
                  f"{row['torch_s'] * 1e3:.1f} ms torch ({row['torch_over_compiled']}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
