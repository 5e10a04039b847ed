"""lowbit's GGUF files against llama.cpp's own, judged by llama.cpp: llama-perplexity (perplexity,
and KL divergence and top-token agreement against the 16-bit file, on the same chunks) on a text
neither was calibrated on.

    pip install -e ".[llama-cpp]"     # sentencepiece, which llama.cpp's converter imports
    python bench/gguf_vs_llama_cpp.py --lowbit runs/sweep/gguf-q4_0-awq-gptq runs/sweep/gguf-q4_k-gptq --json out.json

llama.cpp's side is what its users would make: the float model converted by llama.cpp's own
convert_hf_to_gguf.py (F16), `llama-imatrix` over the calibration text lowbit's recipes use (the
same seeded windows, decoded), and `llama-quantize` for each type with and without that imatrix.
The tools are built once from the pinned llama.cpp source (bench/llama_cpp_tools.py). Every file,
llama.cpp's and lowbit's, is scored by the same llama-perplexity command; the times are the
wall-clock seconds each file took to make (lowbit's: its run's quantize and export, from
results.json). Prints one row per file and, with --json, writes them with the provenance.

What it made and measured is kept in $LOWBIT_CACHE/llama.cpp/bench/<model>/ (memo.json: each file's
making time and scores, keyed by the file's size and mtime and the protocol), so a second call with
another --lowbit run scores only that file.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp_tools
from lowbit.calibrate.cache import cache_dir
from lowbit.calibrate.data import CalibrationConfig, calibration_batches, load_text
from lowbit.calibrate.models import load_tokenizer, resolve_model_path
from lowbit.calibrate.provenance import provenance

TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k_m", "iq4_nl", "iq4_xs")
CONVERTER = "convert_hf_to_gguf.py"


class Memo:
    """Results already measured in the work folder, kept across calls; a key names the file (size
    and mtime) and the protocol, so a changed file or protocol is measured again."""

    def __init__(self, path: Path, protocol: dict):
        self.path, self.protocol = path, json.dumps(protocol, sort_keys=True)
        self.table = json.loads(path.read_text()) if path.is_file() else {}

    def key(self, what: str, file: Path) -> str:
        stat = file.stat()
        return f"{what} {file.name} {stat.st_size} {stat.st_mtime_ns} {self.protocol}"

    def get(self, what: str, file: Path):
        return self.table.get(self.key(what, file)) if file.is_file() else None

    def put(self, what: str, file: Path, value):
        self.table[self.key(what, file)] = value
        self.path.write_text(json.dumps(self.table, indent=1))
        return value


def run_tool(args: list, what: str, timeout: int = 3600) -> tuple[str, float]:
    """A llama.cpp tool's output (stdout and stderr) and its wall-clock seconds; raises naming `what`."""
    began = time.perf_counter()
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {(done.stdout + done.stderr)[-1500:]}")
    return done.stdout + done.stderr, seconds


def convert(model_folder: Path, out: Path) -> float:
    """llama.cpp's converter on the float model, F16; seconds taken (0 when the file was there)."""
    if out.is_file():
        return 0.0
    script = llama_cpp_tools.root() / "llama.cpp" / CONVERTER
    partial = out.with_suffix(".partial")
    _, seconds = run_tool([sys.executable, script, model_folder, "--outtype", "f16", "--outfile", partial],
                          f"{CONVERTER} on {model_folder}")
    partial.rename(out)
    return seconds


def calibration_text(model_folder: Path, cfg: CalibrationConfig, out: Path) -> Path:
    """lowbit's calibration windows (the recipe's dataset, samples, length and seed), decoded."""
    tokenizer = load_tokenizer(str(model_folder), trust_remote_code=False, local_files_only=True)
    windows = calibration_batches(cfg, tokenizer)
    out.write_text("\n\n".join(tokenizer.decode(w) for w in windows), encoding="utf-8")
    return out


def imatrix(f16: Path, text: Path, chunks: int, ctx: int, out: Path) -> float:
    tool = llama_cpp_tools.tool("llama-imatrix")
    _, seconds = run_tool([tool, "-m", f16, "-f", text, "-c", ctx, "--chunks", chunks, "-o", out, "-t", "2"],
                          "llama-imatrix")
    return seconds


def quantize(f16: Path, kind: str, out: Path, imatrix_file: Path | None) -> float:
    tool = llama_cpp_tools.tool("llama-quantize")
    extra = ["--imatrix", imatrix_file] if imatrix_file else []
    _, seconds = run_tool([tool, *extra, f16, out, kind.upper(), "2"], f"llama-quantize {kind}")
    return seconds


def score(model: Path, text: Path, base: Path, chunks: int, ctx: int) -> dict:
    """llama-perplexity's perplexity, mean KLD and top-token agreement against the base logits."""
    tool = llama_cpp_tools.tool("llama-perplexity")
    output, _ = run_tool([tool, "-m", model, "-f", text, "-c", ctx, "--chunks", chunks, "-t", "2",
                          "--kl-divergence-base", base, "--kl-divergence"], f"llama-perplexity on {model.name}")
    return parse_scores(output)


def parse_scores(output: str) -> dict:
    def find(pattern: str) -> float:
        found = re.search(pattern, output)
        if not found:
            raise RuntimeError(f"llama-perplexity printed no {pattern!r}: {output[-800:]}")
        return float(found.group(1))

    return {"perplexity": find(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)"), "kld_mean": find(r"Mean\s+KLD:\s*([0-9.]+)"),
            "same_top": find(r"Same top p:\s*([0-9.]+)") / 100}


def base_logits(f16: Path, text: Path, chunks: int, ctx: int, out: Path) -> dict:
    tool = llama_cpp_tools.tool("llama-perplexity")
    output, _ = run_tool([tool, "-m", f16, "-f", text, "-c", ctx, "--chunks", chunks, "-t", "2",
                          "--kl-divergence-base", out], "llama-perplexity on the F16 file")
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", output)
    return {"perplexity": float(found.group(1)) if found else None}


def lowbit_file(run_dir: Path) -> tuple[Path, str, float | None]:
    """A lowbit GGUF run's model.gguf, recipe name and seconds to make it (quantize and export)."""
    gguf_file = run_dir / "model.gguf"
    if not gguf_file.is_file():
        raise ValueError(f"--lowbit {run_dir}: no model.gguf (a run of a recipe with export format gguf)")
    results = json.loads((run_dir / "results.json").read_text()) if (run_dir / "results.json").is_file() else {}
    timing = results.get("timing") or {}
    made = sum(timing.get(k) or 0 for k in ("calibrate_s", "quantize_s", "export_s")) or None
    return gguf_file, (results.get("recipe") or {}).get("name", run_dir.name), made


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="built-in name or local HF folder")
    parser.add_argument("--lowbit", nargs="*", default=[], type=Path, metavar="RUN_DIR", help="lowbit GGUF runs")
    parser.add_argument("--types", nargs="*", default=list(TYPES), help="llama.cpp types to make")
    parser.add_argument("--calibration", default="wiki")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--eval", default="news", help="the text scored: neither side calibrated on it")
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--json", type=Path, help="write the rows and provenance here")
    args = parser.parse_args(argv)
    lowbit_runs = [lowbit_file(d) for d in args.lowbit]  # bad input refused before any work
    llama_cpp_tools.build()
    folder = Path(resolve_model_path(args.model))
    work = cache_dir("llama.cpp", "bench", folder.name)
    protocol = {"calibration": args.calibration, "samples": args.samples, "eval": args.eval, "chunks": args.chunks,
                "ctx": args.ctx}
    memo = Memo(work / "memo.json", protocol)
    rows, log = [], lambda text: print(f"[llama_cpp] {text}", file=sys.stderr, flush=True)
    f16 = work / "f16.gguf"
    convert_s = convert(folder, f16)
    calib = calibration_text(folder, CalibrationConfig(dataset=args.calibration, samples=args.samples,
                                                       seq_len=args.ctx), work / "calibration.txt")
    evaluation = work / f"{args.eval}.txt"
    evaluation.write_text(load_text(args.eval, "eval"), encoding="utf-8")
    imatrix_file = work / "imatrix.gguf"
    imatrix_s = memo.get("made", imatrix_file)
    if imatrix_s is None:
        log(f"imatrix over {args.samples} x {args.ctx} tokens of {args.calibration}")
        imatrix_s = memo.put("made", imatrix_file, imatrix(f16, calib, args.samples, args.ctx, imatrix_file))
    base = memo.get("base", f16) or memo.put("base", f16, base_logits(f16, evaluation, args.chunks, args.ctx,
                                                                      work / "base.kld"))
    rows.append({"file": "F16 (llama.cpp's converter)", "bytes": f16.stat().st_size, **base, "kld_mean": None,
                 "same_top": None, "seconds": round(convert_s, 1) or None})
    made = []
    for kind in args.types:
        for with_imatrix in (False, True):
            path = work / f"{kind}{'-imatrix' if with_imatrix else ''}.gguf"
            seconds = memo.get("made", path)
            if seconds is None:
                seconds = memo.put("made", path, quantize(f16, kind, path, imatrix_file if with_imatrix else None))
            made.append((f"llama.cpp {kind}{' + imatrix' if with_imatrix else ''}", path,
                         seconds + (imatrix_s if with_imatrix else 0)))
    made += [(f"lowbit {name}", path, seconds) for path, name, seconds in lowbit_runs]
    for label, path, seconds in made:
        scores = memo.get("scores", path)
        if scores is None:
            log(f"scoring {label}")
            scores = memo.put("scores", path, score(path, evaluation, work / "base.kld", args.chunks, args.ctx))
        rows.append({"file": label, "bytes": path.stat().st_size, **scores,
                     "seconds": None if seconds is None else round(seconds, 1)})
    for row in rows:
        print(json.dumps(row))
    if args.json:
        record = {"command": " ".join(["python bench/gguf_vs_llama_cpp.py", *(argv if argv is not None else sys.argv[1:])]),
                  **provenance(), "llama_cpp": llama_cpp_tools.VERSION, "model": args.model,
                  "protocol": protocol, "llama_cpp_files": rows}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
