"""The coverage audit with a recipe's knowledge: what each step should have left on the model.

`RunAudit` checks a run's model a portion at a time as the export reads it (so a failed audit
publishes nothing), resident and streamed runs alike; `audit_run` is it over a model in memory;
`audit_checkpoint` checks a written checkpoint against its recipe.yaml, or, for checkpoints
without one (other tools' compressed-tensors), against its config.json.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch
import yaml
from torch import nn

from lowbit.calibrate.experts import unfuse_experts
from lowbit.calibrate.arch import Arch, arch_for, decoder_layers, is_linear, matches_name
from lowbit.calibrate.layer_source import MemoryLayers, Portion
from lowbit.export import checkpoint, kv_scales
from lowbit.export.manifest import MANIFEST
from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.steps.registry import STEPS
from lowbit.quantize.audit import AuditReport, audit_model, damping_notes, fallback_notes
from lowbit.quantize.runtime.modules import is_quantized_linear
from lowbit.quantize.grids.kv import KVCacheConfig
from lowbit.quantize.targets import listed_targets, slots
from lowbit.recipes.schema import Recipe, parse_recipe
from lowbit.recipes.validate import RecipeError

from .coverage import WRITTEN_FLOAT, as_written, check_targets, float_export, float_export_note
from .checkpoint_files import RECIPE_FILE, config_disagreements, file_integrity, read_config

RESULTS_FILE = "results.json"


def expected_schemes(recipe: Recipe, model: nn.Module, arch: Arch):
    """(name -> LinearScheme, ignored name -> reason, KV config or None) that the recipe's steps
    should leave, as each step's spec says: the first step that writes weights quantizes every
    targeted linear (later ones find them already quantized, as select_targets skips them), a step
    that adds inputs adds them to the linears whose grid takes them, a KV step sets the KV format; steps that only
    fold scales (awq, smoothquant) say nothing."""
    listed, ignored = listed_targets(model, arch, recipe.ignore)
    targeted = list(listed)
    expected: dict[str, LinearScheme] = {}
    kv: Optional[KVCacheConfig] = None
    for step in recipe.steps:
        spec = STEPS[step.name]
        writes, inputs = spec.writes(step.config), spec.adds_inputs(step.config)
        if writes is not None:
            for name, scheme in _per_linear(writes, model, arch, targeted, ignored).items():
                expected.setdefault(name, scheme)
        if inputs is not None:
            expected = {n: LinearScheme(s.weights, inputs) if s.weights.takes_inputs(inputs) else s
                        for n, s in expected.items()}
        kv = spec.kv_cache(step.config) or kv
    for name in targeted:
        if name not in expected:
            ignored[name] = "no weight step in the recipe quantizes it"
    return expected, ignored, kv


def _per_linear(writes: LinearScheme, model: nn.Module, arch: Arch, targeted, ignored: dict) -> dict:
    """What a step leaves on each targeted linear: the grid its plan gives it (one grid, each
    linear's GGML type under a llama.cpp file type, each one's format under a format per linear),
    with the step's inputs; those the plan keeps 16-bit join `ignored`, as the step leaves them."""
    grids, kept = writes.weights.assign(slots(model, arch, targeted))
    ignored.update(kept)
    return {name: LinearScheme(grid, writes.inputs) for name, grid in grids.items()}


class RunAudit:
    """A run's audit, one portion of the model at a time (export/portions.py calls it on each before
    writing it); the portions' reports add up to the whole model's. What each step should leave is
    read from the model before the steps (a streamed run's float skeleton); scales are judged in
    the export dtype. A plan that quantizes nothing is refused here, before any step (coverage.py).

    The report says what the checkpoint holds: for a float export (coverage.py), the run checks
    the steps' quantized linears and reports them as written, float. written: `model` is the
    checkpoint read back (`lowbit audit`), where a float export's linears are float already."""

    def __init__(self, recipe: Recipe, model: nn.Module, arch: Arch, written: bool = False):
        self.expected, self.ignored, self.kv = expected_schemes(recipe, model, arch)
        check_targets(recipe, self.expected, self.ignored)
        self.arch, self.ignore = arch, recipe.ignore
        self.storage_dtype = None if written else getattr(torch, recipe.export.dtype)  # a file's are stored already
        self.report = AuditReport(float_export=float_export_note(recipe))
        self.dequantized = bool(self.report.float_export) and not written  # checked quantized, written float
        if written and self.report.float_export:
            self.ignored.update(dict.fromkeys(self.expected, WRITTEN_FLOAT))
            self.expected, self.kv = {}, None  # the dense format drops the KV cache's quantization too

    def noting(self, steps: list[dict]) -> "RunAudit":
        """What the steps' records say beside the checks: damping retries, fallbacks."""
        self.report.damping, self.report.fallbacks = list(damping_notes(steps)), fallback_notes(steps)
        return self

    def portion(self, model: nn.Module, portion: Portion) -> AuditReport:
        """Check the portion's modules (the rest of `model` is out of its tree or on meta) and add
        what was found to the run's report; returns the portion's own."""
        prefixes = tuple(f"{self.arch.layers}.{i}." for i in portion.layers)
        outer = tuple(portion.outer)
        expected = {n: s for n, s in self.expected.items()
                    if n.startswith(prefixes) or n in outer or n.startswith(tuple(o + "." for o in outer))}
        part = audit_model(model, expected, self.ignored, self.kv, self.arch, self.storage_dtype, ignore=self.ignore)
        found = as_written(part) if self.dequantized else part
        self.report.checked.update(found.checked)
        self.report.off_plan.update(found.off_plan)
        self.report.kv = found.kv or self.report.kv
        self.report.ignored.update({n: why for n, why in found.ignored.items() if n not in self.report.ignored})
        self.report.problems += found.problems
        self.report.matrices.add(found.matrices)
        return part

    def __call__(self, model: nn.Module, portion: Portion) -> None:
        self.portion(model, portion).raise_if_failed()


def audit_run(model: nn.Module, recipe: Recipe, arch: Arch, steps: list[dict], written: bool = False) -> AuditReport:
    """The run's audit of a model in memory (one portion: the whole model), not raising on what it
    finds; `lowbit audit` runs it over the checkpoint read back (written), so the two agree."""
    audit = RunAudit(recipe, model, arch, written).noting(steps)
    whole, = MemoryLayers(model, arch).portions(len(decoder_layers(model, arch)))
    audit.portion(model, whole)
    return audit.report


def audit_checkpoint(folder: str | Path, trust_remote_code: bool = False) -> AuditReport:
    """Audit a written checkpoint: its files against manifest.json, config.json's quantization
    settings against its tensors, then the loaded model against its recipe.yaml, else against its
    config.json. trust_remote_code: run the model's own code (auto_map) to load it.

    Raises FileNotFoundError / ValueError when the folder is not a readable checkpoint."""
    folder = Path(folder)
    if not checkpoint.is_checkpoint(folder):
        raise FileNotFoundError(f"{folder}: not a checkpoint folder (needs config.json and model.safetensors, "
                                "model.safetensors.index.json or model.gguf)")
    config = read_config(folder)
    integrity, problems = file_integrity(folder)
    disagreements = config_disagreements(folder, config)
    if disagreements:  # the reader would build these modules wrong, or not at all: nothing more to check
        return AuditReport(problems=problems + disagreements, integrity=integrity)
    try:
        model = _load(folder, trust_remote_code)
    except ValueError as err:
        if not problems:
            raise
        return AuditReport(problems=problems + [str(err)], integrity=integrity)  # the damaged files are why
    recipe = saved_recipe(folder)
    if recipe is not None and float_export(recipe):  # a float export is judged as one, by its recipe
        if config.get("quantization_config"):
            problems.append(f"{folder / 'config.json'}: has a quantization_config, but its recipe.yaml asks for a "
                            f"float export (export.format {recipe.export.format})")
    elif not config.get("quantization_config") and not any(is_quantized_linear(m) for m in model.modules()):
        return AuditReport(problems=problems + [f"{folder}: not a quantized checkpoint (no quantized module, "
                                                "no quantization_config in config.json)"], integrity=integrity)
    report = _audit_loaded(folder, model, config, recipe)
    report.problems[:0], report.integrity = problems, integrity
    return report


def audit_before_eval(folder: str | Path, trust_remote_code: bool = False) -> Optional[AuditReport]:
    """`lowbit eval`'s audit of a lowbit checkpoint (recipe.yaml or manifest.json in it; None for
    any other model): the whole of audit_checkpoint, as loading the model is its cost and the
    recipe's expectations add nothing to it. An audit that cannot finish is a failed one: the
    evaluation goes on and says so."""
    folder = Path(folder)
    if not checkpoint.is_checkpoint(folder) or not any((folder / f).is_file() for f in (RECIPE_FILE, MANIFEST)):
        return None
    try:
        return audit_checkpoint(folder, trust_remote_code)
    except (ValueError, OSError) as err:
        return AuditReport(problems=[f"audit not completed: {err}"])


def _audit_loaded(folder: Path, model: nn.Module, config: dict, recipe: Optional[Recipe]) -> AuditReport:
    """The loaded model against its recipe (recipe.yaml), by the run's own audit, else against its
    config.json."""
    arch = native_arch(model)
    results = folder / RESULTS_FILE
    steps = json.loads(results.read_text(encoding="utf-8")).get("steps", []) if results.is_file() else []
    if recipe is not None:
        try:
            return audit_run(model, recipe, arch, steps, written=True)
        except RecipeError as err:  # a plan that quantizes nothing: what a run refuses before any work
            return AuditReport(problems=[str(err)])
    qconfig = config.get("quantization_config") or {}
    ignore = config_ignore_patterns(qconfig)
    expected, ignored, extra = schemes_from_config(model, qconfig, arch, ignore)
    saved = config.get(kv_scales.KEY)
    kv = KVCacheConfig.from_file(saved) if saved else None
    report = audit_model(model, expected, ignored, kv, arch, damping=tuple(damping_notes(steps)), ignore=ignore)
    report.fallbacks = fallback_notes(steps)
    report.problems += extra
    return report


def saved_recipe(folder: Path) -> Optional[Recipe]:
    """The recipe a lowbit checkpoint was written by (its recipe.yaml), or None."""
    recipe_file = folder / RECIPE_FILE
    if not recipe_file.is_file():
        return None
    data = yaml.safe_load(recipe_file.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{recipe_file}: not a recipe mapping")
    return parse_recipe(data, str(recipe_file))


def native_arch(model: nn.Module) -> Arch:
    """The layout of `model`'s architecture: the table's row, else the guess made from a float
    skeleton (on the meta device: no memory), since a guess over the loaded model would not see
    the linears its quantized modules replaced."""
    try:
        return arch_for(model, allow_fallback=False)
    except ValueError:
        with torch.device("meta"):
            skeleton = type(model)(model.config)
            unfuse_experts(skeleton)
            return arch_for(skeleton)


def _load(folder: Path, trust_remote_code: bool) -> nn.Module:
    try:
        return checkpoint.load(folder, trust_remote_code=trust_remote_code)[0]
    except (ValueError, FileNotFoundError):
        raise
    except Exception as err:  # transformers raises OSError, KeyError, ... on a broken folder
        raise ValueError(f"{folder}: cannot load as a checkpoint: {type(err).__name__}: {err}") from err


def schemes_from_config(model: nn.Module, qconfig: dict, arch: Arch, ignore: tuple[str, ...]):
    """Without a recipe: each quantized module is expected to be what it is (its scales are still
    checked); a float linear must be ignored (`ignore`: config_ignore_patterns) when a config group
    targets it (inside the decoder layers audit_model finds every float matrix nobody ignored).
    Returns (expected, ignored, problems)."""
    expected = {n: m.linear_scheme() for n, m in model.named_modules() if is_quantized_linear(m)}
    ignored, problems = {}, []
    targets = [t for g in (qconfig.get("config_groups") or {}).values() for t in g.get("targets") or []]
    for name, module in model.named_modules():
        if not is_linear(module):
            continue
        if matches_name(name, ignore) or type(module).__name__ in ignore:  # compressed-tensors allows class names
            ignored[name] = "in quantization_config.ignore"
        elif any(_matches(name, module, t) for t in targets) and not name.startswith(arch.layers + "."):
            problems.append(f"{name}: float, but quantization_config targets it and does not ignore it")
    return expected, ignored, problems


def config_ignore_patterns(qconfig: dict) -> tuple[str, ...]:
    """quantization_config's ignore list (compressed-tensors: names, or `re:` regexes matched from
    the start of the name) and GPTQModel's `-:REGEX` exclusions in `dynamic`, as the ignore
    patterns of calibrate.arch.matches_name (whose regexes match the whole name)."""
    names = [p for p in qconfig.get("ignore") or [] if isinstance(p, str)]
    names += ["re:" + k[2:] for k in qconfig.get("dynamic") or {} if isinstance(k, str) and k.startswith("-:")]
    return tuple(f"re:(?:{p[3:]}).*" if p.startswith("re:") else p for p in names)


def _matches(name: str, module: nn.Module, target: str) -> bool:
    """compressed-tensors' matching: a module name, `re:` + regex (re.match), or a class name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == type(module).__name__
