"""One offline check of lowbit on a GPU machine, written as one JSON file.

    python bench/gpu_check.py --pack .gpu_carry          # here: corpora + tokenizer to carry (~6 MB)
    python bench/gpu_check.py --carried .gpu_carry --out gpu_check.json   # on the GPU machine
    python bench/gpu_check.py --dry-run --out dry.json   # any CPU: tiny shapes, same code paths
    python bench/gpu_check.py --table gpu_check.json     # the decode table as markdown

Sections, each recorded even when another fails (the exit code is 1 if any did):
  environment   date, commit, CPU; torch / transformers / triton versions, the device
  cuda_tests    pytest of the runtime-kernel test files (every CUDA test; --dry-run only collects)
  kernels       each weight-only kernel against its reference path at Llama-3-8B linear shapes
  decode        one decode step through 32 Llama-3-8B-shaped decoder layers' linears (q/k/v and
                gate/up merged, as vLLM loads them; attention at short context left out) with the
                element-wise work between them fused (bench/decode_glue.py), CUDA-graph captured,
                batch 1 / 8 / 32: bf16, W4A16 (tinygemm; Triton at batch 1), W8A16 (Triton;
                torch's int8pack), FP8 weight-only (Triton) and FP8 W8A8 (torch._scaled_mm);
                medians of interleaved replays, against bf16 and against the read bandwidth
                measured in the same run
  calibration   `lowbit run` of w4a16-gptq and fp8-dynamic on a random 2-layer model of
                Llama-3-8B widths with --device cuda

The GPU machine needs no network: lowbit installs with `pip install --no-deps -e .`, and the
built-in corpora and the smollm2 tokenizer (derived here from gensim and the GGUF) travel in the
--pack folder.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from lowbit.calibrate.provenance import provenance
from lowbit.quantize.grids.fp8 import quantize_weight_fp8
from lowbit.quantize.grids.integer import IntScheme, quantize_rtn
from lowbit.quantize.runtime import backends
from lowbit.quantize.runtime.fp8_linear import FP8Linear
from lowbit.quantize.runtime.qlinear import QuantLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_glue import Glue  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA_8B = dict(hidden=4096, intermediate=14336, kv=1024, layers=32)
TINY = dict(hidden=128, intermediate=256, kv=64, layers=2)
CUDA_TEST_FILES = ["tests/test_triton_kernels.py", "tests/test_quantize_backends.py",
                   "tests/test_quantize_backends_fp8.py", "tests/test_runtime_devices.py"]
# variant -> (how its linears are built, the backend prepare() is asked for)
VARIANTS = {
    "bf16": ("float", None),
    "w4a16": ("int4-g128", "cuda_int4"),
    "w4a16-triton": ("int4-g128", "triton"),
    "w8a16": ("int8-channel", "triton"),
    "w8a16-int8pack": ("int8-channel", "cuda_int8"),
    "fp8-weight-only": ("fp8-none", "triton"),
    "fp8-w8a8": ("fp8-dynamic", "auto"),
}


def linear_shapes(dims: dict) -> list[tuple[str, int, int]]:
    """(name, out, in) of one Llama decoder layer's linears, q/k/v and gate/up each merged into
    one matrix as serving engines (vLLM) load them."""
    h, i, kv = dims["hidden"], dims["intermediate"], dims["kv"]
    return [("qkv", h + 2 * kv, h), ("o", h, h), ("gate_up", 2 * i, h), ("down", h, i)]


def build_linear(kind: str, w: torch.Tensor, backend: str | None):
    """A callable x -> y for one weight, and what it runs ('F.linear', a kernel, or 'reference (why)')."""
    if kind == "float":
        wb = w.to(torch.bfloat16)
        return (lambda x: F.linear(x, wb)), "F.linear"
    if kind.startswith("fp8"):
        module = FP8Linear.from_weight(quantize_weight_fp8(w, "channel", "e4m3"), None, kind.split("-")[1])
    else:
        scheme = IntScheme(4, True, "group", 128) if kind == "int4-g128" else IntScheme(8, True, "channel")
        if scheme.group_size and w.shape[1] % scheme.group_size:
            scheme = IntScheme(4, True, "group", 32)  # --dry-run's tiny widths
        module = QuantLinear.from_quantized(quantize_rtn(w, scheme), None)
    chosen = backends.prepare(module, backend)[""]
    if isinstance(module, FP8Linear) and module.kernel is None and chosen.startswith("reference"):
        probe = torch.zeros(1, module.in_features, dtype=torch.bfloat16, device=w.device)
        chosen = "torch._scaled_mm" if module.can_use_scaled_mm(probe) else chosen
    return module, chosen


def random_weight(out: int, inp: int, device, gen) -> torch.Tensor:
    return torch.randn(out, inp, device=device, generator=gen) * 0.02


# ---------------------------------------------------------------- sections


def environment(args, device) -> dict:
    import transformers

    found = {**provenance(), "python": platform.python_version(), "torch": torch.__version__,
             "transformers": transformers.__version__, "device": str(device), "dry_run": args.dry_run}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        found.update(gpu=p.name, capability=list(torch.cuda.get_device_capability(device)),
                     gpu_memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count)
    return found


def cuda_tests(args, device) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.tests]
    if args.dry_run:
        cmd.append("--collect-only")
    env = {**os.environ, "LOWBIT_CPU_ISA": "none"}  # the CPU kernels are CI's business, not this check's
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.test_timeout)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"command": " ".join(cmd[1:]), "returncode": done.returncode, "summary": lines[-1] if lines else "",
            "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))][:20],
            "passed": done.returncode == 0}


def kernels(args, device) -> dict:
    """Each variant's kernel output against its own reference path (dequantize + F.linear)."""
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = {(o, i) for _, o, i in linear_shapes(args.dims)}
    rows = []
    for out, inp in sorted(shapes):
        w = random_weight(out, inp, device, gen)
        for name, (kind, backend) in VARIANTS.items():
            if kind == "float":
                continue
            module, chosen = build_linear(kind, w, backend)
            for batch in (1, 8):
                x = torch.randn(batch, inp, device=device, generator=gen).to(torch.bfloat16)
                got = module(x).float()
                expected = reference_output(module, x.float())
                err = ((got - expected).abs().max() / expected.abs().max()).item()
                rows.append(dict(variant=name, shape=f"{out}x{inp}", batch=batch, runs=chosen, max_rel_error=err,
                                 passed=err < 2e-2))
    return {"rows": rows, "passed": all(r["passed"] for r in rows)}


def reference_output(module, x: torch.Tensor) -> torch.Tensor:
    """The definition a kernel is checked against: the dequantized weight through F.linear (FP8
    activations fake-quantized as the module's reference path does)."""
    if isinstance(module, FP8Linear):
        return module._forward_reference(x)
    return F.linear(x, module.dequantized_weight(), module.bias)


class DecodeStack:
    """The linears of `layers` decoder layers, each with its own weights, run as a decode step."""

    def __init__(self, kind: str, backend: str | None, dims: dict, device, glue: Glue, seed: int = 0):
        self.glue = glue
        gen = torch.Generator(device=device).manual_seed(seed)
        self.layers, self.runs, self.nbytes = [], set(), 0
        for _ in range(dims["layers"]):
            layer = {}
            for name, out, inp in linear_shapes(dims):
                layer[name], chosen = build_linear(kind, random_weight(out, inp, device, gen), backend)
                self.runs.add(chosen)
                self.nbytes += weight_bytes(layer[name], out, inp)
            self.layers.append(layer)
        self.hidden = dims["hidden"]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.clone()  # the residual stream, updated in place
        a = self.glue.add_norm(h, None)
        for lin in self.layers:
            q = lin["qkv"](a)[:, :self.hidden]  # k and v would go to the KV cache
            a = self.glue.add_norm(h, lin["o"](q))
            a = self.glue.add_norm(h, lin["down"](self.glue.silu_mul(lin["gate_up"](a))))
        return a


def weight_bytes(module, out: int, inp: int) -> int:
    """Bytes one call reads: the kernel's packed weight where one runs, else the stored codes."""
    if callable(module) and not isinstance(module, torch.nn.Module):
        return out * inp * 2  # bf16 F.linear
    if module.kernel is not None:
        return module.kernel.nbytes
    return sum(b.nbytes for b in module.buffers())


class Replay:
    """A decode step for one batch: CUDA-graph captured on a GPU, called eagerly on the CPU."""

    def __init__(self, stack: DecodeStack, batch: int, device):
        self.x = torch.randn(batch, stack.hidden, device=device).to(torch.bfloat16)
        self.stack, self.device, self.graph, self.times, self.capture_error = stack, device, None, [], None
        with torch.inference_mode():
            for _ in range(3 if device.type == "cuda" else 1):  # Triton's autotuning and torch's lazy
                # set-up happen before the capture
                stack(self.x)
            if device.type == "cuda":
                torch.cuda.synchronize()
                try:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        self.out = stack(self.x)
                    self.graph = graph
                except Exception as e:  # timed eagerly instead, and the row says why
                    self.capture_error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"

    def step(self) -> None:
        if self.graph is None:
            start = time.perf_counter()
            with torch.inference_mode():
                self.stack(self.x)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - start)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        end.synchronize()
        self.times.append(start.elapsed_time(end) / 1e3)


def read_bandwidth(device, mib: int, reps: int) -> float:
    """GB/s of a large tensor sum (a read, as decode's weight stream is): the median of reps."""
    big = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device=device)
    times = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        big.sum()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return big.nbytes / statistics.median(times[2:]) / 1e9


def decode(args, device) -> dict:
    rows = []
    for mode in args.glue:
        glue = Glue(fused=mode == "fused" and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))
        rows += decode_rows(args, device, glue)
    return {"dims": args.dims, "rows": rows, "passed": True}


def decode_rows(args, device, glue: Glue) -> list[dict]:
    stacks = {}
    for name, (kind, backend) in VARIANTS.items():
        stacks[name] = DecodeStack(kind, backend, args.dims, device, glue)
        print(f"  built {name}: {stacks[name].nbytes / 1e9:.2f} GB, runs {sorted(stacks[name].runs)}", flush=True)
    rows = []
    for batch in args.batches:
        replays = {name: Replay(stack, batch, device) for name, stack in stacks.items()}
        for _ in range(args.warmup + args.steps):
            for replay in replays.values():  # interleaved: disturbances fall on every variant alike
                replay.step()
        bandwidth = read_bandwidth(device, args.bandwidth_mib, args.steps)
        base = statistics.median(replays["bf16"].times[args.warmup:])
        for name, replay in replays.items():
            seconds = statistics.median(replay.times[args.warmup:])
            nbytes = stacks[name].nbytes
            rows.append(dict(variant=name, batch=batch, glue="fused" if glue.fused else "eager",
                             step_ms=seconds * 1e3, tokens_per_s=batch / seconds,
                             vs_bf16=base / seconds, step_gb=nbytes / 1e9, achieved_gbs=nbytes / seconds / 1e9,
                             read_bandwidth_gbs=bandwidth, of_bandwidth=nbytes / seconds / 1e9 / bandwidth,
                             runs=sorted(stacks[name].runs), accepted=kernel_accepts(stacks[name], replay.x),
                             cuda_graph=replay.graph is not None, capture_error=replay.capture_error))
        del replays
    del stacks
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def kernel_accepts(stack: DecodeStack, x: torch.Tensor) -> bool | None:
    """Whether the attached kernels take this batch (else the reference path ran); None for bf16."""
    module = stack.layers[0]["qkv"]
    if not isinstance(module, torch.nn.Module) or module.kernel is None:
        return None
    return bool(module.kernel.accepts(x))


def calibration(args, device) -> dict:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    work = Path(args.work)
    folder = work / "random-llama"
    tok = AutoTokenizer.from_pretrained(tokenizer_folder(args))
    d = args.dims
    head_dim = 32 if args.dry_run else 128
    cfg = LlamaConfig(hidden_size=d["hidden"], intermediate_size=d["intermediate"], num_hidden_layers=2,
                      num_attention_heads=d["hidden"] // head_dim, num_key_value_heads=d["kv"] // head_dim,
                      head_dim=head_dim, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    small = ["calibration.samples=16", "calibration.seq_len=256", "evaluate.kl.max_tokens=512",
             "evaluate.perplexity.max_tokens=512", "evaluate.perplexity.context_len=256",
             "evaluate.perplexity.stride=256", *evaluation_sets(args)]
    runs = []
    for recipe in ("w4a16-gptq", "fp8-dynamic"):
        out = work / f"run-{recipe}"
        cmd = [sys.executable, "-m", "lowbit.app.cli", "run", recipe, "--model", str(folder), "--output", str(out),
               "--overwrite", "--device", device.type, *[a for s in small for a in ("--set", s)]]
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.test_timeout)
        results = out / "results.json"
        runs.append(dict(recipe=recipe, returncode=done.returncode, seconds=time.perf_counter() - start,
                         tail=(done.stdout + done.stderr)[-1500:],
                         results=json.loads(results.read_text()) if results.exists() else None))
    return {"runs": runs, "evaluated": [evaluation_summary(r["results"]) for r in runs],
            "passed": all(r["returncode"] == 0 for r in runs)}


def evaluation_sets(args) -> list[str]:
    """The evaluation of each calibrated checkpoint, where evaluate.device auto puts it (the GPU, in
    bfloat16): KL against the random model, peak memory by torch's allocator counters, and decode
    speed through a static cache and a compiled step (CUDA graphs) at batch 1, 8 and 32. The dry
    run takes the static cache on the CPU (inductor's compile is tested in the suite)."""
    speed = ["evaluate.speed.enabled=true", "evaluate.speed.repeats=3"]
    if args.dry_run:
        return speed + ["evaluate.memory.measure_peak=false", "evaluate.speed.decode=static",
                        "evaluate.speed.batch_sizes=[1,2]", "evaluate.speed.prompt_len=16",
                        "evaluate.speed.new_tokens=4"]
    return speed + ["evaluate.speed.decode=compiled", "evaluate.speed.batch_sizes=[1,8,32]",
                    "evaluate.speed.prompt_len=128", "evaluate.speed.new_tokens=32"]


def evaluation_summary(results: dict | None) -> dict | None:
    """Where and in which dtype each checkpoint was evaluated, its KL, and per model and batch the
    decode mode that ran with TTFT, TPOT, tokens/s and the roofline's share."""
    if results is None:
        return None
    speed, quality = results.get("speed") or {}, results["quality"]
    rows = [{"model": name, "batch": int(b), **{k: row[k] for k in ("decode", "ttft_s", "tpot_s", "decode_tok_s")},
             "fallback": row.get("decode_fallback"), "of_roofline": row["roofline_tpot_s"] / row["tpot_s"]}
            for name in ("model", "baseline") for b, row in (speed.get(name) or {}).items()]
    return {"device": quality["protocol"].get("device"), "dtype": quality["protocol"].get("dtype"),
            "kl_mean": (quality.get("kl") or {}).get("kl_mean"), "speed_device": speed.get("device"),
            "backends": speed.get("backends"), "speed": rows}


def tokenizer_folder(args) -> str:
    if args.carried:
        return str(Path(args.carried) / "tokenizer")
    from lowbit.calibrate.models import resolve_model_path

    return resolve_model_path("smollm2-135m")


def pack(target: Path) -> None:
    """What the GPU machine cannot derive itself (no gensim, no gguf there): the built-in corpora
    and the smollm2 tokenizer."""
    from transformers import AutoTokenizer

    from lowbit.calibrate.cache import cache_dir
    from lowbit.calibrate.corpora import corpus_text

    corpora = target / "cache" / "corpora"
    corpora.mkdir(parents=True, exist_ok=True)
    for name in ("wiki",):
        for part in ("calib", "eval"):
            corpus_text(name, part)
    for f in cache_dir("corpora").glob("wiki-*.txt"):
        shutil.copy2(f, corpora / f.name)
    AutoTokenizer.from_pretrained(tokenizer_folder(argparse.Namespace(carried=None))).save_pretrained(target / "tokenizer")
    print(f"packed {sum(f.stat().st_size for f in target.rglob('*') if f.is_file()) / 1e6:.1f} MB into {target}")


def decode_table(report: dict) -> str:
    """Markdown: one row per variant, its speed against bf16 and share of the read bandwidth per batch."""
    env, rows = report["environment"], report["decode"]["rows"]
    batches = sorted({r["batch"] for r in rows})
    out = []
    for glue in dict.fromkeys(r.get("glue", "eager") for r in rows):
        picked = [r for r in rows if r.get("glue", "eager") == glue]
        bandwidth = statistics.median(r["read_bandwidth_gbs"] for r in picked)
        out += [f"{env.get('gpu', env['device'])}, torch {env['torch']}, triton {env['triton']}; element-wise work "
                f"{glue}; read bandwidth {bandwidth:.0f} GB/s (median of the batches' probes)", "",
                "| variant | kernel | " + " | ".join(f"batch {b}: ms, × bf16, of bandwidth" for b in batches) + " |",
                "|---|---|" + "---|" * len(batches)]
        for variant in dict.fromkeys(r["variant"] for r in picked):
            cells = []
            for b in batches:
                r = next(r for r in picked if r["variant"] == variant and r["batch"] == b)
                ran = "" if r["accepted"] in (None, True) else " (reference path)"
                cells.append(f"{r['step_ms']:.2f}, {r['vs_bf16']:.2f}×, {r['of_bandwidth']:.0%}{ran}")
            kernel = ", ".join(next(r for r in picked if r["variant"] == variant)["runs"])
            out.append(f"| {variant} | {kernel} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


SECTIONS = {"environment": environment, "kernels": kernels, "decode": decode, "cuda_tests": cuda_tests,
            "calibration": calibration}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="on the CPU with tiny shapes (CI runs this)")
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per variant and batch")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--glue", nargs="+", choices=["fused", "eager"], default=["fused"],
                   help="the element-wise work between linears: fused Triton kernels and/or eager PyTorch")
    p.add_argument("--tests", nargs="+", default=CUDA_TEST_FILES, help="the cuda_tests section's test files")
    p.add_argument("--bandwidth-mib", type=int, default=4096)
    p.add_argument("--carried", help="a --pack folder (corpora and tokenizer) brought to this machine")
    p.add_argument("--pack", help="write the folder to carry and stop")
    p.add_argument("--table", metavar="JSON", help="print a written report's decode rows as a markdown table and stop")
    p.add_argument("--work", default=None, help="scratch folder (default: beside --out)")
    p.add_argument("--test-timeout", type=int, default=300)
    args = p.parse_args(argv)
    args.dims = TINY if args.dry_run else LLAMA_8B
    if args.dry_run:  # batch 1 (the GEMVs) and 32 (the 32-row tl.dot blocks) cover every kernel path
        args.steps, args.warmup, args.bandwidth_mib = 1, 0, 16  # the code paths, not timings
        args.batches = [b for b in args.batches if b in (1, 32)] or args.batches
    args.work = args.work or str(Path(args.out).resolve().parent / "gpu_check_work")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.pack:
        pack(Path(args.pack))
        return 0
    if args.table:
        print(decode_table(json.loads(Path(args.table).read_text())))
        return 0
    if args.carried:
        os.environ["LOWBIT_CACHE"] = str(Path(args.carried).resolve() / "cache")
    if args.dry_run:  # Triton's kernels then run in its interpreter (read when triton is first imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cpu" if args.dry_run else "cuda")
    report, failed = {}, []
    for name in args.sections:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            report[name] = SECTIONS[name](args, device)
        except Exception:
            report[name] = {"passed": False, "error": traceback.format_exc()[-3000:]}
        report[name]["seconds"] = round(time.perf_counter() - start, 1)
        if not report[name].get("passed", True):
            failed.append(name)
        print(json.dumps(report[name], default=str)[:2000], flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))  # partial results survive
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {args.out}; {'failed: ' + ', '.join(failed) if failed else 'every section passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
