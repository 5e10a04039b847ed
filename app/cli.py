"""The `lowbit` command line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lowbit.calibrate.cache import check_cache
from lowbit.calibrate.corpora import CORPORA
from lowbit.calibrate.models import BUILTIN_MODELS
from lowbit.evaluate.config import MissingPackageError
from lowbit.export.config import DTYPES, GGUF_TYPES
from lowbit.export.formats.registry import FORMATS
from lowbit.export.runtimes import RUNTIMES

from lowbit.calibrate.distributed import PeerFailure
from lowbit.recipes.schema import load_recipe, shipped_recipes
from lowbit.recipes.validate import RecipeError

from .ranks import PEER_EXIT, as_rank, error_prefix, error_stream, launched, relaunch, report_crash


MESSAGE_CHARS = 4000  # an error line's length at most (values in it are shortened where they are quoted)
OVERWRITE_HELP = ("replace an output folder that lowbit wrote (its manifest.json lists every file in it); "
                  "a folder lowbit did not write is never replaced")
ALLOW_PICKLE_HELP = ("load pickle-based *.bin weights (through torch.load(weights_only=True)) when a "
                     "model has no safetensors; off by default")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --nproc re-launches
    try:
        if getattr(args, "uses_cache", False):  # before any work: a run reads its corpus from it only at evaluation
            check_cache()
        return args.handler(args)
    except (RecipeError, OSError, ValueError, MissingPackageError, PeerFailure) as err:  # OSError: missing
        # files, permissions, disk full; PeerFailure: a collective another rank left
        print(f"lowbit: error: {bounded(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line saying what a rerun with --resume can use
        from .resume import kept_summary

        output = getattr(args, "run_output", None)
        print(f"lowbit: interrupted; {kept_summary(output) if output else 'nothing was kept'}", file=sys.stderr)
        return 130


def bounded(message: str, limit: int = MESSAGE_CHARS) -> str:
    """An error message no longer than `limit` characters, whatever value it quotes."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}… ({len(message) - limit} more characters)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowbit", description="Quantize, export and evaluate causal LMs.")
    sub = p.add_subparsers(required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run a recipe: calibrate, quantize, export, evaluate")
    run.add_argument("recipe", help="shipped recipe name (see `lowbit recipes`) or a YAML path")
    run.add_argument("--model", help="built-in model name, local folder or hub id (overrides the recipe)")
    run.add_argument("--output", help="checkpoint folder (default runs/<recipe>-<model>)")
    run.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    run.add_argument("--dry-run", action="store_true",
                     help="check the recipe, the --set values, the model reference and the output folder, print the "
                          "resolved recipe and stop: nothing is loaded or written")
    run.add_argument("--resume", action="store_true",
                     help="continue an interrupted run of this recipe from its last finished layer")
    run.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                     help="override a recipe value, e.g. --set calibration.samples=64")
    run.add_argument("--allow-pickle", action="store_true", help=ALLOW_PICKLE_HELP)
    run.add_argument("--target", choices=list(RUNTIMES), help="the runtime that must load the checkpoint "
                     "(overrides export.target): a plan it cannot load is refused before any work")
    run.add_argument("--device", metavar="auto|cpu|cuda|cuda:N",
                     help="where calibration runs (overrides calibration.device; default auto: a GPU if torch sees one)")
    run.add_argument("--nproc", type=int, default=1, metavar="N",
                     help="calibrate in N processes (torchrun, gloo on CPU): samples split across them, "
                          "statistics all-reduced, linears solved round-robin; rank 0 writes")
    run.set_defaults(handler=_cmd_run, uses_cache=True)
    export = sub.add_parser("export", help="rewrite a checkpoint in another format")
    export.add_argument("checkpoint", help="checkpoint folder (lowbit's, or compressed-tensors from other tools)")
    export.add_argument("--format", required=True, choices=list(FORMATS),
                        help="; ".join(f.summary for f in FORMATS.values()))
    export.add_argument("--output", required=True, help="folder to write")
    export.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    export.add_argument("--dtype", choices=DTYPES,
                        help="float tensors and scales (default: the source's)")
    export.add_argument("--type", choices=GGUF_TYPES, help="gguf: round float linears to this GGML type "
                        "(llama.cpp's reference RTN; default: keep them in --dtype)")
    export.add_argument("--embedding-type", choices=GGUF_TYPES,
                        help="gguf: the token embedding's GGML type (default: --dtype)")
    export.add_argument("--trust-remote-code", action="store_true", help="run (and carry) the checkpoint's own "
                        "code (the .py files its config.json's auto_map names); review them first")
    export.set_defaults(handler=_cmd_export)
    models = sub.add_parser("models", help="list built-in models")
    models.set_defaults(handler=_cmd_models)
    recipes = sub.add_parser("recipes", help="list shipped recipes")
    recipes.set_defaults(handler=_cmd_recipes)
    _add_eval_commands(sub)
    from .fit import add_parser as add_fit_parser

    add_fit_parser(sub)
    return p


def _add_eval_commands(sub) -> None:
    from .commands import cmd_audit, cmd_eval, cmd_report, cmd_sweep

    ev = sub.add_parser("eval", help="evaluate a built-in model, HF folder or lowbit checkpoint")
    ev.add_argument("target", metavar="MODEL_OR_CHECKPOINT")
    ev.add_argument("--baseline", help="unquantized model to compare with (default: the checkpoint's recipe model)")
    ev.add_argument("--output", help="folder for results.json and the report (default runs/eval-<name>)")
    ev.add_argument("--set", action="append", default=[], metavar="evaluate.KEY=VALUE",
                    help="override an evaluate option, e.g. --set evaluate.speed.enabled=true")
    ev.add_argument("--stream-baseline", action="store_true",
                    help="never load the baseline model: measure its perplexity and KL one decoder layer at "
                         "a time from its safetensors shards (for a baseline larger than memory; speed and "
                         "lm-eval, which need it resident, leave it out)")
    ev.add_argument("--allow-pickle", action="store_true", help=ALLOW_PICKLE_HELP)
    ev.add_argument("--trust-remote-code", action="store_true",
                    help="run the model's own code (config.json's auto_map) when loading it; review it first")
    ev.set_defaults(handler=cmd_eval, uses_cache=True)
    rep = sub.add_parser("report", help="compare runs: write report.html and report.md")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR")
    rep.add_argument("-o", "--output", default="report.html")
    rep.set_defaults(handler=cmd_report)
    sw = sub.add_parser("sweep", help="run several recipes on one model and write one comparison report")
    sw.add_argument("recipes", nargs="+", metavar="RECIPE")
    sw.add_argument("--model", required=True)
    sw.add_argument("--output", help="folder for the runs and report.html (default runs/sweep-<model>)")
    sw.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    sw.add_argument("--resume", action="store_true",
                    help="keep finished runs (folders with results.json) and resume interrupted ones")
    sw.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                    help="override a value in every recipe, e.g. --set evaluate.speed.enabled=true")
    sw.set_defaults(handler=cmd_sweep, uses_cache=True)
    au = sub.add_parser("audit", help="check a checkpoint's coverage: every targeted linear quantized, scales "
                        "finite and positive, KV scales set (exit 0 clean, 1 failed, 2 bad input)")
    au.add_argument("checkpoint", metavar="CHECKPOINT")
    au.add_argument("--trust-remote-code", action="store_true",
                    help="run the model's own code (config.json's auto_map) to load it; review it first")
    au.set_defaults(handler=cmd_audit)


def _cmd_run(args) -> int:
    if args.nproc != 1 and not launched():
        return relaunch(args.argv, args.nproc)
    if not launched():
        return _run(args)
    with as_rank() as rank:
        try:  # here, while the rank is known and its errors reach the real stderr
            code = _run(args)
        except (RecipeError, OSError, ValueError, MissingPackageError, PeerFailure) as err:
            print(f"lowbit: error: {error_prefix()}{err}", file=error_stream())
            return PEER_EXIT if isinstance(err, PeerFailure) else 2
        except Exception as err:
            report_crash(err)
            return 1
        return code if rank.main else 0


def _run(args) -> int:
    from .run import run

    overrides = list(args.set)
    if args.model:
        overrides.append(f"model={args.model}")
    if args.allow_pickle:
        overrides.append("allow_pickle=true")
    if args.device:
        overrides.append(f"calibration.device={args.device}")
    if args.target:
        overrides.append(f"export.target={args.target}")
    recipe = load_recipe(args.recipe, tuple(overrides))
    output = args.run_output = Path(args.output or f"runs/{recipe.name}-{Path(recipe.model).name}")
    if args.dry_run:
        return _dry_run(recipe, output, args)
    results = run(recipe, output, resume=args.resume, overwrite=args.overwrite)
    if results:  # {} on ranks other than 0, which write nothing
        _print_summary(results, output)
    return 0


def _dry_run(recipe, output: Path, args) -> int:
    """What `run` would check before any work, without loading or writing anything; the resolved
    recipe on stdout."""
    import yaml

    from lowbit.calibrate.models import check_model_reference

    from .run import check_run_output

    check_model_reference(recipe.model, recipe.allow_pickle)
    check_run_output(recipe, output, args.overwrite, shown=args.output)
    print(yaml.safe_dump(recipe.to_dict(), sort_keys=False), end="")
    print(f"[lowbit] dry run: the recipe is valid; `lowbit run` would write {output}", file=sys.stderr)
    return 0


def _cmd_export(args) -> int:
    from lowbit.export.convert import convert

    out = convert(args.checkpoint, args.output, args.format, args.overwrite, args.dtype,
                  gguf_type=args.type, embedding_type=args.embedding_type, trust_remote_code=args.trust_remote_code)
    print(f"wrote {args.format} checkpoint {out}")
    return 0


def _print_summary(r: dict, output: Path) -> None:
    from lowbit.quantize.audit import headline

    q, m, t = r["quality"], r["memory"], r["timing"]
    kind = "float" if r.get("audit", {}).get("float_export") else "quantized"  # a float export is not quantized
    base = q["baseline_perplexity"]
    delta = f" ({100 * (q['perplexity'] / base - 1):+.2f}%)" if base else ""
    print(f"recipe      {r['recipe']['name']} on {r['model']['id']} ({r['model']['params'] / 1e6:.1f}M params)")
    if base:
        print(f"perplexity  baseline {base:.3f}  {kind} {q['perplexity']:.3f}{delta}  "
              f"[{q['dataset']}, {q['protocol']['tokens_scored']} tokens, ctx {q['protocol']['context_len']}]")
    else:
        print(f"perplexity  {kind} {q['perplexity']:.3f}")
    print(f"weights     {m['weight_bytes'] / 2**20:.1f} MiB (16-bit baseline {m['baseline_weight_bytes'] / 2**20:.1f} MiB)")
    print("time        " + "  ".join(f"{k[:-2]} {v:.1f}s" for k, v in t.items()))
    if "audit" in r:  # the line `lowbit audit` prints of the checkpoint
        print(f"audit       {headline(r['audit'])}")
    print(f"checkpoint  {output}  (results.json beside it)")


def _cmd_models(args) -> int:
    for name, spec in BUILTIN_MODELS.items():
        print(f"{name:16s} {spec.description}")
    print("\nAlso: any local Hugging Face model folder (safetensors) or hub id.")
    print("Built-in corpora: " + ", ".join(f"{k} ({v})" for k, v in CORPORA.items()))
    return 0


def _cmd_recipes(args) -> int:
    import yaml

    for name, path in shipped_recipes().items():
        desc = (yaml.safe_load(path.read_text()) or {}).get("description", "")
        print(f"{name:24s} {desc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
