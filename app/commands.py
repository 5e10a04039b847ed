"""The `lowbit eval`, `lowbit report`, `lowbit sweep` and `lowbit audit` commands."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from lowbit.evaluate.report import write_report
from lowbit.evaluate.report_data import load_runs
from lowbit.export.manifest import MANIFEST, write_text_atomic
from lowbit.export.output_folder import check_apart, check_output_name
from lowbit.recipes.schema import load_recipe, parse_yaml
from lowbit.recipes.validate import RecipeError, build


def cmd_report(args) -> int:
    out = write_report(load_runs(args.runs), report_path(args.output), labels=_labels(args.runs))
    print(f"report      {out} and {out.with_suffix('.md')}")
    return 0


def report_path(text: str) -> Path:
    """`-o`: an .html file, or a folder to hold report.html; never inside a checkpoint, whose
    report is its own (listed in its manifest.json)."""
    path = Path(text)
    if path.is_dir() or text.endswith("/"):
        path = path / "report.html"
    if path.suffix != ".html":
        raise ValueError(f"-o {text}: the report is HTML; give a file name ending in .html (report.md is "
                         "written beside it) or a folder")
    if (path.parent / MANIFEST).is_file():
        raise ValueError(f"-o {text}: {path.parent} is a lowbit checkpoint, whose report.html is its own "
                         f"(listed in its {MANIFEST}); write the comparison elsewhere")
    return path


def _labels(run_dirs) -> list[str]:
    """Recipe names, with the folder name added where two runs share one."""
    runs = load_runs(run_dirs)
    names = [r.get("recipe", {}).get("name", Path(d).name) for r, d in zip(runs, run_dirs)]
    return [n if names.count(n) == 1 else f"{n} ({Path(d).name})" for n, d in zip(names, run_dirs)]


def cmd_sweep(args) -> int:
    from .run import check_run_output, run

    root = Path(args.output or f"runs/sweep-{Path(args.model).name}")
    overrides = list(args.set) + [f"model={args.model}"]
    recipes = [load_recipe(name, tuple(overrides)) for name in args.recipes]  # validate all before running
    for recipe in recipes:  # and every output: none is refused after another run's hours of work
        if not (args.resume and (root / recipe.name / "results.json").is_file()):
            check_run_output(recipe, root / recipe.name, args.overwrite)
    dirs = []
    for recipe in recipes:
        out = root / recipe.name
        dirs.append(out)
        if args.resume and (out / "results.json").is_file():
            print(f"[lowbit] sweep: {recipe.name} already done in {out}", file=sys.stderr)
            continue
        print(f"[lowbit] sweep: {recipe.name} -> {out}", file=sys.stderr)
        args.run_output = out  # what a Ctrl-C reports as kept
        run(recipe, out, resume=args.resume, overwrite=args.overwrite)
    report = write_report(load_runs(dirs), root / "report.html", labels=[r.name for r in recipes])
    print(f"report      {report} and {report.with_suffix('.md')} ({len(dirs)} runs)")
    return 0


def cmd_audit(args) -> int:
    """Exit 0 when the checkpoint passes the coverage audit, 1 when it fails (bad input: 2, from main)."""
    from .audit import audit_checkpoint

    report = audit_checkpoint(args.checkpoint, args.trust_remote_code)
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

    from .audit import audit_before_eval

    cfg = _evaluate_config(args.set)
    target = Path(args.target)
    out = Path(args.output or f"runs/eval-{target.name or 'model'}")
    check_eval_output(out, args.output or str(out), target)  # before any work
    name = args.baseline or (_recipe_model(target) if checkpoint.is_checkpoint(target) else None)
    if args.stream_baseline:
        reference = Reference(name, None, stream_from=_stream_folder(name))
    else:
        reference = Reference(name, name and (lambda: load_model(name, trust_remote_code=args.trust_remote_code,
                                                                 allow_pickle=args.allow_pickle)[0]))
    audit = audit_before_eval(target, args.trust_remote_code)  # a lowbit checkpoint's files and structure; its model freed before evaluate
    results = evaluate(args.target, cfg, reference, trust_remote_code=args.trust_remote_code,
                       allow_pickle=args.allow_pickle).to_dict()
    if audit is not None:
        results["audit"] = audit.to_dict()
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(results, indent=2))
    write_report([results], out / "report.html")
    ppl, base_ppl = results["quality"]["perplexity"], results["quality"]["baseline_perplexity"]
    print(f"perplexity  {ppl:.3f}" + (f" (baseline {base_ppl:.3f})" if base_ppl else ""))
    kl = results["quality"].get("kl")
    if kl:
        print(f"KL          mean {kl['kl_mean']:.5f}  p99 {kl['kl_p99']:.5f}  top-1 {kl['top1_agreement']:.4f}")
    if audit is not None:
        print(f"audit       {audit.headline()}")
    if audit is not None and not audit.passed:  # evaluated all the same: the figures may be of a damaged checkpoint
        print(f"warning     the checkpoint failed its audit ({audit.problems[0]}"
              f"{f' and {len(audit.problems) - 1} more' if len(audit.problems) > 1 else ''}); "
              f"`lowbit audit {target}` lists every problem")
    print(f"results     {out / 'results.json'}  report {out / 'report.html'}")
    return 0


EVAL_FILES = {"results.json", "report.html", "report.md"}  # what `lowbit eval` writes (and rewrites)


def check_eval_output(out: Path, shown: str, target: Path) -> None:
    """`lowbit eval` writes EVAL_FILES into --output: never into or around the model it evaluates,
    nor over anything else that folder holds."""
    check_output_name(out, "--output", shown)
    if target.is_dir():
        check_apart(out, [("model evaluated", target)], shown=shown)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {shown} exists and is not a folder; choose another --output")
    others = sorted(p.name for p in out.iterdir() if p.name not in EVAL_FILES) if out.is_dir() else []
    if others:
        raise ValueError(f"--output {shown} holds files other than lowbit eval's {sorted(EVAL_FILES)} "
                         f"({', '.join(others[:3])}); choose an empty or new folder")


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
    """The model a checkpoint's recipe.yaml names (read with the recipes' bounded YAML loader)."""
    recipe = folder / "recipe.yaml"
    data = parse_yaml(recipe.read_text(encoding="utf-8"), str(recipe), "") if recipe.is_file() else None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


def _evaluate_config(items: list[str]):
    """EvaluateConfig from --set evaluate.KEY=VALUE items, validated like a recipe's."""
    from lowbit.evaluate.config import EvaluateConfig

    from lowbit.recipes.schema import apply_override

    data: dict = {}
    for item in items:
        if not item.startswith("evaluate."):
            raise RecipeError("--set", item, "lowbit eval takes evaluate.* options only")
        apply_override(data, item, "--set")
    return build(EvaluateConfig, data.get("evaluate"), "--set", "evaluate")
