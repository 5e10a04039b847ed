"""Markdown tables of the measured results in docs/results/*.json, one file per kind of result.

    python bench/results_tables.py            # rewrite docs/results/<kind>.md from every docs/results/*.json,
                                              # and the tables they make in hand-written pages (results_blocks.py)
    python bench/results_tables.py --check    # exit 1 if a written table is not what the JSON files give
    python bench/results_tables.py A.json B.json --out-dir DIR

Measured figures live in these generated tables, never typed by hand into the docs. Each JSON file's
kind is recognised by its contents (KINDS: a new kind is a recogniser, a renderer and one line); a file of
no known kind is an error. Each source file's date, commit, CPU and GPU are shown as the file records
them, "not recorded" where it does not (lowbit.calibrate.provenance is what records them).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

from results_blocks import generated_blocks
from results_markdown import MIB, NOT_RECORDED, RESULTS, number, provenance_lines, shown, table
from results_timing_kinds import (is_recipe_times, is_rounding_reach, recipe_times_section,
                                  rounding_reach_section)

GPU_CHECK_SECTIONS = ("environment", "kernels", "decode", "cuda_tests", "calibration")


# ---------------------------------------------------------------- gpu_check (bench/gpu_check.py)


def is_gpu_check(record: dict) -> bool:
    return any(isinstance(record.get(name), dict) for name in GPU_CHECK_SECTIONS)


def gpu_check_section(record: dict) -> list[str]:
    env = record.get("environment") or {}
    versions = ", ".join(f"{name} {env[name]}" for name in ("python", "torch", "transformers", "triton") if name in env)
    lines = provenance_lines(record) + [f"Software: {versions or NOT_RECORDED}.", ""]
    lines += table(["section", "passed", "seconds"],
                   [[name, str(record[name].get("passed", True)), number(record[name].get("seconds"), 1)]
                    for name in GPU_CHECK_SECTIONS if name in record])
    for name, render in (("kernels", kernels_table), ("decode", decode_tables), ("cuda_tests", cuda_tests_lines),
                         ("calibration", calibration_table)):
        section = record.get(name) or {}
        if "error" in section:
            lines += [f"### {name}", "", f"Failed: `{section['error'].strip().splitlines()[-1]}`", ""]
        elif section:
            lines += [f"### {name}", "", *render(section)]
    return lines


def kernels_table(section: dict) -> list[str]:
    """Each kernel's largest error against its reference path, relative to the largest output."""
    return table(["variant", "shape", "batch", "runs", "max rel error", "passed"],
                 [[r["variant"], r["shape"], str(r["batch"]), r["runs"], f"{r['max_rel_error']:.2%}", str(r["passed"])]
                  for r in section.get("rows", [])])


def decode_tables(section: dict) -> list[str]:
    """Per element-wise mode, one row per variant: step time, speed against bf16, share of read bandwidth."""
    dims = section.get("dims") or {}
    lines = [("Decoder layers' linears: " + ", ".join(f"{k} {v}" for k, v in dims.items()) + ".") if dims else
             f"Decoder layers' linears: {NOT_RECORDED}.", ""]
    rows = section.get("rows", [])
    for glue in dict.fromkeys(r.get("glue") for r in rows):
        picked = [r for r in rows if r.get("glue") == glue]
        bandwidth = statistics.median(r["read_bandwidth_gbs"] for r in picked)
        lines += [f"Element-wise work {glue or NOT_RECORDED}; read bandwidth {bandwidth:.0f} GB/s "
                  "(median of the batches' probes).", ""]
        lines += decode_table(picked)
    return lines


def decode_table(rows: list[dict]) -> list[str]:
    batches = sorted({r["batch"] for r in rows})
    body = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = {r["batch"]: r for r in rows if r["variant"] == variant}
        kernel = ", ".join(next(iter(mine.values()))["runs"])
        body.append([variant, kernel, *(decode_cell(mine.get(b)) for b in batches)])
    return table(["variant", "kernel", *(f"batch {b}: ms, × bf16, of bandwidth" for b in batches)], body)


def decode_cell(row: dict | None) -> str:
    if row is None:
        return "—"
    reference = "" if row.get("accepted") in (None, True) else " (reference path)"
    graph = "" if row.get("cuda_graph", True) else " (no CUDA graph)"
    return f"{row['step_ms']:.2f}, {row['vs_bf16']:.2f}×, {row['of_bandwidth']:.0%}{reference}{graph}"


def cuda_tests_lines(section: dict) -> list[str]:
    lines = [f"`python {section.get('command', NOT_RECORDED)}`: {section.get('summary') or NOT_RECORDED}", ""]
    failures = [f"- {failure}" for failure in section.get("failures", [])]
    return lines + (failures + [""] if failures else [])


def calibration_table(section: dict) -> list[str]:
    """`lowbit run` on the random model: the run's outcome and its (meaningless-in-value) perplexities."""
    body = []
    for run in section.get("runs", []):
        quality = (run.get("results") or {}).get("quality") or {}
        audit = ((run.get("results") or {}).get("audit") or {}).get("passed")
        body.append([run["recipe"], str(run["returncode"]), number(run.get("seconds"), 1),
                     number(quality.get("perplexity"), 3), number(quality.get("baseline_perplexity"), 3),
                     "—" if audit is None else str(audit)])
    return table(["recipe", "return code", "seconds", "perplexity", "baseline perplexity", "audit passed"], body)


# ---------------------------------------------------------------- scale (bench/scale.py --json)

# (row key, column header, format); a column shows where any row has the key
SCALE_COLUMNS = (
    ("model", "model", str), ("task", "task", str), ("mode", "mode", str), ("layers", "decoder layers", str),
    ("float32_weights_gib", "float32 weights GiB", lambda v: f"{v:.2f}"),
    ("peak_rss_gib", "peak RSS GiB", lambda v: f"{v:.2f}"), ("peak_gpu_gib", "peak GPU GiB", lambda v: f"{v:.2f}"),
    ("seconds", "seconds", lambda v: f"{v:.1f}"), ("nll_per_token", "NLL per token", lambda v: f"{v:.6f}"),
    ("model_safetensors_sha256", "model.safetensors sha256", str), ("change", "change", str),
)


def is_scale(record: dict) -> bool:
    rows = record.get("rows")
    return isinstance(rows, list) and bool(rows) and all(isinstance(r, dict) and "float32_weights_gib" in r
                                                         for r in rows)


def scale_section(record: dict) -> list[str]:
    rows = record["rows"]
    columns = [c for c in SCALE_COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    body = [[("—" if r.get(key) is None else fmt(r[key])) for key, _, fmt in columns] for r in rows]
    return provenance_lines(record) + table([header for _, header, _ in columns], body)


# ---------------------------------------------------------------- cpu_decode (bench/decode.py --record)


def is_cpu_decode(record: dict) -> bool:
    rows = record.get("rows")
    return isinstance(rows, list) and bool(rows) and all(isinstance(r, dict) and "tokens_per_s" in r for r in rows)


def cpu_decode_section(record: dict) -> list[str]:
    """Per model, one row per scheme: median decode speed per batch, against the fastest unquantized
    scheme and against the step's roofline (bytes read over the bandwidth probed in the same run)."""
    lines = provenance_lines(record)
    medians = [r for r in record["rows"] if r.get("stat") == "median"]
    for model in dict.fromkeys(r["model"] for r in medians):
        mine = [r for r in medians if r["model"] == model]
        batches = sorted({r["batch"] for r in mine})
        probes = ", ".join(f"batch {b} {next(r['bandwidth_gbs'] for r in mine if r['batch'] == b):.1f} GB/s"
                           for b in batches)
        lines += [f"{model} on {mine[0]['device']}, {mine[0]['threads']} threads; read bandwidth probed: {probes}.", ""]
        body = []
        for scheme in dict.fromkeys(r["scheme"] for r in mine):
            by_batch = {r["batch"]: r for r in mine if r["scheme"] == scheme}
            kernels = next(iter(by_batch.values()))["kernels"]
            body.append([scheme, kernels, *(decode_speed_cell(by_batch.get(b)) for b in batches)])
        lines += table(["scheme", "linears ran", *(f"batch {b}: tok/s, × best unquantized, of roofline"
                                                   for b in batches)], body)
    return lines


def decode_speed_cell(row: dict | None) -> str:
    if row is None:
        return "—"
    return f"{row['tokens_per_s']:.2f}, {row['vs_best_baseline']:.2f}×, {row['vs_roofline']:.0%}"


# ---------------------------------------------------------------- ranks_threads (bench/ranks_threads.py)


def is_ranks_threads(record: dict) -> bool:
    rows = record.get("rows")
    return isinstance(rows, list) and bool(rows) and all(isinstance(r, dict) and "codes_identical_to_first" in r
                                                         for r in rows)


def ranks_threads_section(record: dict) -> list[str]:
    """The same run three ways: its integer codes against the first way's, its bytes and its perplexity."""
    lines = provenance_lines(record) + [f"`{record.get('recipe', NOT_RECORDED)}` on {record.get('model', NOT_RECORDED)}"
                                        f", {record.get('samples', NOT_RECORDED)} calibration samples.", ""]
    rows = [[r["way"], f"{r['codes_identical_to_first']:.4%}", r["model_safetensors_sha256"],
             number(r["perplexity"], 4), number(r.get("seconds"), 1)] for r in record["rows"]]
    return lines + table(["run", "codes identical to the first run's", "model.safetensors sha256", "perplexity",
                          "seconds"], rows)


# ---------------------------------------------------------------- run (a `lowbit run`'s results.json)

def is_run(record: dict) -> bool:
    return "lowbit_version" in record and isinstance(record.get("quality"), dict)


def run_section(record: dict) -> list[str]:
    """The run's headline: quality against the unquantized model on each text it scored (the
    protocol's, then evaluate.held_out's), and the weights' size."""
    recipe, quality, memory = record.get("recipe") or {}, record["quality"], record.get("memory") or {}
    weights = memory.get("weight_bytes")
    lines = provenance_lines(record)
    if recipe.get("description"):
        lines += [f"Recipe `{recipe.get('name', NOT_RECORDED)}`: {recipe['description']}.", ""]
    lines += recipe_lines(recipe, (record.get("timing") or {}).get("calibrate_s"))
    texts = {quality.get("dataset") or NOT_RECORDED: quality, **(quality.get("held_out") or {})}
    rows = [[(record.get("model") or {}).get("reference") or NOT_RECORDED, recipe.get("name", NOT_RECORDED), text,
             *quality_cells(scores), "—" if weights is None else f"{weights / MIB:.1f}"]
            for text, scores in texts.items()]
    return lines + table(["model", "recipe", "text", "perplexity", "unquantized", "change", "KL mean", "top-1",
                          "weights MiB"], rows)


def quality_cells(scores: dict) -> list[str]:
    """Perplexity, the unquantized model's, the change, KL mean and top-1 agreement of one text."""
    ppl, base, kl = scores.get("perplexity"), scores.get("baseline_perplexity"), scores.get("kl") or {}
    change = "—" if ppl is None or not base else f"{ppl / base - 1:+.2%}"
    return [number(ppl, 3), number(base, 3), change, number(kl.get("kl_mean"), 4), number(kl.get("top1_agreement"), 3)]


def recipe_lines(recipe: dict, calibrated_s) -> list[str]:
    """What reproduces the run: the scheme, each step with the options it ran with, and the calibration
    data where the run read any (its timing says so)."""
    lines = [f"- scheme: `{json.dumps(recipe['scheme'])}`"] if recipe.get("scheme") else []
    for step in recipe.get("steps") or []:
        name, options = next(iter(step.items())) if isinstance(step, dict) else (step, {})
        shown = {k: v for k, v in (options or {}).items() if k != "scheme"}  # the scheme is on its own line
        lines.append(f"- step `{name}`: `{json.dumps(shown)}`")
    calibration = recipe.get("calibration") or {}
    if calibration and calibrated_s:
        lines.append(f"- calibration: {calibration.get('dataset')}, {calibration.get('samples')} samples of "
                     f"{calibration.get('seq_len')} tokens")
    return lines + ([""] if lines else [])


# ---------------------------------------------------------------- llama_cpp (bench/gguf_vs_llama_cpp.py)


def is_llama_cpp(record: dict) -> bool:
    return isinstance(record.get("llama_cpp_files"), list)


def llama_cpp_section(record: dict) -> list[str]:
    """Each GGUF file as llama-perplexity scores it, llama.cpp's and lowbit's, on one text."""
    protocol = record.get("protocol") or {}
    lines = provenance_lines(record) + [
        f"Model {record.get('model', NOT_RECORDED)}, llama.cpp {record.get('llama_cpp', NOT_RECORDED)}; imatrix on "
        f"{protocol.get('samples')} x {protocol.get('ctx')} tokens of {protocol.get('calibration')}; scored on "
        f"{protocol.get('chunks')} chunks of {protocol.get('ctx')} tokens of {protocol.get('eval')} (KLD and top "
        f"token against the F16 file).", ""]
    rows = [[row["file"], f"{row['bytes'] / 1e6:.2f}", number(row.get("perplexity"), 3), number(row.get("kld_mean"), 4),
             "—" if row.get("same_top") is None else f"{row['same_top']:.1%}", number(row.get("seconds"), 1)]
            for row in record["llama_cpp_files"]]
    return lines + table(["file", "MB", "llama-perplexity", "mean KLD", "same top token", "seconds to make"], rows)


# ---------------------------------------------------------------- kinds and files

# kind -> (recognises a record, renders one record's section); the table file is <kind>.md
KINDS: dict[str, tuple[Callable[[dict], bool], Callable[[dict], list[str]]]] = {
    "gpu_check": (is_gpu_check, gpu_check_section),
    "scale": (is_scale, scale_section),
    "cpu_decode": (is_cpu_decode, cpu_decode_section),
    "ranks_threads": (is_ranks_threads, ranks_threads_section),
    "run": (is_run, run_section),
    "llama_cpp": (is_llama_cpp, llama_cpp_section),
    "recipe_times": (is_recipe_times, recipe_times_section),
    "rounding_reach": (is_rounding_reach, rounding_reach_section),
}


def kind_of(path: Path, record) -> str:
    kinds = [kind for kind, (recognises, _) in KINDS.items() if isinstance(record, dict) and recognises(record)]
    if len(kinds) != 1:
        raise ValueError(f"{path}: not one known kind of result ({', '.join(KINDS)})"
                         + (f"; it looks like {' and '.join(kinds)}" if kinds else ""))
    return kinds[0]


def read_record(path: Path) -> tuple[str, dict]:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    return kind_of(path, record), record


def json_files(paths: list[Path]) -> list[Path]:
    """Folders stand for their *.json; sorted by name, so the output does not depend on the order given."""
    found = [f for p in paths for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    return sorted(set(found), key=lambda f: (f.name, str(f)))


def records_of(kind: str, paths: list[Path]) -> list[tuple[Path, dict]]:
    return [(path, record) for path in json_files(paths) for found, record in [read_record(path)] if found == kind]


def render_all(paths: list[Path], out_dir: Path) -> dict[Path, str]:
    """Each kind's table file and its text, from every JSON file in `paths`."""
    sections: dict[str, list[str]] = {}
    for path in json_files(paths):
        kind, record = read_record(path)
        link = Path(os.path.relpath(path.resolve(), out_dir.resolve())).as_posix()
        sections.setdefault(kind, []).extend([f"## [{path.name}]({link})", "", *KINDS[kind][1](record)])
    return {out_dir / f"{kind}.md": "\n".join(page_head(kind) + lines).rstrip("\n") + "\n"
            for kind, lines in sorted(sections.items())}


def page_head(kind: str) -> list[str]:
    return [f"# Measured results: {kind}", "",
            "Generated by `python bench/results_tables.py` from the JSON files named below: do not edit by hand,",
            "rerun the script (`--check` says whether this file is current).", ""]


def stale(pages: dict[Path, str]) -> list[Path]:
    return [path for path, text in pages.items() if not path.is_file() or path.read_text(encoding="utf-8") != text]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="JSON files or folders (default: docs/results)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where the <kind>.md files go")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table file is stale")
    args = parser.parse_args(argv)
    try:
        pages = render_all(args.paths or [RESULTS], args.out_dir)
        if not args.paths and args.out_dir == RESULTS:  # the committed results also make the pages' tables
            pages.update(generated_blocks(records_of("run", [RESULTS]), records_of("llama_cpp", [RESULTS])))
    except (ValueError, OSError) as error:
        print(f"results_tables: {error}", file=sys.stderr)
        return 1
    if args.check:
        outdated = stale(pages)
        if outdated:
            names = ", ".join(shown(path) for path in outdated)
            print(f"stale: {names} (not what the JSON files give; run python bench/results_tables.py)",
                  file=sys.stderr)
        return 1 if outdated else 0
    for path, text in pages.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
