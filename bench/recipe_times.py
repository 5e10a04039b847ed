"""How long recipes take to quantize, each as a multiple of the first's, on this machine in one run.

    python bench/recipe_times.py w4a16-gptq w4a16-gptq-distill [--model smollm2-135m] [--json]

Each recipe runs once through `lowbit run`, one after another, with the evaluation cut as
bench/streamed_run.py cuts it (no baseline, KL or memory measurement): what is timed is the run's
own `timing.quantize_s` (calibration walks and learning, not loading, export or evaluation). A
recipe of minutes is not repeated: run the bench on an otherwise idle machine, as the ratios compare
runs made back to back.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from lowbit.app.cli import main as lowbit
from lowbit.calibrate.hardware import cpu_info
from lowbit.calibrate.provenance import provenance
from streamed_run import QUICK


def quantize_seconds(recipe: str, model: str, folder: Path, extra: list[str]) -> float:
    sets = [f"--set={s}" for s in (*QUICK, *extra)]
    with contextlib.redirect_stdout(sys.stderr):  # the run's summary: stdout is this bench's JSON
        code = lowbit(["run", recipe, "--model", model, "--output", str(folder), *sets])
    if code != 0:
        raise SystemExit(f"recipe_times: `lowbit run {recipe}` failed (its message is above)")
    return json.loads((folder / "results.json").read_text())["timing"]["quantize_s"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipes", nargs="+", help="shipped recipe names or YAML paths; the first is the unit")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--set", dest="extra", action="append", default=[], help="passed to every run, as `lowbit run`'s")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    seconds = {}
    with tempfile.TemporaryDirectory(prefix="recipe_times-") as tmp:
        for i, recipe in enumerate(args.recipes):
            seconds[recipe] = quantize_seconds(recipe, args.model, Path(tmp) / f"run{i}", args.extra)
    unit = seconds[args.recipes[0]]
    command = " ".join(["python bench/recipe_times.py", *(sys.argv[1:] if argv is None else argv)])
    out = {"command": command, **provenance(), "kernels": cpu_info().describe(), "model": args.model,
           "unit": args.recipes[0],
           "recipes": [{"recipe": r, "quantize_s": s, "times_unit": round(s / unit, 2)} for r, s in seconds.items()]}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for row in out["recipes"]:
            print(f"{row['recipe']:<32} {row['quantize_s']:>9.1f} s  {row['times_unit']:.2f}x {out['unit']}")
    return out


if __name__ == "__main__":
    main()
