"""Peak CPU memory of one prefill (+ a few decoded tokens), measured in a fresh process.

In a long-lived process the resident-set high-water mark says little: pages freed by earlier
work stay resident in the allocator and are reused, so a prefill can read as a 0-byte increase
beside a high-water mark left from quantizing. A fresh interpreter that loads the checkpoint
once, weighs what the loaded model took, then runs the prefill, sees only the prefill's own
memory. Run as `python -m lowbit.evaluate.peak_probe TARGET --out FILE ...`; the parent calls
measure_in_subprocess().
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .loading import load_target
from .memory import measure_peak, proc_status_bytes
from .placement import DTYPES


@dataclass(frozen=True)
class Loadable:
    """What evaluation loaded, so that a fresh process loads the same: a checkpoint folder or
    a model name/folder, with the same trust options."""

    target: str
    trust_remote_code: bool = False
    allow_pickle: bool = False
    dtype: str = "float32"  # evaluate.dtype, resolved: the loaded model is cast to it


@torch.inference_mode()
def prefill_and_decode(model, ids: torch.Tensor, decode_tokens: int, chunk: int | None = None) -> int:
    """Prefill `ids` (batch, tokens) with the model's own cache (a quantized one where attached),
    `chunk` tokens per forward (all at once without), decode a few greedy tokens; return the bytes
    the cache holds at the end."""
    from lowbit.calibrate.cached_forward import cached_forward

    from .kv_cache import cache_nbytes
    from .logits import logits_to_keep

    extra, cache = logits_to_keep(model, 1), None  # the first forward makes the cache
    device = next(model.parameters()).device
    for start in range(0, ids.shape[1], chunk or ids.shape[1]):
        part = ids[:, start : start + (chunk or ids.shape[1])]
        out, cache = cached_forward(model, part.to(device), cache, **extra)
    for _ in range(decode_tokens):
        out, cache = cached_forward(model, out.logits[:, -1:].argmax(-1), cache, **extra)
    return cache_nbytes(cache)


_HAS_PROC = Path("/proc/self/status").exists()


def _rss() -> int:
    if _HAS_PROC:
        return proc_status_bytes("VmRSS")
    import psutil  # macOS, Windows: no /proc

    return psutil.Process().memory_info().rss


def random_prompt(vocab: int, batch: int, context: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(0))


def probe(source: Loadable, batch: int, context: int, decode_tokens: int, repeats: int = 3,
          chunk: int | None = None, lean: bool = False) -> dict:
    """In this (fresh) process: load, weigh the loaded model, then measure the prefill's peak
    (`chunk` tokens per forward; `lean`: the memory-lean runtime, quantize/runtime/compact.py)."""
    # libraries imported before the baseline, so that the load's increase is the model's
    # (weights, tokenizer, its class's module), not transformers' ~150 MB of modules
    import transformers.modeling_utils  # noqa: F401
    import transformers.models.auto.modeling_auto  # noqa: F401
    import transformers.tokenization_utils_tokenizers  # noqa: F401

    from .memory import ModelShape, resident_tensor_bytes

    gc.collect()
    start = _rss()
    model, _, _ = load_target(source.target, source.trust_remote_code, source.allow_pickle)
    if source.dtype != "float32":
        model.to(DTYPES[source.dtype])
    load_peak = proc_status_bytes("VmHWM") if _HAS_PROC else None
    compacted = None
    if lean:
        from lowbit.quantize.runtime.compact import compact

        compacted = compact(model)
    ids = random_prompt(ModelShape.from_config(model.config).vocab, batch, context)
    # a short first call touches every weight (safetensors are mmapped: pages come in on first
    # read) and sets up thread pools and kernels; none of it is the prefill's
    prefill_and_decode(model, ids[:, :8], 1)
    gc.collect()
    loaded = _rss()
    # the median of a few prefills (one load): threads' allocations still move a run's peak a little
    runs = [measure_peak(lambda: prefill_and_decode(model, ids, decode_tokens, chunk), torch.device("cpu"))
            for _ in range(repeats)]
    cache_bytes, peak = sorted(runs, key=lambda run: run[1]["increase_bytes"])[len(runs) // 2]
    return {**peak, "increase_each_bytes": [run[1]["increase_bytes"] for run in runs], "process": "fresh subprocess", "rss_before_load_bytes": start, "model_resident_bytes": loaded - start,
            "model_tensor_bytes": resident_tensor_bytes(model), "load_peak_bytes": load_peak, "cache_bytes": cache_bytes,
            "prefill_chunk": chunk, "lean_runtime": compacted}


def measure_in_subprocess(source: Loadable, batch: int, context: int, decode_tokens: int,
                          chunk: int | None = None, lean: bool = False, repeats: int = 3) -> dict:
    """Run probe() in a fresh interpreter (the same Python, the same environment) and return its
    figures; a failed child is an error naming its exit status and last stderr lines."""
    target = str(Path(source.target).resolve()) if Path(source.target).exists() else source.target
    with tempfile.TemporaryDirectory(prefix="lowbit-peak-") as tmp:
        out = Path(tmp) / "peak.json"
        cmd = [sys.executable, "-m", "lowbit.evaluate.peak_probe", target, "--out", str(out), "--batch", str(batch),
               "--context", str(context), "--decode-tokens", str(decode_tokens), "--repeats", str(repeats)]
        cmd += ["--prefill-chunk", str(chunk)] * (chunk is not None) + ["--lean"] * lean
        cmd += ["--trust-remote-code"] * source.trust_remote_code + ["--allow-pickle"] * source.allow_pickle
        cmd += ["--dtype", source.dtype]
        # cwd: a folder where no source tree can shadow installed packages
        # a fixed mmap threshold: glibc otherwise raises it after each large free, so later tensors
        # land on a heap that keeps freed pages, and the peak varied run to run by a third
        env = {"MALLOC_MMAP_THRESHOLD_": "65536", **os.environ}
        done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env=env)
        if done.returncode != 0 or not out.exists():
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"the peak-memory subprocess for {target} exited with status {done.returncode}"
                               f"{' (killed by a signal: out of memory?)' if done.returncode < 0 else ''}; "
                               f"set evaluate.memory.measure_peak=false to skip it. Its stderr ended:\n{tail}")
        return json.loads(out.read_text())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lowbit.evaluate.peak_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=4)
    parser.add_argument("--prefill-chunk", type=int, help="prompt tokens per forward (all at once without)")
    parser.add_argument("--lean", action="store_true", help="the memory-lean runtime (packed codes, 16-bit embedding)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--allow-pickle", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    a = parser.parse_args(argv)
    figures = probe(Loadable(a.target, a.trust_remote_code, a.allow_pickle, a.dtype), a.batch, a.context, a.decode_tokens,
                    a.repeats, a.prefill_chunk, a.lean)
    a.out.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
