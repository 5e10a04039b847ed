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
    the export dtype."""

    def __init__(self, recipe: Recipe, model: nn.Module, arch: Arch):
        self.expected, self.ignored, self.kv = expected_schemes(recipe, model, arch)
        self.arch, self.ignore, self.storage_dtype = arch, recipe.ignore, getattr(torch, recipe.export.dtype)
        self.report = AuditReport()

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
        self.report.checked.update(part.checked)
        self.report.kv = part.kv or self.report.kv
        self.report.ignored.update({n: why for n, why in part.ignored.items() if n not in self.report.ignored})
        self.report.problems += part.problems
        self.report.matrices.add(part.matrices)
        return part

    def __call__(self, model: nn.Module, portion: Portion) -> None:
        self.portion(model, portion).raise_if_failed()


def audit_run(model: nn.Module, recipe: Recipe, arch: Arch, steps: list[dict]) -> AuditReport:
    """The run's audit of a model in memory (one portion: the whole model), not raising."""
    audit = RunAudit(recipe, model, arch).noting(steps)
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
    if not config.get("quantization_config") and not any(is_quantized_linear(m) for m in model.modules()):
        return AuditReport(problems=problems + [f"{folder}: not a quantized checkpoint (no quantized module, "
                                                "no quantization_config in config.json)"], integrity=integrity)
    report = _audit_loaded(folder, model, config)
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


def _audit_loaded(folder: Path, model: nn.Module, config: dict) -> AuditReport:
    """The loaded model against its recipe.yaml, else against its config.json."""
    arch = native_arch(model)
    results = folder / RESULTS_FILE
    steps = json.loads(results.read_text(encoding="utf-8")).get("steps", []) if results.is_file() else []
    recipe_file = folder / RECIPE_FILE
    extra: list[str] = []
    if recipe_file.is_file():
        data = yaml.safe_load(recipe_file.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"{recipe_file}: not a recipe mapping")
        recipe = parse_recipe(data, str(recipe_file))
        expected, ignored, kv = expected_schemes(recipe, model, arch)
        ignore = recipe.ignore
    else:
        qconfig = config.get("quantization_config") or {}
        ignore = config_ignore_patterns(qconfig)
        expected, ignored, extra = schemes_from_config(model, qconfig, arch, ignore)
        saved = config.get(kv_scales.KEY)
        kv = KVCacheConfig.from_file(saved) if saved else None
    report = audit_model(model, expected, ignored, kv, arch, damping=tuple(damping_notes(steps)), ignore=ignore)
    report.fallbacks = fallback_notes(steps)
    report.problems += extra
    return report


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
