"""README.md model card beside a checkpoint, written once results.json exists."""
from __future__ import annotations

import json
from pathlib import Path

from lowbit.quantize.audit import headline

from .formats.hf_folder import code_card_rows
from .formats.registry import format_of
from .manifest import MANIFEST, write_manifest, write_text_atomic

CARD = "README.md"


def write_model_card(folder: str | Path, results: dict, name: str | None = None) -> Path:
    """Write README.md from the run's results (and config.json), then refresh the manifest.
    `name` titles the card: the folder's name once published (default: this folder's)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text = render_card(results, config, name or folder.name)
    write_text_atomic(folder / CARD, text)
    if (folder / MANIFEST).is_file():
        write_manifest(folder)  # now also covering results.json and README.md
    return folder / CARD


def render_card(results: dict, config: dict, name: str) -> str:
    """The card for a checkpoint whose config.json holds `config`; its format says how to load it."""
    model, recipe, audit = results.get("model", {}), results.get("recipe", {}), results.get("audit")
    fmt = format_of(config)
    lines = [f"# {name}", "",
             f"`{model.get('id', '?')}` {_what_was_done(audit, results.get('lowbit_version', ''))}: "
             f"recipe **{recipe.get('name', '?')}** — {recipe.get('description', '')}".rstrip(" —"), "",
             "| | |", "|---|---|",
             f"| Base model | `{model.get('id', '?')}` ({model.get('model_type', '?')}, "
             f"{model.get('params', 0) / 1e6:.1f}M parameters) |",
             f"| Scheme | {_scheme(recipe)} |",
             f"| Not quantized | {', '.join(recipe.get('ignore', [])) or 'nothing'} |",
             f"| Format | {fmt.describe(config) if fmt else _unregistered(config)} |",
             *code_card_rows(config, bool(recipe.get("trust_remote_code"))),
             f"| Calibration data | {_calibration(results)} |",
             *_quality_rows(results.get("quality", {})),
             *_memory_rows(results.get("memory", {})),
             *([f"| Audit | {headline(audit)} (the run's audit; `lowbit audit` of this folder repeats it on the files) |"] if audit else []),
             "", "## Loading", "", *(fmt.loading(config) if fmt else _PLAIN_LOADING), "",
             f"`results.json` holds every figure with its protocol; `recipe.yaml` the resolved recipe; "
             f"`{MANIFEST}` every file's size and sha256.", ""]
    return "\n".join(lines)


def _what_was_done(audit: dict | None, version: str) -> str:
    """"quantized with lowbit", or, for a float export (no quantized weight in the file), that it is not."""
    note = (audit or {}).get("float_export")
    return f"**not quantized**, written by lowbit {version} as {note}" if note else f"quantized with lowbit {version}"


def _scheme(recipe: dict) -> str:
    steps = recipe.get("steps") or []
    parts = []
    for step in steps:
        for name, options in step.items():
            opts = ", ".join(f"{k}={v}" for k, v in _flat(options or {}).items() if v is not None)
            parts.append(f"{name} ({opts})" if opts else name)
    return "; ".join(parts) or "none (float export)"


def _flat(options: dict) -> dict:
    """A step's options with its weight grid's (a nested `scheme`) inlined, in order."""
    out = {}
    for key, value in options.items():
        out.update(value if isinstance(value, dict) else {key: value})
    if isinstance(out.get("types"), dict):  # a GGUF plan's per-linear types: counted, not listed
        out["types"] = _type_counts(out["types"])
    return out


def _type_counts(types: dict) -> str | None:
    if not types:
        return None
    counts: dict[str, int] = {}
    for kind in types.values():
        counts[kind] = counts.get(kind, 0) + 1
    return "per linear: " + " ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))


def _unregistered(config: dict) -> str:
    """A config no registered format detects: a float checkpoint, or another tool's quant_method."""
    return (config.get("quantization_config") or {}).get("quant_method") or "float safetensors"


_PLAIN_LOADING = ["`AutoModelForCausalLM.from_pretrained(path)` (transformers)."]


def _calibration(results: dict) -> str:
    cal = results.get("recipe", {}).get("calibration", {})
    used = results.get("timing", {}).get("calibrate_s", 0) > 0
    if not used:
        return "none used (the steps need no data)"
    return f"{cal.get('samples', '?')} samples × {cal.get('seq_len', '?')} tokens of `{cal.get('dataset', '?')}`"


def _quality_rows(q: dict) -> list[str]:
    if q.get("perplexity") is None:
        return []
    base = q.get("baseline_perplexity")
    protocol = q.get("protocol", {})
    where = f"`{q.get('dataset', '?')}`, {protocol.get('tokens_scored', '?')} tokens, context {protocol.get('context_len', '?')}"
    rows = [f"| Perplexity | {q['perplexity']:.3f} ({where}) |"]
    if base:
        rows.append(f"| Baseline perplexity | {base:.3f} (unquantized; {100 * (q['perplexity'] / base - 1):+.2f}%) |")
    return rows


def _memory_rows(m: dict) -> list[str]:
    if not m.get("weight_bytes"):
        return []
    row = f"| Weights | {m['weight_bytes'] / 2**20:.1f} MiB"
    if m.get("baseline_weight_bytes"):
        row += f" (16-bit baseline {m['baseline_weight_bytes'] / 2**20:.1f} MiB, " \
               f"{m['weight_bytes'] / m['baseline_weight_bytes']:.2f}×)"
    return [row + " |"]
