"""Ranks against threads: the same GPTQ run as one process with one thread, as `--nproc 2` ranks of one
thread each, and as one process with all cores; each checkpoint's integer codes compared with the first's.

    python bench/ranks_threads.py --record docs/results/ranks_threads-smollm2-DATE.json

Splitting the samples across ranks should change no byte (the sums are float64); the thread count of
one process may (float32 GEMMs sum in a thread-dependent order, and GPTQ carries every last bit on).
Each run is `lowbit run RECIPE` with a small calibration and no baseline or KL, so that only the
checkpoint and its perplexity are made.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from lowbit.calibrate.provenance import provenance

SETTINGS = ("calibration.samples={samples}", "evaluate.baseline=false", "evaluate.kl.enabled=false")


def ways(cores: int) -> list[dict]:
    """(label, extra CLI arguments, OMP_NUM_THREADS or None for torch's default)."""
    return [dict(way="1 process, 1 thread", args=[], threads="1"),
            dict(way="2 ranks (--nproc 2), 1 thread each", args=["--nproc", "2"], threads=None),
            dict(way=f"1 process, {cores} threads (the default)", args=[], threads=None)]


def run_once(way: dict, args, folder: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if way["threads"]:
        env["OMP_NUM_THREADS"] = way["threads"]
    command = [sys.executable, "-m", "lowbit.app.cli", "run", args.recipe, "--model", args.model,
               "--output", str(folder), *way["args"]]
    for setting in SETTINGS:
        command += ["--set", setting.format(samples=args.samples)]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{way['way']}: lowbit run failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    results = json.loads((folder / "results.json").read_text())
    checkpoint = folder / "model.safetensors"
    return dict(way=way["way"], seconds=time.perf_counter() - start,
                model_safetensors_sha256=hashlib.sha256(checkpoint.read_bytes()).hexdigest()[:16],
                perplexity=results["quality"]["perplexity"])


def codes(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every integer tensor of the checkpoint, packed nibbles unpacked (compressed-tensors packs 8 in an int32)."""
    out = {}
    for name, tensor in load_file(checkpoint).items():
        if tensor.dtype == torch.int32 and name.endswith("weight_packed"):
            shifts = torch.arange(0, 32, 4, dtype=torch.int32)
            out[name] = ((tensor.unsqueeze(-1) >> shifts) & 0xF).flatten()
        elif not tensor.is_floating_point():
            out[name] = tensor.flatten()
    return out


def identical_share(first: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    if first.keys() != other.keys():
        raise SystemExit("the checkpoints hold different tensors: " + ", ".join(sorted(first.keys() ^ other.keys())))
    same = sum(int((first[k] == other[k]).sum()) for k in first)
    return same / sum(t.numel() for t in first.values())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="w4a16-gptq")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--record", type=Path, help="write the rows with command, date, commit and CPU as JSON")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lowbit-ranks-") as scratch:
        folders = []
        for i, way in enumerate(ways(os.cpu_count() or 1)):
            folders.append(Path(scratch) / f"run-{i}")
            rows.append(run_once(way, args, folders[-1]))
            print(json.dumps(rows[-1]), flush=True)
        first = codes(folders[0] / "model.safetensors")
        for row, folder in zip(rows, folders):
            row["codes_identical_to_first"] = identical_share(first, codes(folder / "model.safetensors"))
    record = {"command": " ".join(["python bench/ranks_threads.py", *(sys.argv[1:] if argv is None else argv)]),
              **provenance(), "recipe": args.recipe, "model": args.model, "samples": args.samples, "rows": rows}
    print(json.dumps(record))
    if args.record:
        args.record.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
