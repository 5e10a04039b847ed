"""bench/decode.py end to end on one decoder layer of the 1B config: every scheme is timed and
reported against the baselines and the roofline (figures are not asserted, only their shape)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from lowbit.calibrate.hardware import cpu_info
from lowbit.quantize.runtime import cpu_kernels

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "decode.py"


def run_bench(args: list[str], capsys) -> list[dict]:
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(args + ["--json"])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_decode_bench_reports_every_scheme(capsys):
    schemes = ["fp32", "bf16", "w8a16", "w4a16", "w8a8", "fp8"]
    rows = run_bench(["--models", "llama-1b", "--layers", "1", "--batches", "1", "2", "--steps", "2",
                      "--warmup", "1", "--schemes", *schemes], capsys)
    by = {(r["stat"], r["scheme"], r["batch"]): r for r in rows}
    assert set(by) == {(stat, s, b) for stat in ("median", "best", "cpu-median") for s in schemes for b in (1, 2)}
    mb = {s: by["median", s, 1]["step_mb"] for s in schemes}
    # bytes each step must read, whichever kernel runs: 4-bit codes count half a byte
    assert mb["w4a16"] < 0.6 * mb["w8a16"] and mb["w8a16"] < mb["bf16"] < mb["fp32"]
    for batch in (1, 2):
        assert max(by["median", s, batch]["vs_best_baseline"] for s in ("fp32", "bf16")) == 1.0
    assert all(r["tokens_per_s"] > 0 and 0 < r["vs_roofline"] and r["bandwidth_gbs"] > 0 for r in rows)
    isa = cpu_info().isa  # the kernel variant auto picks (LOWBIT_CPU_ISA forces one)
    assert {r["cpu"] for r in rows} == {cpu_info().describe()}
    kernels = {by["median", s, 1]["kernels"] for s in ("w8a16", "w4a16", "fp8")}
    if isa == "none":  # the reference path ran, and every row says why
        assert all(k.startswith("reference (no CPU kernel variant") for k in kernels), kernels
    elif cpu_kernels.load(isa) is not None:
        assert kernels == {f"cpu_{isa}"}


def test_decode_record_is_a_results_file_with_its_provenance(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    import results_tables

    record_path = tmp_path / "cpu_decode-new.json"
    rows = run_bench(["--models", "llama-1b", "--layers", "1", "--batches", "1", "--steps", "2", "--warmup", "1",
                      "--schemes", "bf16", "w4a16", "--record", str(record_path)], capsys)
    record = json.loads(record_path.read_text())
    assert record["rows"] == rows and record["date"] and "cores" in record["cpu"]
    import os

    forced = " ".join(f"{name}={os.environ[name]}" for name in ("LOWBIT_CPU_ISA", "ATEN_CPU_CAPABILITY",
                                                                 "ONEDNN_MAX_CPU_ISA") if name in os.environ)
    assert forced in record["command"] and "--record" in record["command"]  # the variables that forced a variant
    assert record["command"].split("python bench/decode.py")[1].startswith(" --models llama-1b")
    page = results_tables.render_all([record_path], tmp_path)[tmp_path / "cpu_decode.md"]
    w4 = next(r for r in rows if r["stat"] == "median" and r["scheme"] == "w4a16")
    assert f"| w4a16 | {w4['kernels']} | {w4['tokens_per_s']:.2f}, {w4['vs_best_baseline']:.2f}×" in page
    assert f"- date: {record['date']}" in page
