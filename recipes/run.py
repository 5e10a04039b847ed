"""run(recipe): load → calibrate/quantize steps → export → evaluate what was written."""
from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import torch
import yaml

from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.data import calibration_batches
from lowbit.calibrate.hardware import cpu_info
from lowbit.calibrate.models import load_model
from lowbit.evaluate.baseline import cached_baseline
from lowbit.evaluate.memory import checkpoint_weight_bytes, model_weight_bytes
from lowbit.evaluate.perplexity import perplexity
from lowbit.evaluate.report import write_report
from lowbit.evaluate.suite import LazyModel, evaluate_extras
from lowbit.export import checkpoint
from lowbit.export.files import out_of_space_names
from lowbit.export.manifest import write_text_atomic
from lowbit.export.model_card import write_model_card
from lowbit.quantize.steps.context import StepContext

from .audit import audit_run
from .lock import output_lock
from .preflight import preflight
from .resume import RunProgress
from .schema import Recipe
from lowbit.quantize.steps.registry import STEPS


def timer(seconds: dict):
    """`with timed(key):` adds the block's wall time to seconds[key] (blocks may repeat)."""
    @contextmanager
    def timed(key: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start
    return timed


def run(recipe: Recipe, output: str | Path, resume: bool = False) -> dict:
    """With resume, continue an interrupted run of the same recipe where it stopped: from its last
    finished layer, or, when it had exported its checkpoint, with the evaluation alone."""
    output = Path(output)
    with output_lock(output), out_of_space_names(output, "cannot write the run for output"):
        checkpoint.check_output_dir(output, recipe.export.overwrite)  # fail before hours of work
        with RunProgress.open(output, recipe.to_dict(), resume) as progress:
            hardware = cpu_info()  # what every CPU-dependent choice below was made for
            print(f"[lowbit] CPU: {hardware.describe()}", file=sys.stderr)
            exported = progress.exported() or quantize_and_export(recipe, progress)
            seconds = dict(exported["seconds"])  # load, calibrate, quantize, export: done once
            timed = timer(seconds)
            with timed("evaluate_s"):
                print(f"[lowbit] evaluating the checkpoint written in {progress.checkpoint}", file=sys.stderr)
                quality, weight_bytes, extras = evaluate_checkpoint(recipe, progress.checkpoint, exported)
            baseline = exported["baseline"]
            results = {
                "lowbit_version": version("lowbit"),
                "model": exported["model"],
                "hardware": hardware.to_dict(),
                "recipe": recipe.to_dict(),
                "quality": {
                    "perplexity": quality["perplexity"],
                    "baseline_perplexity": baseline["perplexity"] if baseline else None,
                    "dataset": recipe.evaluate.perplexity.dataset,
                    "protocol": {**recipe.to_dict()["evaluate"]["perplexity"], **_protocol_facts(quality)},
                    **extras.pop("quality"),
                },
                "memory": {"weight_bytes": weight_bytes, "baseline_weight_bytes": exported["baseline_bytes"],
                           **extras.pop("memory")},
                "timing": {k: round(seconds.get(k, 0.0), 3) for k in
                           ("load_s", "calibrate_s", "quantize_s", "export_s", "evaluate_s")},
                "steps": exported["steps"],
                "audit": exported["audit"],
                **extras,  # speed, baselines (bitsandbytes), when enabled
            }
            write_results(progress.checkpoint, results, recipe, output.name)
            progress.publish(output)  # the folder appears whole, results included, or not at all
    return results


def quantize_and_export(recipe: Recipe, progress: RunProgress) -> dict:
    """Load, measure the baseline, run the steps, audit and export into progress.checkpoint;
    returns what evaluating the checkpoint needs (kept by progress, so a resumed run skips this)."""
    seconds: dict = {}
    timed = timer(seconds)
    model, tokenizer, seconds["load_s"] = load_model(recipe.model, trust_remote_code=recipe.trust_remote_code,
                                                     allow_pickle=recipe.allow_pickle)
    preflight(recipe, model, tokenizer)  # NaN weights, a tokenizer the protocol cannot use: before any work
    info = {"id": recipe.model, "params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
            "model_type": model.config.model_type,
            "dtype": str(model.dtype).removeprefix("torch.")}  # what the baseline's quality and speed ran in
    baseline_bytes = model_weight_bytes(model, bytes_per_param=2)  # as a 16-bit checkpoint
    protocol = recipe.evaluate.perplexity
    baseline = None
    if recipe.evaluate.baseline:
        with timed("evaluate_s"):  # before quantizing: the model in memory is still the baseline
            baseline = cached_baseline(recipe.model, protocol, lambda: perplexity(model, tokenizer, protocol))
    arch = arch_for(model)
    ctx = StepContext(model, arch, recipe.ignore, lambda: _batches(recipe, tokenizer, timed))
    steps = []
    for index, step in enumerate(recipe.steps):
        ctx.layer_store = progress.step(index)
        start = time.perf_counter()
        with timed("quantize_s"):
            detail = STEPS[step.name].apply(ctx, step.config)
        steps.append({"name": step.name, "seconds": time.perf_counter() - start, **detail})
    seconds["quantize_s"] = seconds.get("quantize_s", 0.0) - seconds.get("calibrate_s", 0.0)
    audit = audit_run(model, recipe, arch, steps)  # before export: a failed audit publishes nothing
    audit.raise_if_failed()
    with timed("export_s"):
        checkpoint.save(model, tokenizer, progress.new_checkpoint(), recipe.export)
    exported = {"model": info, "baseline_bytes": baseline_bytes, "baseline": baseline, "steps": steps,
                "audit": audit.to_dict(), "seconds": seconds}
    progress.record_export(exported)
    return exported


def evaluate_checkpoint(recipe: Recipe, folder: Path, exported: dict) -> tuple[dict, int, dict]:
    """Perplexity, weight bytes and the enabled extras of the checkpoint as written (reloaded)."""
    reloaded, tokenizer = checkpoint.load(folder, trust_remote_code=recipe.trust_remote_code)
    quality = perplexity(reloaded, tokenizer, recipe.evaluate.perplexity)
    weight_bytes = checkpoint_weight_bytes(folder)
    reference = LazyModel(lambda: load_model(recipe.model, trust_remote_code=recipe.trust_remote_code,
                                             allow_pickle=recipe.allow_pickle)[0])
    extras = evaluate_extras(reloaded, tokenizer, recipe.evaluate, model_name=recipe.model,
                             weight_bytes=weight_bytes, baseline_weight_bytes=exported["baseline_bytes"],
                             reference=reference, steps=exported["steps"])
    return quality, weight_bytes, extras


def write_results(folder: Path, results: dict, recipe: Recipe, name: str) -> None:
    """results.json, the recipe, the report and the model card; the manifest refreshed last."""
    write_text_atomic(folder / "results.json", json.dumps(results, indent=2))
    write_text_atomic(folder / "recipe.yaml", yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    write_report([results], folder / "report.html", labels=[recipe.name])
    write_model_card(folder, results, name)  # README.md from the results; refreshes manifest.json last


def _batches(recipe: Recipe, tokenizer, timed) -> torch.Tensor:
    with timed("calibrate_s"):
        print(f"[lowbit] calibration data: {recipe.calibration.samples} samples × "
              f"{recipe.calibration.seq_len} tokens of {recipe.calibration.dataset!r}", file=sys.stderr)
        return calibration_batches(recipe.calibration, tokenizer)


def _protocol_facts(measured: dict) -> dict:
    keys = ("tokens_scored", "windows", "bos_token_id", "stride_effective")
    return {k: measured[k] for k in keys}
