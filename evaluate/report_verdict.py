"""The report's opening verdict, one line per quantized run: how much smaller its weights are than
the unquantized model's, how much quality it kept (and which figures were not measured), and
which memory budgets hold it at the context the model was trained for."""
from __future__ import annotations

from typing import Optional

MIB = 2**20


def verdict_lines(rows: list[dict]) -> list[str]:
    """A bullet per lowbit run or fit plan (baseline and bitsandbytes rows are what they are compared with)."""
    return [f"- {row['label']}: {run_verdict(row)}" for row in rows if row["kind"] in ("lowbit", "plan")]


def run_verdict(row: dict) -> str:
    return " ".join([size_phrase(row), quality_phrase(row), fit_phrase(row)])


def size_phrase(row: dict) -> str:
    ours, theirs = row.get("weight_bytes"), row.get("baseline_weight_bytes")
    if not ours:
        return "Weight size not recorded."
    if not theirs:
        return f"Weights {ours / MIB:.1f} MiB (no unquantized size to compare with)."
    change = f"{theirs / ours:.2f}x smaller" if ours <= theirs else f"{ours / theirs:.2f}x larger"
    return f"{change} weights ({theirs / MIB:.1f} -> {ours / MIB:.1f} MiB)."


def quality_phrase(row: dict) -> str:
    kept, missing = [], []
    ppl, base = row.get("perplexity"), row.get("baseline_perplexity")
    if ppl is not None and base:
        kept.append(f"perplexity {base:.2f} -> {ppl:.2f} ({row['ppl_increase_pct']:+.2f}%)")
    elif ppl is not None:
        kept.append(f"perplexity {ppl:.2f}")
        missing.append("the unquantized perplexity")
    else:
        missing.append("perplexity")
    for key, name, spec in (("kl_mean", "mean KL", ".3g"), ("top1_agreement", "top-1 agreement", ".1%")):
        if row.get(key) is None:
            missing.append(name)
        else:
            kept.append(f"{name} {format(row[key], spec)}" + (" nats" if key == "kl_mean" else ""))
    text = f"Quality: {', '.join(kept)}." if kept else ""
    return (text + f" Not measured: {', '.join(missing)}.").strip() if missing else text


def fit_phrase(row: dict) -> str:
    """Which budgets hold one sequence of the trained context (longer ones fit in memory only, so
    they are not claimed), beside the unquantized model's where that differs."""
    trained = row.get("model_max_context")
    ours = fit_summary(row.get("fit") or [], trained)
    if ours is None:
        return "What fits: not recorded."
    theirs = fit_summary(row.get("baseline_fit") or [], trained)
    unquantized = f" (unquantized: {theirs})" if theirs and theirs != ours else ""
    unknown = "" if trained else " The trained context is not recorded, so contexts are not capped."
    return f"Fits: {ours}{unquantized}.{unknown}"


def fit_summary(fit: list[dict], trained: Optional[int]) -> Optional[str]:
    """E.g. "8, 24 and 80 GiB at the full trained context (2,048 tokens)"; None without a fit table."""
    if not fit:
        return None
    whole, part, none = [], [], []
    for entry in sorted(fit, key=lambda f: f["budget_gib"]):
        gib, longest = f"{entry['budget_gib']:g}", entry["max_context"]
        if not longest:
            none.append(gib)
        elif trained and longest >= trained:
            whole.append(gib)
        else:
            part.append(f"{gib} GiB up to {longest:,}" + (f" of {trained:,} trained tokens" if trained else " tokens"))
    phrases = [f"{_and(whole)} GiB at the full trained context ({trained:,} tokens)"] if whole else []
    phrases += part + ([f"not in {_and(none)} GiB"] if none else [])
    return "; ".join(phrases)


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
