"""Decode speed: tokens/s and achieved GB/s per scheme, against the unquantized baselines and
the memory roofline, all measured in one process on the current device.

    python bench/decode.py                       # smollm2-135m and a ~1B random Llama, batch 1 and 8
    python bench/decode.py --models llama-1b --batches 1 --json
    python bench/decode.py --layers 16 --threads 1   # a shared CPU: no stalls at thread barriers
    python bench/decode.py --models llama-8b --schemes bf16 w8a16 w4a16 fp8   # a GPU, Llama-3-8B's shape

Only the decode steps are timed (prefill runs first, untimed); each figure is the median over
--steps steps after --warmup (the fastest step is reported too: on a shared machine it is the
least disturbed one). The variants' steps run interleaved round-robin, so that load from other
processes falls on all of them alike. The roofline is bytes one decode step must read (weights, with
quantized codes at their bit width whichever kernel runs, and the KV cache:
lowbit.evaluate.speed.decode_step_bytes) over the read bandwidth measured in the same run (the
better of a large tensor sum and a large fp32 GEMV).

The CPU kernel variant is cpu_info()'s (LOWBIT_CPU_ISA=avx512|avx2|none forces one); each row
names the kernels its quantized linears ran ("reference (...)" says why where none did).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.cached_forward import cached_forward
from lowbit.calibrate.hardware import cpu_info
from lowbit.calibrate.provenance import provenance
from lowbit.evaluate.speed import decode_step_bytes
from lowbit.quantize.runtime import backends
from lowbit.quantize.steps import fp8 as fp8_step
from lowbit.quantize.steps import int8_inputs as input_quant
from lowbit.quantize.steps import rtn
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.steps.context import StepContext

SCHEMES = {  # weights by RTN; w8a8 adds per-token INT8 inputs (torch._int_mm), fp8 is E4M3 W8A8
    "w8a16": IntScheme(8, True, "channel"),
    "w4a16": IntScheme(4, True, "group", 128),  # group 64 where 128 does not divide a layer
    "w8a8": IntScheme(8, True, "channel"),
    "fp8": None,
}
BASELINES = ("fp32", "bf16")
# variables that force a kernel variant or torch's own paths: a record's command names those set
FORCING = ("LOWBIT_CPU_ISA", "LOWBIT_CPU_BF16", "LOWBIT_CPU_INT8", "LOWBIT_CPU_BF16_DOT", "ATEN_CPU_CAPABILITY",
           "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")
RANDOM_LLAMAS = {  # configs where weights dominate decode, with N(0, 0.02) random weights
    # TinyLlama's shape: 1.1B parameters at 22 layers, 0.83B at 16
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    # Llama-3-8B's shape (8.0B parameters): for GPUs; float32 weights take 32 GB
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Timings:
    """Wall-clock and process CPU seconds of each timed block. CPU time leaves out the time the
    process waits for a core, so on a shared machine it is the fairer figure (exact with 1 thread;
    with more it also counts threads that spin while waiting)."""

    def __init__(self):
        self.wall, self.cpu = [], []

    def __enter__(self):
        self._start = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        self.wall.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.process_time() - self._start[1])


STATS = {  # name -> seconds from a Timings (after dropping warm-up)
    "median": lambda t, skip=0: statistics.median(t.wall[skip:]),
    "best": lambda t, skip=0: min(t.wall[skip:]),
    "cpu-median": lambda t, skip=0: statistics.median(t.cpu[skip:]),
}


class BandwidthProbe:
    """Times a large read two ways (tensor sum, fp32 GEMV); the faster is the roofline's bandwidth."""

    def __init__(self, device: torch.device, mib: int = 512):
        self.big = torch.ones(mib * 2**20 // 4, device=device)
        self.x = torch.ones(1, 4096, device=device)
        self.device, self.times = device, {"sum": Timings(), "gemv": Timings()}

    @torch.inference_mode()
    def step(self) -> None:
        for fn, name in ((self.big.sum, "sum"), (lambda: F.linear(self.x, self.big.view(-1, 4096)), "gemv")):
            with self.times[name]:
                fn()
                sync(self.device)

    def result(self, stat) -> dict:
        n = self.big.numel() * 4 / 1e9
        sum_gbs, gemv_gbs = n / stat(self.times["sum"]), n / stat(self.times["gemv"])
        return {"sum_gbs": sum_gbs, "fp32_gemv_gbs": gemv_gbs, "gbs": max(sum_gbs, gemv_gbs)}


def random_llama(name: str, layers: int | None, device: torch.device, dtype=torch.float32):
    """A float32 Llama of RANDOM_LLAMAS[name]'s shape (`layers` decoder layers, or the config's)
    with N(0, 0.02) weights, built uninitialised on `device` (an 8B model is filled there in
    seconds; on the CPU it would take minutes)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    shape = {**RANDOM_LLAMAS[name], **({"num_hidden_layers": layers} if layers else {})}
    config = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    with no_init_weights(), device:
        model = LlamaForCausalLM(config).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02, generator=gen)
            else:
                p.fill_(1.0)  # RMSNorm gains
    return model.eval()


def load(name: str, layers: int | None, device: torch.device):
    if name in RANDOM_LLAMAS:
        return random_llama(name, layers, device)
    from lowbit.calibrate.models import load_model

    return load_model(name)[0].to(device)


def quantized_copy(model: nn.Module, name: str, ignore: tuple[str, ...], share: bool) -> nn.Module:
    """Quantized copy (scheme `name` of SCHEMES); with share, it reuses the float model's
    unquantized parameters (no second copy in RAM), so it must not change their dtype or device."""
    twin = copy.deepcopy(model, memo={id(p): p for p in model.parameters()} if share else None)
    ctx = StepContext(twin, arch_for(twin), ignore, lambda: None)
    if name == "fp8":
        fp8_step.apply(ctx, fp8_step.FP8Config())  # per-channel weights, dynamic per-token inputs
        return twin
    scheme = SCHEMES[name]
    widths = [m.in_features for m in twin.modules() if isinstance(m, nn.Linear)]
    if scheme.group_size and any(w % scheme.group_size for w in widths):
        scheme = IntScheme(scheme.bits, scheme.symmetric, "group", 64)  # smollm2: hidden 576
    rtn.apply(ctx, rtn.RTNConfig(scheme))
    if name == "w8a8":
        input_quant.apply(ctx, input_quant.InputQuantConfig())
    return twin


class DecodeSession:
    """One model's greedy decode: an untimed prefill of `prompt` tokens, then single steps."""

    @torch.inference_mode()
    def __init__(self, model: nn.Module, batch: int, prompt: int, device: torch.device):
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=gen).to(device)
        self.model, self.device, self.cache = model, device, None  # the prefill makes the model's own
        self.token = self._forward(ids)
        self.times = Timings()

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, self.cache = cached_forward(self.model, ids, self.cache)
        return out.logits[:, -1:].argmax(-1)

    @torch.inference_mode()
    def step(self) -> None:
        with self.times:
            self.token = self._forward(self.token)
            sync(self.device)


def build_variants(model: nn.Module, names: list[str], args, device) -> dict:
    """name -> (model ready to run, what its linears run). Quantized copies share the float
    model's other parameters; bf16 is a converted copy."""
    out = {}
    for name in names:
        if name == "fp32":
            out[name] = model, "torch F.linear"
        elif name == "bf16":
            memo = {id(p): nn.Parameter(p.detach().bfloat16(), requires_grad=False) for p in model.parameters()}
            out[name] = copy.deepcopy(model, memo).to(torch.bfloat16), "torch F.linear"
        else:
            # CPU kernels take fp32 activations; on CUDA the quantized model runs in bf16
            share = device.type == "cpu"
            twin = quantized_copy(model, name, tuple(args.ignore), share)
            twin = twin if share else twin.to(torch.bfloat16)
            chosen = backends.prepare(twin, args.backend)
            out[name] = twin, ", ".join(sorted(set(chosen.values()))) or "FP8Linear (reference)"
    return out


def bench_model(model_name: str, args, device) -> list[dict]:
    """Decode steps of all variants interleaved round-robin, so that load from other processes
    falls on all of them alike; medians per variant."""
    model = load(model_name, args.layers, device)
    variants = build_variants(model, args.schemes, args, device)
    rows = []
    for batch in args.batches:
        probe = BandwidthProbe(device)
        sessions = {name: DecodeSession(m, batch, args.prompt, device) for name, (m, _) in variants.items()}
        order = list(sessions.values()) + [probe]
        for i in range(args.warmup + args.steps):
            for runner in order[i % len(order):] + order[: i % len(order)]:
                runner.step()
        for stat_name, stat in STATS.items():
            bandwidth = probe.result(stat)
            for name, session in sessions.items():
                seconds = stat(session.times, args.warmup)
                nbytes = decode_step_bytes(session.model, batch, args.prompt + (args.warmup + args.steps) // 2)
                rows.append(dict(model=model_name, device=str(device), stat=stat_name, scheme=name, batch=batch,
                                 tokens_per_s=batch / seconds, step_ms=seconds * 1e3, step_mb=nbytes / 1e6,
                                 achieved_gbs=nbytes / seconds / 1e9, bandwidth_gbs=bandwidth["gbs"],
                                 sum_gbs=bandwidth["sum_gbs"], fp32_gemv_gbs=bandwidth["fp32_gemv_gbs"],
                                 kernels=variants[name][1], threads=torch.get_num_threads(),
                                 cpu=cpu_info().describe()))
    return add_ratios(rows)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row against the fastest unquantized baseline at its batch, and against its roofline."""
    for row in rows:
        base = [r["tokens_per_s"] for r in rows if r["batch"] == row["batch"] and r["stat"] == row["stat"]
                and r["scheme"] in BASELINES]
        row["vs_best_baseline"] = row["tokens_per_s"] / max(base) if base else None
        row["vs_roofline"] = row["achieved_gbs"] / row["bandwidth_gbs"]
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{rows[0]['model']} on {rows[0]['device']} ({rows[0]['threads']} threads; CPU: {rows[0]['cpu']})")
    for r in rows:
        if r["scheme"] == rows[0]["scheme"]:
            print(f"  {r['stat']:6} step, batch {r['batch']}: read bandwidth {r['bandwidth_gbs']:.1f} GB/s "
                  f"(sum {r['sum_gbs']:.1f}, fp32 GEMV {r['fp32_gemv_gbs']:.1f})")
    print(f"{'stat':6} {'scheme':8} {'batch':>5} {'tok/s':>8} {'step ms':>8} {'MB/step':>8} {'GB/s':>6} "
          f"{'x best base':>11} {'of roofline':>11}  kernels")
    for r in rows:
        vs = "-" if r["vs_best_baseline"] is None else f"{r['vs_best_baseline']:.2f}x"
        print(f"{r['stat']:6} {r['scheme']:8} {r['batch']:>5} {r['tokens_per_s']:>8.2f} {r['step_ms']:>8.1f} {r['step_mb']:>8.1f} "
              f"{r['achieved_gbs']:>6.1f} {vs:>11} {r['vs_roofline']:>10.0%}  {r['kernels']}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-1b"])
    p.add_argument("--schemes", nargs="+", default=["fp32", "bf16", "w8a16", "w4a16"],
                   choices=list(BASELINES) + list(SCHEMES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--backend", default="auto", choices=backends.BACKENDS)
    p.add_argument("--ignore", nargs="*", default=[], help="linears kept in float, e.g. lm_head")
    p.add_argument("--prompt", type=int, default=16, help="prefill tokens (untimed)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the random llama-* "
                   "models (default: the config's; all variants live at once: llama-1b takes about "
                   "9.4 GB at 22 layers, 7 GB at 16)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of tables")
    p.add_argument("--record", type=Path, help="also write the rows, with the command, date, commit and CPU, "
                   "as one JSON file (a docs/results file: bench/results_tables.py renders it)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    recorded = []
    for model_name in args.models:
        rows = bench_model(model_name, args, device)
        recorded += rows
        gc.collect()
        if args.json:
            for r in rows:
                print(json.dumps(r), flush=True)
        else:
            print_table(rows)
    if args.record:
        forced = [f"{name}={os.environ[name]}" for name in FORCING if name in os.environ]
        command = " ".join([*forced, "python bench/decode.py", *(sys.argv[1:] if argv is None else argv)])
        record = {"command": command, **provenance(), "rows": recorded}
        args.record.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
