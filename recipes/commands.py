"""The `lowbit eval`, `lowbit report`, `lowbit sweep` and `lowbit audit` commands."""
from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import yaml

from lowbit.evaluate.report import write_report
from lowbit.evaluate.report_data import load_runs
from lowbit.export.manifest import write_text_atomic

from .schema import load_recipe
from .validate import RecipeError, build, to_plain


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
    from lowbit.calibrate.models import DEFAULT_DTYPE, load_model
    from lowbit.evaluate.baseline import cached_baseline
    from lowbit.evaluate.memory import checkpoint_weight_bytes, model_weight_bytes
    from lowbit.evaluate.perplexity import perplexity
    from lowbit.evaluate.suite import LazyModel, evaluate_extras
    from lowbit.export import checkpoint

    cfg = _evaluate_config(args.set)
    target = Path(args.target)
    if checkpoint.is_checkpoint(target):
        model, tokenizer = checkpoint.load(target)
        weight_bytes, reference_name = checkpoint_weight_bytes(target), args.baseline or _recipe_model(target)
    else:
        model, tokenizer, _ = load_model(args.target, allow_pickle=args.allow_pickle)
        weight_bytes, reference_name = model_weight_bytes(model, bytes_per_param=2), args.baseline
    reference = LazyModel(reference_name and (lambda: load_model(reference_name, allow_pickle=args.allow_pickle)[0]))
    quality = perplexity(model, tokenizer, cfg.perplexity)
    base_ppl = cached_baseline(reference_name, cfg.perplexity, lambda: perplexity(
        reference.get(), tokenizer, cfg.perplexity))["perplexity"] if reference.available and cfg.baseline else None
    base_bytes = model_weight_bytes(reference.get(), bytes_per_param=2) if reference.available else None
    extras = evaluate_extras(model, tokenizer, cfg, model_name=reference_name or args.target, weight_bytes=weight_bytes,
                             baseline_weight_bytes=base_bytes, reference=reference, steps=[])
    results = {
        "lowbit_version": version("lowbit"),
        "model": {"id": str(args.target), "model_type": model.config.model_type, "reference": reference_name,
                  "dtype": str(DEFAULT_DTYPE).removeprefix("torch.")},  # the reference's, as load_model loads it
        "recipe": {"name": f"eval {target.name or args.target}", "evaluate": to_plain(cfg)},
        "quality": {"perplexity": quality["perplexity"], "baseline_perplexity": base_ppl,
                    "dataset": cfg.perplexity.dataset, "protocol": {**to_plain(cfg.perplexity), **quality},
                    **extras.pop("quality")},
        "memory": {"weight_bytes": weight_bytes, "baseline_weight_bytes": base_bytes, **extras.pop("memory")},
        "timing": {}, "steps": [], **extras,
    }
    out = Path(args.output or f"runs/eval-{target.name or 'model'}")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(results, indent=2))
    write_report([results], out / "report.html")
    print(f"perplexity  {quality['perplexity']:.3f}" + (f" (baseline {base_ppl:.3f})" if base_ppl else ""))
    print(f"results     {out / 'results.json'}  report {out / 'report.html'}")
    return 0


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
