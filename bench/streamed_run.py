"""A recipe resident against streamed on one model: the same checkpoint, and what streaming costs.

    python bench/streamed_run.py                                   # w4a16-gptq on smollm2-135m
    python bench/streamed_run.py --recipe w4a16-awq-gptq --repeats 2 --json

Each run is a fresh `lowbit run` process (resident: calibration.streaming=false; streamed: true),
alternating so that a noisy machine slows both alike; its load, calibrate, quantize and export
seconds come from its results.json (the evaluation, the same for both, is cut to 256 tokens and not
counted). Prints those seconds per mode (median over repeats), the streamed/resident ratio, and
whether every run's model.safetensors and config.json are byte-identical to the first resident run's.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

QUICK = ["evaluate.baseline=false", "evaluate.kl.enabled=false", "evaluate.memory.measure_peak=false",
         "evaluate.perplexity.max_tokens=256", "evaluate.perplexity.context_len=128", "evaluate.perplexity.stride=128"]
STAGES = ("load_s", "calibrate_s", "quantize_s", "export_s")


def one_run(recipe: str, model: str, streamed: bool, out: Path) -> dict:
    settings = [*QUICK, f"calibration.streaming={str(streamed).lower()}"]
    cmd = [sys.executable, "-m", "lowbit.app.cli", "run", recipe, "--model", model, "--output", str(out),
           *[x for s in settings for x in ("--set", s)]]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    timing = json.loads((out / "results.json").read_text())["timing"]
    return {"mode": "streamed" if streamed else "resident", "seconds": sum(timing[k] for k in STAGES),
            **{k: timing[k] for k in STAGES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="w4a16-gptq")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows, identical = [], True
    with tempfile.TemporaryDirectory(prefix="streamed-run-") as tmp:
        first = None
        for k in range(args.repeats):
            for streamed in (False, True):
                out = Path(tmp) / f"{'streamed' if streamed else 'resident'}{k}"
                row = one_run(args.recipe, args.model, streamed, out)
                if first is None:
                    first = out
                else:
                    row["identical"] = all((out / f).read_bytes() == (first / f).read_bytes()
                                           for f in ("model.safetensors", "config.json"))
                    identical &= row["identical"]
                    shutil.rmtree(out)
                rows.append(row)
                print(f"{row['mode']:<9} {row['seconds']:7.1f} s  " + "  ".join(f"{k[:-2]} {row[k]:.1f}" for k in STAGES),
                      flush=True)
    median = {m: statistics.median(r["seconds"] for r in rows if r["mode"] == m) for m in ("resident", "streamed")}
    summary = {"recipe": args.recipe, "model": args.model, "repeats": args.repeats, **{f"{m}_s": v for m, v in median.items()},
               "ratio": median["streamed"] / median["resident"], "identical": identical}
    print(f"{args.recipe} on {args.model}: resident {median['resident']:.1f} s, streamed {median['streamed']:.1f} s "
          f"({summary['ratio']:.3f}x); checkpoints {'byte-identical' if identical else 'DIFFER'}")
    if args.json:
        for row in rows:
            print(json.dumps(row))
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
