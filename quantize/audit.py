"""Coverage audit: every targeted linear quantized as its scheme says, with usable scales.

A pure check over a model and what it should hold (`LinearScheme` per targeted linear, the KV
config): it reads modules and tensors and changes nothing. Problems name the module and what is
wrong; linears left float are listed with the reason, so none is skipped silently. Which
linears a recipe targets and with what scheme is the caller's knowledge (app/audit.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from lowbit.calibrate.arch import Arch, arch_for, is_linear
from lowbit.quantize.audit_matrices import MatrixCount, count_matrices
from lowbit.quantize.grids.kv import KVCacheConfig
from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.runtime.checks import scale_problems
from lowbit.quantize.runtime.kv_cache import SCALE_NAMES, attention_modules
from lowbit.quantize.runtime.modules import is_quantized_linear

MAX_LISTED = 10  # problems quoted in the error message; the report keeps all of them


class AuditError(ValueError):
    """A quantized model that does not hold what its recipe asked for."""


def describe_module(module: nn.Module) -> str:
    return module.linear_scheme().describe() if is_quantized_linear(module) else f"float {type(module).__name__}"


def held(module: nn.Module) -> str:
    """What a checked linear holds, as the summary counts it: its scheme, or float."""
    return module.linear_scheme().describe() if is_quantized_linear(module) else "float"


@dataclass
class AuditReport:
    checked: dict[str, str] = field(default_factory=dict)  # targeted linear -> its expected scheme
    off_plan: dict[str, str] = field(default_factory=dict)  # checked linear holding something else -> what
    ignored: dict[str, str] = field(default_factory=dict)  # linear left float -> why
    problems: list[str] = field(default_factory=list)  # "<module>: <what is wrong>"
    damping: list[str] = field(default_factory=list)  # layers whose Hessian needed extra damping
    fallbacks: list[str] = field(default_factory=list)  # experts solved without their own statistics
    kv: Optional[str] = None  # the KV-cache scheme checked, if any
    matrices: MatrixCount = field(default_factory=MatrixCount)  # decoder-layer matrix parameters
    integrity: Optional[str] = None  # a written checkpoint's files against manifest.json
    float_export: Optional[str] = None  # a checkpoint written unquantized on purpose: what its recipe asked

    @property
    def passed(self) -> bool:
        return not self.problems

    def counts(self) -> dict[str, int]:
        """The checked linears that hold their expected scheme, per scheme (off_plan: the others)."""
        return dict(sorted(Counter(s for n, s in self.checked.items() if n not in self.off_plan).items()))

    def to_dict(self) -> dict:
        share = self.matrices.share
        out = {"passed": self.passed, "checked": len(self.checked), "schemes": self.counts(),
               "ignored": dict(self.ignored), "kv_cache": self.kv, "problems": list(self.problems),
               "damping": list(self.damping), "quantized_share": None if share is None else round(share, 6),
               "decoder_matrix_params": {"quantized": self.matrices.quantized, "float": self.matrices.float}}
        extra = {"off_plan": dict(self.off_plan), "expert_fallbacks": list(self.fallbacks),
                 "float_export": self.float_export, "integrity": self.integrity}
        return {**out, **{k: v for k, v in extra.items() if v}}  # said where there is something to say

    def headline(self) -> str:
        return headline(self.to_dict())

    def lines(self) -> list[str]:
        return report_lines(self.to_dict())

    def raise_if_failed(self) -> None:
        if self.passed:
            return
        listed = "\n".join(f"  - {p}" for p in self.problems[:MAX_LISTED])
        more = f"\n  … and {len(self.problems) - MAX_LISTED} more" if len(self.problems) > MAX_LISTED else ""
        raise AuditError(f"coverage audit failed: {len(self.problems)} problem(s) in "
                         f"{len(self.checked)} checked linears:\n{listed}{more}")


def headline(audit: dict) -> str:
    """The audit's verdict in one line, from AuditReport.to_dict() (results.json's `audit`): what a run
    prints, `lowbit audit` prints and the model card quotes, so the three cannot disagree."""
    verdict = "passed" if audit["passed"] else f"FAILED ({len(audit['problems'])} problems)"
    if audit.get("float_export"):  # no share or count of quantized linears: the file holds none
        return f"{'not quantized' if audit['passed'] else verdict}: {audit['float_export']}"
    share = audit.get("quantized_share")
    quantized = "" if share is None else f", {100 * share:.1f}% of decoder-layer matrix parameters quantized"
    kv = f", KV cache {audit['kv_cache']}" if audit.get("kv_cache") else ""
    return f"{verdict}: {audit['checked']} linears checked{quantized}, {len(audit['ignored'])} left float{kv}"


def report_lines(audit: dict) -> list[str]:
    """A readable summary from AuditReport.to_dict(): integrity, what the checked linears hold (one
    line), each float linear, damping note, fallback and problem."""
    out = [f"integrity {audit['integrity']}"] if audit.get("integrity") else []
    out += [f"linears   {held_line(audit)}"] if audit["checked"] else []
    out += [f"float     {name}: {why}" for name, why in audit["ignored"].items()]
    out += [f"damping   {note}" for note in audit["damping"]]
    out += [f"fallback  {note}" for note in audit.get("expert_fallbacks", [])]
    out += [f"PROBLEM   {p}" for p in audit["problems"]]
    return out


def held_line(audit: dict, listed: int = 3) -> str:
    """What the checked linears hold, counted as found: '55 int4 sym group 64, 1 float (FAILED:
    model.layers.0.mlp.experts.3.up_proj)'; each kind held against the plan names its linears."""
    parts = [f"{n} {scheme}" for scheme, n in audit.get("schemes", {}).items()]
    off: dict[str, list[str]] = {}
    for name, kind in (audit.get("off_plan") or {}).items():
        off.setdefault(kind, []).append(name)
    for kind, names in sorted(off.items()):
        more = f" and {len(names) - listed} more" if len(names) > listed else ""
        parts.append(f"{len(names)} {kind} (FAILED: {', '.join(names[:listed])}{more})")
    return ", ".join(parts)


def audit_model(model: nn.Module, expected: dict[str, LinearScheme], ignored: dict[str, str],
                kv: Optional[KVCacheConfig] = None, arch: Optional[Arch] = None,
                storage_dtype: Optional[torch.dtype] = None, damping: tuple[str, ...] = (),
                ignore: tuple[str, ...] = ()) -> AuditReport:
    """Check `model` against `expected` (name -> scheme) and `kv`.

    ignored: linears meant to stay float, with the reason; ignore: the recipe's (or config's)
    patterns of modules and tensors meant to. Any other float matrix inside a decoder layer is a
    problem (audit_matrices.py); a float linear outside them is added to the report's ignored list
    as not targeted; a quantized one nobody asked for is a problem.
    storage_dtype: the dtype scales are written in; a scale that becomes 0 or inf there fails.
    """
    arch = arch or arch_for(model)
    report = AuditReport(ignored=dict(ignored), damping=list(damping))
    for name, scheme in expected.items():
        report.checked[name] = scheme.describe()
        try:
            module = model.get_submodule(name)
        except AttributeError:
            report.off_plan[name] = "missing"
            report.problems.append(f"{name}: no such module in the model")
            continue
        if not (is_quantized_linear(module) and module.holds(scheme)):
            report.off_plan[name] = held(module)
        report.problems += check_linear(name, module, scheme, storage_dtype)
    for name, module in model.named_modules():
        if name in expected or not (is_linear(module) or is_quantized_linear(module)):
            continue
        if is_quantized_linear(module):
            why = f"(listed as ignored: {ignored[name]})" if name in ignored else "but no step targets it"
            report.problems.append(f"{name}: quantized ({describe_module(module)}) {why}")
        elif name not in report.ignored and not name.startswith(arch.layers + "."):  # inside: counted below
            report.ignored[name] = "not targeted: not one of the architecture table's decoder-layer linears"
    report.matrices, float_matrices = count_matrices(model, arch, ignored, ignore, checked=expected)
    report.ignored.update(report.matrices.kept)
    report.problems += float_matrices
    if kv is not None or getattr(model, "lowbit_kv_cache", None) is not None:
        report.kv, kv_problems = check_kv(model, kv, arch)
        report.problems += kv_problems
    return report


def check_linear(name: str, module: nn.Module, scheme: LinearScheme,
                 storage_dtype: Optional[torch.dtype] = None) -> list[str]:
    """The module's own checks (it knows its format's tensors) once it holds the grid asked for."""
    if not is_quantized_linear(module):
        return [f"{name}: is {describe_module(module)}, the recipe asks for {scheme.describe()}"]
    if not module.holds(scheme):
        return [f"{name}: quantized as {describe_module(module)}, the recipe asks for {scheme.describe()}"]
    return module.audit(name, storage_dtype)


def check_kv(model: nn.Module, kv: Optional[KVCacheConfig], arch: Optional[Arch]) -> tuple[str, list[str]]:
    """(description, problems) of the KV-cache scales on every attention layer."""
    have = getattr(model, "lowbit_kv_cache", None)
    if kv is None:
        return f"{have.format} {have.strategy}", [f"model: KV cache quantized ({have}) but no step asks for it"]
    described = f"{kv.format} {kv.strategy}"
    if have is None:
        return described, [f"model: no quantized KV cache attached, the recipe asks for {kv}"]
    if have != kv:
        return described, [f"model: KV cache config is {have}, the recipe asks for {kv}"]
    if not kv.static:
        return described, []  # per-token scales are computed at run time: nothing stored
    names = {id(m): n for n, m in model.named_modules()}
    text = model.config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    size = 1 if kv.strategy == "tensor" else heads
    problems = []
    for attn in attention_modules(model, arch or arch_for(model)):
        for attr in SCALE_NAMES:
            label = f"{names[id(attn)]}.{attr}"
            value = getattr(attn, attr, None)
            if not isinstance(value, torch.Tensor):
                problems.append(f"{label}: missing (the KV cache needs a calibrated scale per layer)")
                continue
            if size is not None and value.numel() != size:
                problems.append(f"{label}: {value.numel()} values, strategy {kv.strategy} needs {size}")
            problems += scale_problems(label, value)
    return described, problems


def fallback_notes(steps: list[dict]) -> list[str]:
    """Experts a step solved without their own calibration statistics (too few tokens reached them),
    from the steps' layer records (`expert_fallbacks`)."""
    return [f"{name}: {why}" for step in steps for layer in layer_records(step)
            for name, why in (layer.get("expert_fallbacks") or {}).items()]


def layer_records(step: dict) -> list[dict]:
    """A layer walk's per-layer records in a step's results (other steps keep other things under
    "layers": a count, names)."""
    layers = step.get("layers")
    return [r for r in layers if isinstance(r, dict)] if isinstance(layers, list) else []


def damping_notes(steps: list[dict]) -> list[str]:
    """Layers whose Hessian needed more damping than asked, from the steps' results (GPTQ's
    `damping_retries`)."""
    return [f"{r['linear']}: Hessian needed extra damping (dampening_frac {r['dampening_frac']:g})"
            for step in steps for r in step.get("damping_retries") or []]
