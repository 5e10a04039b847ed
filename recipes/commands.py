"""The `lowbit eval`, `lowbit report`, `lowbit sweep` and `lowbit audit` commands."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from lowbit.evaluate.report import write_report
from lowbit.evaluate.report_data import load_runs
from lowbit.export.manifest import write_text_atomic

from .schema import load_recipe
from .validate import RecipeError, build


def cmd_report(args) -> int:
    out = write_report(load_runs(args.runs), args.output, labels=_labels(args.runs))
    print(f"report      {out} and {out.with_suffix('.md')}")
    return 0


def _labels(run_dirs) -> list[str]:
    """Recipe names, with the folder name added where two runs share one."""
    runs = load_runs(run_dirs)
    names = [r.get("recipe", {}).get("name", Path(d).name) for r, d in zip(runs, run_dirs)]
    return [n if names.count(n) == 1 else f"{n} ({Path(d).name})" for n, d in zip(names, run_dirs)]


def cmd_sweep(args) -> int:
    from .run import run

    root = Path(args.output or f"runs/sweep-{Path(args.model).name}")
    overrides = list(args.set) + [f"model={args.model}"] + (["export.overwrite=true"] if args.overwrite else [])
    recipes = [load_recipe(name, tuple(overrides)) for name in args.recipes]  # validate all before running
    dirs = []
    for recipe in recipes:
        out = root / recipe.name
        dirs.append(out)
        if args.resume and (out / "results.json").is_file():
            print(f"[lowbit] sweep: {recipe.name} already done in {out}", file=sys.stderr)
            continue
        print(f"[lowbit] sweep: {recipe.name} -> {out}", file=sys.stderr)
        args.run_output = out  # what a Ctrl-C reports as kept
        run(recipe, out, resume=args.resume)
    report = write_report(load_runs(dirs), root / "report.html", labels=[r.name for r in recipes])
    print(f"report      {report} and {report.with_suffix('.md')} ({len(dirs)} runs)")
    return 0


def cmd_audit(args) -> int:
    """Exit 0 when the checkpoint passes the coverage audit, 1 when it fails (bad input: 2, from main)."""
    from .audit import audit_checkpoint

    report = audit_checkpoint(args.checkpoint)
    print(f"audit       {args.checkpoint}: {report.headline()}")
    for line in report.lines():
        print(f"  {line}")
    return 0 if report.passed else 1


def cmd_eval(args) -> int:
    """Evaluate whatever MODEL_OR_CHECKPOINT is: a lowbit checkpoint (vs its recipe's model) or a
    plain model; writes results.json and a report."""
    from lowbit.calibrate.models import load_model
    from lowbit.evaluate.evaluation import evaluate
    from lowbit.evaluate.suite import Reference
    from lowbit.export import checkpoint

    cfg = _evaluate_config(args.set)
    target = Path(args.target)
    name = args.baseline or (_recipe_model(target) if checkpoint.is_checkpoint(target) else None)
    if args.stream_baseline:
        reference = Reference(name, None, stream_from=_stream_folder(name))
    else:
        reference = Reference(name, name and (lambda: load_model(name, allow_pickle=args.allow_pickle)[0]))
    results = evaluate(args.target, cfg, reference, allow_pickle=args.allow_pickle).to_dict()
    out = Path(args.output or f"runs/eval-{target.name or 'model'}")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(results, indent=2))
    write_report([results], out / "report.html")
    ppl, base_ppl = results["quality"]["perplexity"], results["quality"]["baseline_perplexity"]
    print(f"perplexity  {ppl:.3f}" + (f" (baseline {base_ppl:.3f})" if base_ppl else ""))
    kl = results["quality"].get("kl")
    if kl:
        print(f"KL          mean {kl['kl_mean']:.5f}  p99 {kl['kl_p99']:.5f}  top-1 {kl['top1_agreement']:.4f}")
    print(f"results     {out / 'results.json'}  report {out / 'report.html'}")
    return 0


def _stream_folder(name) -> str:
    """The local folder a streamed baseline is read from (a built-in model's cache folder)."""
    from lowbit.calibrate.models import resolve_model_path

    if not name:
        raise RecipeError("--stream-baseline", "", "names no baseline: give --baseline MODEL_FOLDER "
                          "(or evaluate a checkpoint whose recipe names its model)")
    folder = Path(resolve_model_path(name))
    if not folder.is_dir():
        raise RecipeError("--stream-baseline", name, "streaming reads safetensors shards from a local "
                          "folder; download the model first (e.g. `hf download "
                          f"{name} --local-dir DIR`) and pass --baseline DIR")
    return str(folder)


def _recipe_model(folder: Path):
    recipe = folder / "recipe.yaml"
    return (yaml.safe_load(recipe.read_text()) or {}).get("model") if recipe.is_file() else None


def _evaluate_config(items: list[str]):
    """EvaluateConfig from --set evaluate.KEY=VALUE items, validated like a recipe's."""
    from lowbit.evaluate.config import EvaluateConfig

    from .schema import apply_override

    data: dict = {}
    for item in items:
        if not item.startswith("evaluate."):
            raise RecipeError("--set", item, "lowbit eval takes evaluate.* options only")
        apply_override(data, item, "--set")
    return build(EvaluateConfig, data.get("evaluate"), "--set", "evaluate")
