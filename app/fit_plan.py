"""Fit a budget: one format per decoder-layer linear and one KV-cache format, chosen together from
measured sensitivity for the least summed loss within the budget.

The budget is bits per weight over the decoder-layer linears, or a device's memory at a context
length and batch. A memory budget first takes off the tensors outside the linears, the prefill
workspace (in chunks of `prefill_chunk` tokens) and the KV cache; the KV formats are enumerated
(a handful) and for each the linears get an exact knapsack solve on the bytes left, so the pair
returned is optimal over both (up to the solver's stated slack). Sensitivities
(evaluate/sensitivity.py) are cached per model, calibration text and candidates, so a second
budget costs only the solves.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field

import torch

from lowbit.calibrate.arch import arch_for, linear_weight, target_linears
from lowbit.calibrate.cache import cache_dir
from lowbit.calibrate.data import calibration_batches
from lowbit.evaluate import sensitivity
from lowbit.evaluate.allocation import Plan, allocate, smallest_bytes
from lowbit.evaluate.memory import ModelShape
from lowbit.export.manifest import write_text_atomic
from lowbit.quantize.grids.gguf_plan import F16, GGUFTypes, embedding_type, output_type
from lowbit.recipes.fit_config import FitConfig, parse_size

from .fit_checks import check_bits_budget, check_memory_budget, kv_entry, kv_kinds

BASE_FILE_TYPE = "q4_k_m"  # the GGUF file type whose rules give the embedding and output their types
CACHE_VERSION = "kl-v2"  # bump when the measurement changes


@dataclass
class FitResult:
    plan: Plan  # the linears' formats
    kv: str  # the KV format (f16: a 16-bit cache)
    kv_loss: float
    params: int  # weights in the decoder-layer linears
    split: dict = field(default_factory=dict)  # how a memory budget was spent
    cached: bool = False  # sensitivities came from the cache
    tried: list = field(default_factory=list)  # per KV format: its linears' budget and total loss

    @property
    def loss(self) -> float:
        return self.plan.loss + self.kv_loss

    def summary(self) -> dict:
        counts: dict[str, int] = {}
        for option in self.plan.choice.values():
            counts[option.kind] = counts.get(option.kind, 0) + 1
        return {"linears": len(self.plan.choice), "params": self.params, "budget_bytes": self.plan.budget,
                "plan_bytes": self.plan.bytes, "bits_per_weight": self.plan.bytes * 8 / self.params,
                "predicted_kl_sum": self.loss, "predicted_kl_weights": self.plan.loss, "kv_format": self.kv,
                "predicted_kl_kv": self.kv_loss, "solver_slack_bytes": self.plan.slack, "type_counts": counts,
                "sensitivities_cached": self.cached,
                **({"memory_split": self.split, "kv_formats_tried": self.tried} if self.split else {})}


def fit(model, tokenizer, name: str, cfg: FitConfig) -> FitResult:
    """Check the budget can be met, then measure (or read from the cache) and solve: the plan of
    least summed loss in the budget."""
    arch = arch_for(model)
    options = sensitivity.linear_options(model, arch, cfg.weight_candidates)
    params = sum(linear_weight(m).numel() for m in target_linears(model, arch).values())
    if not params:
        raise ValueError(f"{name}: no decoder-layer linears to plan formats for")
    kinds = kv_kinds(model, cfg)
    if cfg.bits_per_weight is not None:
        check_bits_budget(cfg.bits_per_weight, options, params)
    else:  # nothing is measured for a budget that cannot hold the cheapest plan
        check_memory_budget(model, cfg, options, params, kinds, _memory_split(model, cfg, min(_chunks(cfg))))
    measured, cached = _sensitivities(model, arch, tokenizer, name, cfg, options, kinds)
    choices = {n: [sensitivity.Option(k, b, measured["linears"][n][k]) for k, b in by_kind.items()]
               for n, by_kind in options.items()}
    if cfg.bits_per_weight is not None:
        plan = allocate(choices, int(cfg.bits_per_weight * params / 8))
        return FitResult(plan, F16, 0.0, params, cached=cached)
    return _fit_memory(model, cfg, choices, measured["kv"], params, cached)


AUTO_CHUNKS = (512, 256, 128)


def _chunks(cfg: FitConfig) -> tuple[int, ...]:
    return (cfg.prefill_chunk,) if cfg.prefill_chunk else AUTO_CHUNKS


def _memory_split(model, cfg: FitConfig, chunk: int) -> dict:
    """A memory budget's parts that do not depend on the KV format or the linears' plan."""
    return {"memory": parse_size(cfg.memory), "context": cfg.context, "batch": cfg.batch, "prefill_chunk": chunk,
            "overhead": parse_size(cfg.overhead), "other_weights": _other_weight_bytes(model, cfg.format)}


def _fit_memory(model, cfg: FitConfig, choices, kv_losses: dict, params: int, cached: bool) -> FitResult:
    """The least-loss pair (linears' plan, KV format) at the largest prefill chunk where one fits."""
    shape = ModelShape.from_config(model.config)
    floor = smallest_bytes(choices)
    for chunk in _chunks(cfg):
        split = _memory_split(model, cfg, chunk)
        best, tried = None, []
        for kind, per_element in kv_losses["bytes_per_element"].items():
            entry = kv_entry(shape, cfg, split, kind, per_element)
            tried.append(entry)
            kv, work, left = entry["kv_cache_bytes"], entry["workspace"], entry["linears_budget"]
            if left < floor:
                continue
            plan = allocate(choices, left)
            entry["predicted_kl_sum"] = plan.loss + kv_losses["loss"][kind]
            if best is None or entry["predicted_kl_sum"] < best[0]:
                best = (entry["predicted_kl_sum"], plan, kind, kv, work)
        if best is not None:
            _, plan, kind, kv, work = best
            return FitResult(plan, kind, kv_losses["loss"][kind], params,
                             {**split, "kv_cache": kv, "workspace": work}, cached, tried)
    # check_memory_budget refused a budget where this happens, before measuring
    raise ValueError(f"memory {cfg.memory}: nothing fits beside the smallest KV cache and workspace")


def _sensitivities(model, arch, tokenizer, name: str, cfg: FitConfig, options,
                   kv_candidates: list[str]) -> tuple[dict, bool]:
    """{"linears": {linear: {format: KL}}, "kv": {"loss": {format: KL}, "bytes_per_element": ..}},
    each part from the cache or measured and cached (the linears' and the KV formats' apart, so
    that a memory budget after a bits-per-weight one measures only the KV formats); and whether
    nothing had to be measured."""
    batches = None
    measured, cached = {}, True
    for part, key_of in (("linears", options), ("kv", kv_candidates)):
        path = cache_dir("sensitivity") / f"{_cache_key(model, name, cfg.calibration, part, key_of)}.json"
        if path.is_file():
            print(f"[lowbit] fit: {part} sensitivities from the cache ({path})", file=sys.stderr)
            measured[part] = json.loads(path.read_text())["measured"]
            continue
        cached = False
        batches = calibration_batches(cfg.calibration, tokenizer) if batches is None else batches
        if part == "linears":
            measured[part] = sensitivity.measure(model, arch, batches, options)
        else:
            measured[part] = {"loss": sensitivity.measure_kv(model, batches, kv_candidates),
                              "bytes_per_element": {k: sensitivity.kv_bytes_per_element(model, k) for k in kv_candidates}}
        write_text_atomic(path, json.dumps({"model": name, "calibration": vars(cfg.calibration), "part": part,
                                            "measured": measured[part]}))
    return measured, cached


def _cache_key(model, name: str, calibration, part: str, candidates) -> str:
    """The model (its config and a checksum of every parameter), the calibration and the candidates."""
    digest = hashlib.sha256()
    digest.update(json.dumps([CACHE_VERSION, part, name, model.config.to_json_string(), vars(calibration),
                              candidates], sort_keys=True, default=str).encode())
    with torch.no_grad():
        for pname, p in model.named_parameters():
            digest.update(f"{pname} {float(p.double().sum())} {float(p.double().abs().sum())}".encode())
    return digest.hexdigest()[:24]


def _other_weight_bytes(model, fmt: str) -> int:
    """The checkpoint's tensors outside the decoder-layer linears. compressed-tensors: 16-bit
    (the embedding, an untied head, norms). GGUF: the token embedding (and an untied output) at
    llama.cpp's types for the base file type, everything else float32."""
    arch = arch_for(model)
    linear_ids = {id(m.weight) for m in target_linears(model, arch).values()}
    if fmt == "compressed-tensors":
        return sum(p.numel() * 2 for p in model.parameters() if id(p) not in linear_ids)  # tied: once
    types = GGUFTypes(BASE_FILE_TYPE)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    total = _typed_bytes(embed, embedding_type(types, embed.shape[1], tied))
    if head is not None and not tied:
        total += _typed_bytes(head.weight, output_type(types, head.weight.shape[1]))
    skip = linear_ids | {id(embed)} | ({id(head.weight)} if head is not None else set())
    return total + sum(p.numel() * 4 for p in model.parameters() if id(p) not in skip)


def _typed_bytes(weight: torch.Tensor, kind) -> int:
    rows, cols = weight.shape
    return sensitivity.type_bytes(kind or F16, rows, cols)


def plan_recipe(fit_cfg: FitConfig, result: FitResult, model: str, step: str = "gptq") -> dict:
    """The plan as a recipe `lowbit run` takes: each linear's format, the KV format, one export."""
    formats = {n: o.kind for n, o in result.plan.choice.items()}
    s = result.summary()
    scheme = ({"gguf": BASE_FILE_TYPE, "types": formats} if fit_cfg.format == "gguf"
              else {"formats": formats, "default": F16})
    # GPTQ as w4a16-gptq runs it (its comments say why each setting)
    steps = [{"rtn": {}} if step == "rtn" else {"gptq": {
        "actorder": "static", "true_sequential": False, "dampening_frac": 0.1, "scale_search": "mse"}}]
    if result.kv != F16:
        steps.append({"kv_cache": {"format": result.kv, "strategy": "token"}})
    recipe = {
        "description": (f"lowbit fit: {s['bits_per_weight']:.3f} bits per weight over the decoder-layer linears, "
                        f"KV cache {result.kv}, predicted summed KL {s['predicted_kl_sum']:.4g}"),
        "model": model,
        "calibration": {"dataset": fit_cfg.dataset},
        "scheme": scheme,
        "steps": steps,
        "export": {"format": fit_cfg.format},
    }
    if fit_cfg.memory and fit_cfg.format == "compressed-tensors":  # measure the budget's own prefill
        split = result.split
        predicted = split["workspace"] + split["overhead"] + split["other_weights"] + split["kv_cache"] + result.plan.bytes
        recipe["description"] += f", predicted memory {predicted / 2**20:.1f} MiB of {split['memory'] / 2**20:.1f} MiB"
        recipe["evaluate"] = {"memory": {
            "batch": fit_cfg.batch, "context": fit_cfg.context, "measure_context": fit_cfg.context,
            "measure_decode_tokens": 16, "prefill_chunk": fit_cfg.prefill_chunk, "lean_runtime": True}}
    return recipe
