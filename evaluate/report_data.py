"""Flatten results.json files into comparable rows: each lowbit run, the unquantized baseline
and any bitsandbytes baselines; the Pareto front; per-layer errors where a step recorded them."""
from __future__ import annotations

import re

import json
from pathlib import Path
from typing import Optional

ERROR_KEYS = ("error", "rel_error", "relative_error", "mse", "loss", "err")  # first one found is used


def load_runs(paths) -> list[dict]:
    """results.json of each run folder (or the file itself), in the given order."""
    runs = []
    for p in map(Path, paths):
        file = p / "results.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"{p}: no results.json (pass run folders written by `lowbit run`)")
        try:
            runs.append(json.loads(file.read_text()))
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}: not valid JSON ({err.msg})") from None
    return runs


def _get(d, *path, default=None):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def _speed(section: Optional[dict], who: str) -> dict:
    """Batch-1 figures and the larger batch's decode rate of one model in a speed section."""
    rows = _get(section, who) or {}
    if not rows:
        return {}
    batches = sorted(rows, key=int)
    first, last = rows[batches[0]], rows[batches[-1]]
    out = {k: first.get(k) for k in ("prefill_tok_s", "ttft_s", "tpot_s", "decode_tok_s", "achieved_gbs",
                                     "roofline_decode_tok_s")}
    out["speed_batch"], out["bandwidth_gbs"] = int(batches[0]), section.get("bandwidth_gbs")
    out["kernels"] = _get(section, "backends", who) or {}  # what its quantized linears ran, counted
    out["cpu"] = section.get("cpu")
    gpu = _get(section, "cuda", who) or {}
    if gpu:  # GPU figures beside the CPU ones when the run had a GPU
        out["gpu_decode_tok_s"] = gpu[sorted(gpu, key=int)[0]].get("decode_tok_s")
    if len(batches) > 1:
        out.update(big_batch=int(batches[-1]), big_batch_decode_tok_s=last.get("decode_tok_s"))
    return out


def _row(label, kind, model, ppl, base_ppl, quality, memory, speed, extra=None) -> dict:
    kl = _get(quality, "kl") or {}
    row = {"label": label, "kind": kind, "model": model, "perplexity": ppl, "baseline_perplexity": base_ppl,
           "ppl_increase_pct": 100 * (ppl / base_ppl - 1) if ppl and base_ppl else None,
           "kl_mean": kl.get("kl_mean"), "kl_p99": kl.get("kl_p99"), "top1_agreement": kl.get("top1_agreement"),
           "weight_bytes": _get(memory, "weight_bytes"), "predicted_total": _get(memory, "predicted", "total"),
           "predicted": _get(memory, "predicted") or {}, "measured_peak": _get(memory, "measured_peak") or {},
           "model_max_context": _get(memory, "model_max_context"),
           "fit": _get(memory, "fit") or [], "lm_eval": _get(quality, "lm_eval") or {}, **speed}
    return {**row, **(extra or {})}


def baseline_label(run: dict) -> str:
    """What the baseline row is: its quality and speed come from the model as it ran (float32
    weights on the CPU unless recorded otherwise), its bytes from a 16-bit checkpoint."""
    dtype = _get(run, "model", "dtype")
    ran = f"{dtype} weights" if dtype else "weights as loaded"
    return f"unquantized ({ran}; bytes as 16-bit)"


def rows_for(runs: list[dict], labels: Optional[list[str]] = None) -> tuple[list[dict], list[str]]:
    """(rows, notes): one row per run, plus baseline and bnb rows once per model."""
    rows, notes, seen = [], [], set()
    for i, r in enumerate(runs):
        model = _get(r, "model", "id", default="?")
        label = labels[i] if labels else _get(r, "recipe", "name", default=f"run{i}")
        q, m = r.get("quality", {}), r.get("memory", {})
        base_ppl = q.get("baseline_perplexity")
        rows.append(_row(label, "plan" if is_plan(r) else "lowbit", model, q.get("perplexity"), base_ppl, q, m,
                         _speed(r.get("speed"), "model"), {"steps": r.get("steps", []), **plan_figures(r),
                                                           **unquantized_memory(m)}))
        if base_ppl and ("baseline", model) not in seen:
            seen.add(("baseline", model))
            base_mem = {"weight_bytes": m.get("baseline_weight_bytes"), "predicted": m.get("baseline_predicted"),
                        "fit": m.get("baseline_fit"), "model_max_context": m.get("model_max_context")}
            base_q = {"kl": {"kl_mean": 0.0, "kl_p99": 0.0, "top1_agreement": 1.0} if "kl" in q else None,
                      "lm_eval": q.get("baseline_lm_eval")}
            rows.append(_row(baseline_label(r), "baseline", model, base_ppl, base_ppl, base_q, base_mem,
                             _speed(r.get("speed"), "baseline")))
        for name, b in (r.get("baselines") or {}).items():
            if (name, model) in seen:
                continue
            seen.add((name, model))
            if "unavailable" in b:
                notes.append(f"{name} on {model}: unavailable: {b['unavailable']}")
                continue
            bq = b.get("quality", {})
            rows.append(_row(name, "bnb", model, bq.get("perplexity"), base_ppl, bq, b.get("memory", {}),
                             _speed(b.get("speed"), "model")))
    if len({r["model"] for r in rows}) > 1:
        for row in rows:
            row["label"] = f"{row['label']} [{row['model']}]"
    return rows, notes


def unquantized_memory(memory: dict) -> dict:
    """The unquantized model's weight bytes and fit table, beside the run's own (for the verdict)."""
    return {"baseline_weight_bytes": memory.get("baseline_weight_bytes"), "baseline_fit": memory.get("baseline_fit")}


PLAN_MARK = "lowbit fit:"  # how a plan's recipe description begins (app/fit_plan.py)


def is_plan(run: dict) -> bool:
    return str(_get(run, "recipe", "description", default="")).startswith(PLAN_MARK)


def plan_figures(run: dict) -> dict:
    """A plan's formats (how many linears each), KV format and predictions, from its recipe."""
    if not is_plan(run):
        return {}
    recipe = run["recipe"]
    formats = (recipe.get("scheme") or {}).get("formats") or (recipe.get("scheme") or {}).get("types") or {}
    counts: dict[str, int] = {}
    for kind in formats.values():
        counts[kind] = counts.get(kind, 0) + 1
    kv = next((s["kv_cache"]["format"] for s in recipe.get("steps", []) if "kv_cache" in s), "f16")
    description = recipe["description"]
    predicted_kl = re.search(r"predicted summed KL ([0-9.e+-]+)", description)
    predicted_mib = re.search(r"predicted memory ([0-9.]+) MiB of ([0-9.]+) MiB", description)
    return {"plan_formats": counts, "plan_kv": kv,
            "plan_predicted_kl": float(predicted_kl.group(1)) if predicted_kl else None,
            "plan_predicted_mib": float(predicted_mib.group(1)) if predicted_mib else None,
            "plan_budget_mib": float(predicted_mib.group(2)) if predicted_mib else None}


def loss_of(row: dict) -> Optional[float]:
    """Quality loss for plots: perplexity increase in %, else mean KL."""
    return row["ppl_increase_pct"] if row["ppl_increase_pct"] is not None else row["kl_mean"]


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats on both coordinates (both minimised)."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(ox <= x and oy <= y and (ox < x or oy < y) for j, (ox, oy) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return front


def layer_errors(steps: list[dict]) -> dict[str, list[tuple[str, float]]]:
    """{step name: [(layer, error)]} from steps that recorded per-layer errors under "layers"
    (a mapping layer -> number or -> {error-like key: number}, or a list of such records)."""
    out = {}
    for i, step in enumerate(steps or []):
        layers = step.get("layers")
        items = layers.items() if isinstance(layers, dict) else (
            ((rec.get("name", rec.get("layer", str(j))), rec) for j, rec in enumerate(layers))
            if isinstance(layers, list) else ())
        pairs = [(str(name), v) for name, rec in _per_linear(items) if (v := _error_value(rec)) is not None]
        if pairs:
            out[f"{step.get('name', 'step')}#{i}"] = pairs
    return out


def _per_linear(items):
    """(name, record) pairs, a layer record that holds per-linear ones ({"linears": {name: {...}}},
    as GPTQ writes) expanded into those."""
    for name, rec in items:
        if isinstance(rec, dict) and isinstance(rec.get("linears"), dict):
            yield from rec["linears"].items()
        else:
            yield name, rec


def _error_value(rec) -> Optional[float]:
    if isinstance(rec, (int, float)) and not isinstance(rec, bool):
        return float(rec)
    if isinstance(rec, dict):
        for key in ERROR_KEYS:
            if isinstance(rec.get(key), (int, float)):
                return float(rec[key])
    return None
