"""report.md and a self-contained report.html (plots embedded as base64 PNG) comparing runs."""
from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Optional

from lowbit.export.manifest import write_text_atomic
from lowbit.quantize.audit import layer_records

from .plots import budget_plot, layer_error_plot, tradeoff_plot
from .report_data import rows_for
from .report_verdict import verdict_lines

MIB = 2**20


def _fmt(v, spec=".3g", none="–") -> str:
    if v is None:
        return none
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def summary_table(rows) -> tuple[list[str], list[list[str]]]:
    head = ["scheme", "kind", "perplexity", "ppl +%", "KL mean", "KL p99", "top-1 agree", "weights MiB",
            "predicted total MiB", "decode tok/s (b1)", "prefill tok/s (b1)", "TTFT s", "TPOT ms",
            "decode tok/s (big batch)", "achieved GB/s", "roofline tok/s"]
    body = [[r["label"], r["kind"], _fmt(r["perplexity"], ".4f"), _fmt(r["ppl_increase_pct"], "+.2f"),
             _fmt(r["kl_mean"], ".4f"), _fmt(r["kl_p99"], ".4f"), _fmt(r["top1_agreement"], ".4f"),
             _fmt(r["weight_bytes"] and r["weight_bytes"] / MIB, ".1f"),
             _fmt(r["predicted_total"] and r["predicted_total"] / MIB, ".1f"),
             _fmt(r.get("decode_tok_s"), ".2f"), _fmt(r.get("prefill_tok_s"), ".1f"), _fmt(r.get("ttft_s"), ".3f"),
             _fmt(r.get("tpot_s") and 1000 * r["tpot_s"], ".1f"),
             _fmt(r.get("big_batch_decode_tok_s"), ".2f") + (f" (b{r['big_batch']})" if r.get("big_batch") else ""),
             _fmt(r.get("achieved_gbs"), ".2f"), _fmt(r.get("roofline_decode_tok_s"), ".1f")] for r in rows]
    if any(r.get("gpu_decode_tok_s") for r in rows):
        head.append("GPU decode tok/s (b1)")
        for line, r in zip(body, rows):
            line.append(_fmt(r.get("gpu_decode_tok_s"), ".1f"))
    return head, body


def fit_tables(rows) -> tuple[list[str], list[list[str]]]:
    budgets = sorted({f["budget_gib"] for r in rows for f in r["fit"]})
    ctx = next((f["at_context"] for r in rows for f in r["fit"]), None)
    head = ["scheme"] + [f"{b:g} GiB: max context" for b in budgets] + [f"{b:g} GiB: seqs @ {ctx}" for b in budgets]
    body = []
    for r in rows:
        by = {f["budget_gib"]: f for f in r["fit"]}
        if by:
            body.append([r["label"]] + [_fmt(by.get(b, {}).get("max_context"), ",") for b in budgets]
                        + [_fmt(by.get(b, {}).get("max_sequences"), ",") for b in budgets])
    return head, body


def memory_table(rows) -> tuple[list[str], list[list[str]]]:
    head = ["scheme", "weights MiB", "batch x context", "KV cache MiB", "activations MiB", "predicted total MiB",
            "measured: prefill batch x context + decoded", "loaded model resident MiB", "measured increase MiB",
            "predicted KV+act at measured size MiB", "measured / predicted"]
    body = []
    for r in rows:
        p, m = r["predicted"], r["measured_peak"]
        if not p:
            continue
        mib = lambda v: _fmt(v and v / MIB, ".1f")  # noqa: E731
        predicted = m.get("predicted_kv_plus_activations")
        body.append([r["label"], mib(r["weight_bytes"]), f"{p['batch']} x {p['context']}", mib(p["kv_cache"]),
                     mib(p["activations"]), mib(p["total"]), _measured_run(m), mib(m.get("model_resident_bytes")),
                     mib(m.get("increase_bytes")), mib(predicted),
                     _fmt(predicted and m["increase_bytes"] / predicted, ".2f")])
    return head, body


def _measured_run(m: dict) -> str:
    if not m:
        return "–"
    decoded = f" + {m['decode_tokens']}" if "decode_tokens" in m else ""  # older results: prefill only
    where = f", {m['process']}" if "process" in m else ""
    return f"{m['batch']} x {m['context']}{decoded} ({m['dtype']}{where})"


def lm_eval_table(rows) -> tuple[list[str], list[list[str]]]:
    cols = sorted({(t, m) for r in rows for t, ms in r["lm_eval"].items() for m in ms if m != "samples"})
    head = ["scheme"] + [f"{t} {m}" for t, m in cols]
    body = [[r["label"]] + [_fmt(r["lm_eval"].get(t, {}).get(m), ".4f") for t, m in cols] for r in rows if r["lm_eval"]]
    return head, body


def expert_table(rows) -> tuple[list[str], list[list[str]]]:
    """Per run and mixture-of-experts layer: the tokens the router sent its experts (fewest, median,
    most) and the expert linears solved without their own statistics."""
    head = ["run", "step", "layer", "experts", "routed tokens min / median / max", "fallback experts"]
    body = []
    for row in rows:
        for step in row.get("steps") or []:
            for layer in layer_records(step):
                for experts, counts in (layer.get("routed_tokens") or {}).items():
                    ranked = sorted(counts)
                    fallbacks = sorted({int(n.removeprefix(experts + ".").split(".")[0])
                                        for n in layer.get("expert_fallbacks") or {} if n.startswith(experts + ".")})
                    body.append([row["label"], step.get("name", "?"), experts, str(len(counts)),
                                 f"{ranked[0]} / {ranked[len(ranked) // 2]} / {ranked[-1]}",
                                 ", ".join(map(str, fallbacks)) or "none"])
    return head, body


EMPTY_CELLS = ("–", "")


def drop_empty_columns(head: list[str], body: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """The table without the columns no row has a figure in (e.g. speed columns when speed was not timed);
    a table without rows is kept whole, so its header still says what it would hold."""
    keep = [i for i in range(len(head)) if not body or any(row[i] not in EMPTY_CELLS for row in body)]
    return [head[i] for i in keep], [[row[i] for i in keep] for row in body]


def _md_table(head, body) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def _html_table(head, body) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def plan_table(rows) -> tuple[list[str], list[list[str]]]:
    """lowbit fit plans: their formats, KV format, predicted against measured KL and memory."""
    head = ["plan", "linears' formats", "KV cache", "predicted KL (summed)", "measured KL", "predicted MiB",
            "measured MiB", "budget MiB"]
    body = []
    for r in rows:
        if r["kind"] != "plan":
            continue
        peak = r["measured_peak"]
        total = peak.get("measured_total_bytes")
        body.append([r["label"], ", ".join(f"{k} {n}" for k, n in sorted(r["plan_formats"].items())), r["plan_kv"],
                     _fmt(r["plan_predicted_kl"], ".4g"), _fmt(r["kl_mean"], ".4g"),
                     _fmt(r["plan_predicted_mib"], ".1f"),
                     _fmt(total and total / MIB, ".1f"), _fmt(r["plan_budget_mib"], ".1f")])
    return head, body


def kernels_note(rows) -> str:
    """Which matmul each row's quantized linears ran while timed (a kernel variant such as
    cpu_avx2, or the reference path with its reason), and the CPU as the run treated it."""
    lines = [f"{r['label']}: " + ", ".join(f"{n} x {k}" for k, n in r["kernels"].items())
             for r in rows if r.get("kernels")]
    cpus = sorted({r["cpu"] for r in rows if r.get("cpu")})
    head = f" CPU: {'; '.join(cpus)}." if cpus else ""
    return head + (" Quantized linears ran: " + "; ".join(lines) + "." if lines else "")


def speed_note(rows) -> str:
    bw = sorted({f"{r['bandwidth_gbs']:.1f}" for r in rows if r.get("bandwidth_gbs")})
    note = (f"Read bandwidth measured in the same run: {', '.join(bw)} GB/s; roofline tok/s = batch x "
            "bandwidth / bytes read per decode step (weights + KV). ") if bw else ""
    note += "Wall-clock medians on the machine named in results.json; noisy on a shared machine."
    return note + kernels_note(rows)


def fit_note(rows) -> str:
    max_ctx = next((r["model_max_context"] for r in rows if r.get("model_max_context")), None)
    trained = f" The model was trained for {max_ctx:,} tokens: longer contexts fit in memory only." if max_ctx else ""
    return "Predicted: weights + KV cache + activation workspace (16-bit activations; see results.json)." + trained


def build_sections(rows, notes) -> list[tuple[str, tuple | None, bytes | None, str]]:
    """(title, table, png, note) in report order."""
    speed = tradeoff_plot(rows, "decode_tok_s", "decode tokens/s at batch 1", higher_x_better=True)
    mem = tradeoff_plot(rows, "weight_bytes", "weight memory (MiB)", higher_x_better=False, x_scale=1 / MIB)
    layers = layer_error_plot(rows)
    budget = budget_plot(rows)
    plans = plan_table(rows)
    lm = lm_eval_table(rows)
    experts = expert_table(rows)
    mem_missing = ("No quality loss to plot: neither the unquantized perplexity nor KL was measured."
                   if any(r["weight_bytes"] for r in rows) else "No memory figures recorded.")
    sections = [
        ("Verdict", None, None, "\n".join(verdict_lines(rows))),
        ("Summary", summary_table(rows), None, "\n".join(notes)),
        ("Quality loss vs decode speed", None, speed,
         speed_note(rows) if speed else
         "No speed figures: enable evaluate.speed (e.g. --set evaluate.speed.enabled=true)."),
        ("Quality loss vs weight memory", None, mem, "" if mem else mem_missing),
        ("Memory: predicted and measured", memory_table(rows), None,
         "Measured on CPU in a fresh process that loads the checkpoint once: the resident set the loaded "
         "model took (after a short first call touches every weight), then the high-water mark's rise "
         "during one prefill and a few decoded tokens (freed heap returned to the OS first, so reused pages "
         "cannot hide it). On GPU it is torch.cuda.max_memory_allocated in the evaluating process. "
         "The KV cache per layer counts sliding windows, shared and latent caches as the config says."),
        ("What fits: longest context (1 sequence) and concurrent sequences, by budget", fit_tables(rows), None,
         fit_note(rows)),
        ("Budget plans (lowbit fit) against uniform recipes", plans if plans[1] else None, budget,
         ("Each plan's predicted KL is the sum of each linear's (and the KV cache's) measured alone; its predicted "
          "memory is weights + KV cache + chunked-prefill workspace, measured on the memory-lean CPU runtime "
          "at the budget's context.") if plans[1] else "No lowbit fit plans among these runs."),
        ("lm-eval", lm if lm[1] else None, None, "" if lm[1] else "No lm-eval tasks were run."),
        *([("Mixture of experts: calibration tokens per expert", experts, None,
            "Routed tokens: what the router sent each expert (under calibration.moe: all_experts every expert's "
            "statistics see all of its layer's tokens all the same). A fallback expert saw fewer than "
            "calibration.moe_min_tokens and was rounded to nearest.")] if experts[1] else []),
        ("Per-layer error", None, layers,
         "" if layers else "No step recorded per-layer errors (RTN does not; GPTQ-like steps do)."),
    ]
    # a table without rows says nothing its section's note does not
    return [(title, drop_empty_columns(*table) if table and table[1] else None, png, note)
            for title, table, png, note in sections]


def render_markdown(sections) -> str:
    parts = ["# lowbit report", ""]
    for title, table, png, note in sections:
        parts += [f"## {title}", ""]
        if table:
            parts += [_md_table(*table), ""]
        if png:
            parts += ["(plot in report.html)", ""]
        if note:
            parts += [note, ""]
    return "\n".join(parts)


STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;"
         "font-size:13px}td,th{border:1px solid #bbb;padding:3px 7px;text-align:right}"
         "td:first-child,th:first-child{text-align:left}th{background:#eee}img{max-width:100%}")


def render_html(sections) -> str:
    body = ["<h1>lowbit report</h1>"]
    for title, table, png, note in sections:
        body.append(f"<h2>{html.escape(title)}</h2>")
        if table:
            body.append(_html_table(*table))
        if png:
            data = base64.b64encode(png).decode()
            body.append(f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}">')
        if note:
            body.append(_html_note(note))
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>lowbit report</title>"
            f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>")


def _html_note(note: str) -> str:
    """Paragraphs, or a list where every line is a markdown bullet (the verdict)."""
    lines = note.splitlines()
    if all(line.startswith("- ") for line in lines):
        return "<ul>" + "".join(f"<li>{html.escape(line[2:])}</li>" for line in lines) + "</ul>"
    return "".join(f"<p>{html.escape(line)}</p>" for line in lines)


def write_report(runs: list[dict], html_path: str | Path, labels: Optional[list[str]] = None) -> Path:
    """Write html_path and the markdown twin beside it (report.html -> report.md)."""
    html_path = Path(html_path)
    rows, notes = rows_for(runs, labels)
    sections = build_sections(rows, notes)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(html_path, render_html(sections))
    write_text_atomic(html_path.with_suffix(".md"), render_markdown(sections))
    return html_path
