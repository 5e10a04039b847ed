"""The schema of results.json: what `lowbit run` and `lowbit eval` write, field by field.

Both commands build one `Results` through evaluate.evaluation.evaluate(); a run then fills in the
sections only a run knows (recipe, timing, steps, audit). Sections a measurement did not run for
(KL off, no lm-eval tasks, speed off, no bitsandbytes baselines, peak not measured) are left out
of the file rather than written as null, as they always were; every other field is always there.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional


def plain(obj):
    """Dataclasses, tuples and dicts as JSON-ready data (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def _without_unmeasured(section, optional: tuple[str, ...]) -> dict:
    out = plain(section)
    return {k: v for k, v in out.items() if not (k in optional and v is None)}


@dataclass(frozen=True)
class ModelInfo:
    id: str  # what was evaluated: the run's model, or the folder/name given to `lowbit eval`
    model_type: str  # config.json's model_type
    dtype: str  # the dtype the (unquantized) model's quality and speed ran in, e.g. "float32"
    reference: Optional[str] = None  # the unquantized model compared against (KL, baseline); None: none
    params: Optional[int] = None  # unique parameters of the unquantized model (run only: it was loaded)
    # a mixture of experts: those one token runs through (its router's top-k experts of each layer)
    active_params_per_token: Optional[int] = None


@dataclass(frozen=True)
class Quality:
    perplexity: float  # of the evaluated model, under `protocol`
    baseline_perplexity: Optional[float]  # of the reference, same protocol (cached); None: none or off
    dataset: str  # the corpus whose evaluation part was scored
    protocol: dict  # the pinned options (context_len, stride, max_tokens, bos) + what was counted
    kl: Optional[dict] = None  # KL(reference || model), top-1 agreement; when enabled and a reference exists
    lm_eval: Optional[dict] = None  # lm-eval task scores; when tasks are asked for
    baseline_lm_eval: Optional[dict] = None  # the reference's scores on the same tasks (cached)
    # evaluate.held_out: per text, its perplexity, the baseline's and KL (as enabled), same protocol
    held_out: Optional[dict] = None

    def to_dict(self) -> dict:
        return _without_unmeasured(self, ("kl", "lm_eval", "baseline_lm_eval", "held_out"))


@dataclass(frozen=True)
class Memory:
    weight_bytes: int  # every tensor of the evaluated weights (checkpoint files, or 16-bit for a plain model)
    baseline_weight_bytes: Optional[int]  # the reference as a 16-bit checkpoint; None: no reference
    predicted: dict  # weights + KV cache + activations at evaluate.memory's batch x context
    fit: list  # per budget: longest single context, most sequences at fit_context
    model_max_context: Optional[int]  # config's max_position_embeddings
    measured_peak: Optional[dict] = None  # one prefill's measured peak; when memory.measure_peak
    baseline_predicted: Optional[dict] = None  # `predicted` for the reference (16-bit weights and KV)
    baseline_fit: Optional[list] = None  # `fit` for the reference

    def to_dict(self) -> dict:
        return _without_unmeasured(self, ("measured_peak", "baseline_predicted", "baseline_fit"))


@dataclass(frozen=True)
class Results:
    lowbit_version: str
    model: ModelInfo
    hardware: dict  # cpu_info() of the machine that measured: ISA, bf16, cores
    recipe: dict  # run: the resolved recipe; eval: {"name": "eval TARGET", "evaluate": options}
    quality: Quality
    memory: Memory
    timing: dict = field(default_factory=dict)  # run: load_s, calibrate_s, quantize_s, export_s, evaluate_s
    steps: list = field(default_factory=list)  # run: what each step did (per layer); eval: []
    audit: Optional[dict] = None  # run: the coverage audit before export; eval: None
    speed: Optional[dict] = None  # prefill/decode timings; when evaluate.speed.enabled
    baselines: Optional[dict] = None  # bitsandbytes rows; when evaluate.bnb_baselines
    # when and where: date, lowbit's commit (a git checkout only), CPU and GPU (calibrate/provenance.py)
    measured: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out.update(quality=self.quality.to_dict(), memory=self.memory.to_dict())
        return {k: v for k, v in out.items() if not (k in ("speed", "baselines") and v is None)}
