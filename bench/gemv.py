"""GEMV microbenchmark: one linear layer at decode batch sizes, float vs the low-bit kernels.

    python bench/gemv.py                 # (out, in) = 4096x4096, 2048x8192, 8192x2048; rows 1 and 8
    python bench/gemv.py --backend cpu_avx512 --json

All variants of a shape run interleaved round-robin (fair under load from other processes);
prints the median and the fastest call, GB/s of the bytes each variant reads, and the speedup
over fp32 F.linear.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from lowbit.quantize.runtime import backends
from lowbit.quantize.grids.integer import IntScheme, quantize_rtn
from lowbit.quantize.runtime.qlinear import QuantLinear

SCHEMES = {"int8-channel": IntScheme(8, True, "channel"), "int4-g128": IntScheme(4, True, "group", 128),
           "int4-g32-asym": IntScheme(4, False, "group", 32)}


class Cycle:
    """Calls fn on copies of a weight in turn, enough copies to outgrow the last-level cache
    (else small low-bit weights would be timed from cache, not memory)."""

    def __init__(self, make_fn, nbytes: int, cache_bytes: int = 96 * 2**20):
        self.fns = [make_fn() for _ in range(-(-cache_bytes // nbytes))]
        self.nbytes, self.i = nbytes, 0

    def __call__(self):
        self.i = (self.i + 1) % len(self.fns)
        return self.fns[self.i]()


def variants(out: int, inp: int, rows: int, backend: str, device) -> dict:
    """name -> Cycle of callables (with the bytes one call reads)."""
    w = torch.randn(out, inp, device=device) * 0.02
    x = torch.randn(rows, inp, device=device)
    xb = x.bfloat16()
    found = {"fp32": Cycle(lambda: (lambda w=w.clone(): F.linear(x, w)), w.nbytes),
             "bf16": Cycle(lambda: (lambda w=w.bfloat16(): F.linear(xb, w)), w.nbytes // 2)}
    for name, scheme in SCHEMES.items():
        layer = QuantLinear.from_quantized(quantize_rtn(w, scheme), None)
        chosen = backends.prepare(layer, backend)[""]
        if layer.kernel is not None:
            def make(layer=layer):
                twin = QuantLinear.from_quantized(layer.quantized_weight(), None)
                backends.prepare(twin, backend)
                return lambda: twin(x)
            found[f"{name} ({chosen})"] = Cycle(make, layer.kernel.nbytes)
    return found


def measure(fns: dict, reps: int, device) -> dict:
    times = {name: [] for name in fns}
    for i in range(reps + 3):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                times[name].append(time.perf_counter() - start)
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["4096x4096", "2048x8192", "8192x2048"], help="OUTxIN")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    p.add_argument("--backend", default="auto", choices=backends.BACKENDS)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for shape in args.shapes:
        out, inp = map(int, shape.split("x"))
        for rows in args.rows:
            fns = variants(out, inp, rows, args.backend, device)
            times = measure(fns, args.reps, device)
            for stat_name, stat in (("median", statistics.median), ("best", min)):
                base = stat(times["fp32"])
                for name, fn in fns.items():
                    t, nbytes = stat(times[name]), fn.nbytes
                    row = dict(shape=shape, rows=rows, stat=stat_name, variant=name, ms=t * 1e3,
                               gbs=nbytes / t / 1e9, vs_fp32=base / t, threads=torch.get_num_threads())
                    if args.json:
                        print(json.dumps(row))
                    else:
                        print(f"{shape:>10} rows={rows} {stat_name:6} {name:32} {t * 1e3:8.3f} ms "
                              f"{row['gbs']:6.1f} GB/s {row['vs_fp32']:6.2f}x fp32")


if __name__ == "__main__":
    main()
