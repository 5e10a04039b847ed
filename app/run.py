"""run(recipe): load → calibrate/quantize steps → export → evaluate what was written."""
from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path
from typing import Optional

import yaml

from lowbit.calibrate.experts import active_params
from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.distributed import broadcast_json, world
from lowbit.calibrate.hardware import cpu_info, resolve_device
from lowbit.calibrate.offload import resolve_offload
from lowbit.calibrate.models import load_model, local_model_folder
from lowbit.evaluate.baseline import cached_baseline
from lowbit.evaluate.placement import placement_of, resolve_placement
from lowbit.evaluate.config import require_evaluation_packages
from lowbit.evaluate.evaluation import evaluate
from lowbit.evaluate.memory import model_weight_bytes
from lowbit.evaluate.perplexity import perplexity
from lowbit.evaluate.report import write_report
from lowbit.evaluate.results import ModelInfo, Results
from lowbit.evaluate.suite import Reference
from lowbit.export.files import out_of_space_names
from lowbit.export.formats.hf_folder import model_code
from lowbit.export.output_folder import check_apart, check_output_dir, check_output_name
from lowbit.export.portions import save_in_portions
from lowbit.export.manifest import write_text_atomic
from lowbit.export.model_card import write_model_card
from lowbit.quantize.steps.context import StepContext
from lowbit.recipes.gguf_defaults import export_config
from lowbit.recipes.runtime_targets import check_target
from lowbit.recipes.schema import Recipe

from .audit import RunAudit
from .coverage import check_quantizes
from .lock import output_lock
from .preflight import preflight, preflight_settings
from .fit_recipe import resolve_fit
from .resume import RunProgress
from .stepping import ResidentLayers, apply_steps, float_model, rank_samples, stored_dtype, timer
from .streamed import StreamedRun, load_skeleton, streaming_folder

TIMINGS = ("load_s", "calibrate_s", "quantize_s", "export_s", "evaluate_s")


def run(recipe: Recipe, output: str | Path, resume: bool = False, overwrite: bool = False) -> dict:
    """recipe -> load and calibrate -> quantize -> audit -> export -> evaluate -> report; returns
    results.json's content. With resume, continue an interrupted run of the same recipe where it
    stopped: from its last finished layer, or, when it had exported, with the evaluation alone.
    overwrite: replace a folder lowbit wrote at `output` (never another: export/output_folder.py)."""
    check_run_output(recipe, output, overwrite)  # before any work, and before the lock is made beside it
    planned = resolve_fit(recipe)  # a budget becomes its plan (on every rank, before anything else)
    if planned is not recipe:  # that plan, against export.target, before calibrating
        check_target(planned)
    recipe = planned
    if not world().main:  # under torchrun: the other ranks calibrate with rank 0, which alone writes
        from .ranks import calibrate_only

        return calibrate_only(recipe)
    output = Path(output)
    with output_lock(output), out_of_space_names(output, "cannot write the run for output"):
        check_output_dir(output, overwrite)  # again, holding the lock: a run may have published since
        with RunProgress.open(output, recipe.to_dict(), resume) as progress:
            print(f"[lowbit] CPU: {cpu_info().describe()}", file=sys.stderr)  # what CPU choices were made for
            exported = progress.exported()
            broadcast_json(exported is None, 0)  # whether the other ranks calibrate (ranks.calibrate_only)
            exported = exported or quantize_and_export(recipe, progress)
            gc.collect()  # the calibrated model is gone before the checkpoint is reloaded
            seconds = dict(exported["seconds"])  # load, calibrate, quantize, export: done once
            with timer(seconds)("evaluate_s"):
                evaluated = evaluate_checkpoint(recipe, progress.checkpoint, exported)
            results = with_run_sections(evaluated, recipe, exported, seconds).to_dict()
            write_results(progress.checkpoint, results, recipe, output.name)
            progress.publish(output)  # the folder appears whole, results included, or not at all
    return results


def check_run_output(recipe: Recipe, output: str | Path, overwrite: bool, shown: Optional[str] = None) -> None:
    """Refuse, before any work, an output lowbit may not write: a folder it did not write, or one
    that is, lies inside or contains the model's folder; and a recipe that quantizes nothing."""
    check_quantizes(recipe)  # before the model is loaded (coverage.py)
    check_output_name(Path(output), "--output", shown or str(output))
    folder = local_model_folder(recipe.model)
    if folder is not None:
        check_apart(Path(output), [("model folder", folder)], shown=shown)
    check_output_dir(Path(output), overwrite, shown=shown)
    require_evaluation_packages(recipe.evaluate)
    resolve_placement(recipe.evaluate.device, recipe.evaluate.dtype)  # evaluate.device cuda without a GPU
    check_target(recipe)  # a plan export.target's runtime cannot load (recipes/runtime_targets.py)


def quantize_and_export(recipe: Recipe, progress: RunProgress) -> dict:
    """Load, measure the baseline, run the steps, audit and export into progress.checkpoint;
    returns what evaluating the checkpoint needs (kept by progress, so a resumed run skips this).
    A model that does not fit (streaming_folder) is never resident: a skeleton whose decoder layers
    each step streams through the resume folder, its baseline measured streamed by the evaluation.
    Either way the audit checks, and the export writes, the model as its layer source hands it out."""
    seconds: dict = {}
    timed = timer(seconds)
    folder = streaming_folder(recipe)
    model, tokenizer, baseline_bytes, weights = (load_resident(recipe, seconds, timed) if folder is None
                                                 else load_streamed(recipe, folder, seconds))
    info = model_info(recipe, model)
    arch = arch_for(model)
    audit = RunAudit(recipe, model, arch)  # what each step should leave, read from the float model
    ctx = step_context(recipe, model, arch, tokenizer, timed, progress)
    if folder is None:  # a streamed model is never resident twice
        ctx.reference = float_model(recipe)
    layers = (ResidentLayers(model, arch, lambda index: resident_store(progress, index)) if weights is None
              else StreamedRun(model, arch, weights, progress))
    steps, source = apply_steps(recipe, ctx, layers, timed)
    seconds["quantize_s"] = seconds.get("quantize_s", 0.0) - seconds.get("calibrate_s", 0.0)
    audit.noting(steps)
    with timed("export_s"):  # the audit sees each portion before it is written: a failed one publishes nothing
        save_in_portions(model, tokenizer, progress.new_checkpoint(), export_config(recipe, model), arch, source,
                         extra_files=model_code(recipe.model, recipe.trust_remote_code), check=audit)
    exported = {"model": info, "baseline_bytes": baseline_bytes, "steps": steps, "audit": audit.report.to_dict(),
                "seconds": seconds}
    if folder is not None:
        exported["streamed_from"] = folder
    progress.record_export(exported)
    return exported


def load_resident(recipe: Recipe, seconds: dict, timed) -> tuple:
    """(model, tokenizer, 16-bit baseline bytes, None): the model in memory, checked, its baseline
    perplexity measured now where evaluation will use it."""
    model, tokenizer, seconds["load_s"] = load_model(recipe.model, trust_remote_code=recipe.trust_remote_code,
                                                     allow_pickle=recipe.allow_pickle)
    preflight(recipe, model, tokenizer)  # NaN weights, a tokenizer the protocol cannot use: before any work
    baseline_bytes = model_weight_bytes(model, bytes_per_param=2)  # as a 16-bit checkpoint
    if baseline_now(recipe, model):  # into the cache evaluate() reads, while the model is still the baseline
        protocol = recipe.evaluate.perplexity
        with timed("evaluate_s"):
            cached_baseline(recipe.model, protocol, lambda: perplexity(model, tokenizer, protocol), placement_of(model))
    return model, tokenizer, baseline_bytes, None


def load_streamed(recipe: Recipe, folder: str, seconds: dict) -> tuple:
    """(skeleton, tokenizer, 16-bit baseline bytes, its weights): nothing of the weights read yet
    (they are checked per layer, as they are read)."""
    model, tokenizer, weights, seconds["load_s"] = load_skeleton(recipe, folder)
    preflight_settings(recipe, model, tokenizer)
    return model, tokenizer, 2 * weights.numel(), weights


def step_context(recipe: Recipe, model, arch, tokenizer, timed, progress: RunProgress) -> StepContext:
    """What the steps receive: the model, its layout, the batches (built on first use), the device,
    and where a walk's activations wait (disk: under the run's resume folder)."""
    device = resolve_device(recipe.calibration.device)
    cal = recipe.calibration
    activation_bytes = cal.samples * cal.seq_len * model.config.get_text_config().hidden_size * 4
    offload = resolve_offload(cal.offload, device, activation_bytes, progress.folder / "activations")
    return StepContext(model, arch, recipe.ignore, lambda: rank_samples(recipe, tokenizer, timed), device=device,
                       offload=offload, stored_dtype=stored_dtype(recipe))


def model_info(recipe: Recipe, model) -> dict:
    """results.json's model facts: unique parameters (meta ones count too) and what the baseline's
    quality and speed ran in."""
    info = {"id": recipe.model, "params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
            "model_type": model.config.model_type, "dtype": str(model.dtype).removeprefix("torch.")}
    active = active_params(model)
    return info if active == info["params"] else {**info, "active_params_per_token": active}


def resident_store(progress: RunProgress, index: int):
    """Where a resident step keeps its finished layers: under torchrun a rank's hidden states are its
    share only, so layers are kept in one process alone."""
    return progress.step(index) if world().size == 1 else None


def baseline_now(recipe: Recipe, model) -> bool:
    """Whether the loaded model can give evaluation its baseline perplexity: only where it already
    is where evaluation will run (a bfloat16 GPU evaluation measures its own)."""
    cfg = recipe.evaluate
    return cfg.baseline and placement_of(model) == resolve_placement(cfg.device, cfg.dtype).describe()


def evaluate_checkpoint(recipe: Recipe, folder: Path, exported: dict) -> Results:
    """The checkpoint as written (reloaded), against the recipe's model (loaded only if needed)."""
    print(f"[lowbit] evaluating the checkpoint written in {folder}", file=sys.stderr)
    if exported.get("streamed_from"):  # the baseline did not fit: never load it
        reference = Reference(recipe.model, None, weight_bytes=exported["baseline_bytes"],
                              stream_from=exported["streamed_from"])
    else:
        reference = Reference(recipe.model, float_model(recipe), weight_bytes=exported["baseline_bytes"])
    return evaluate(folder, recipe.evaluate, reference, trust_remote_code=recipe.trust_remote_code)


def with_run_sections(evaluated: Results, recipe: Recipe, exported: dict, seconds: dict) -> Results:
    """The evaluation's results with what only the run knows: the unquantized model's facts, the
    resolved recipe, the stage timings, what each step did and the audit."""
    return dataclasses.replace(
        evaluated, model=ModelInfo(**exported["model"], reference=recipe.model), recipe=recipe.to_dict(),
        timing={k: round(seconds.get(k, 0.0), 3) for k in TIMINGS}, steps=exported["steps"], audit=exported["audit"])


def write_results(folder: Path, results: dict, recipe: Recipe, name: str) -> None:
    """results.json, the recipe, the report and the model card; the manifest refreshed last."""
    write_text_atomic(folder / "results.json", json.dumps(results, indent=2))
    write_text_atomic(folder / "recipe.yaml", yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    write_report([results], folder / "report.html", labels=[recipe.name])
    write_model_card(folder, results, name)  # README.md from the results; refreshes manifest.json last
