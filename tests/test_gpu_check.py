"""bench/gpu_check.py --dry-run: the offline GPU script's every section on the CPU, tiny shapes,
Triton in its interpreter, so that the first run on a lent GPU only has to confirm."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "dry.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert out.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    return done.returncode, json.loads(out.read_text()), done.stdout


def test_every_section_passes(dry_run):
    code, report, stdout = dry_run
    assert set(report) == {"environment", "kernels", "decode", "cuda_tests", "calibration"}
    failed = {name: section.get("error", "")[-800:] for name, section in report.items() if not section.get("passed", True)}
    assert failed == {} and code == 0, failed
    assert "every section passed" in stdout


def test_the_triton_kernels_ran_and_match_their_reference(dry_run):
    rows = dry_run[1]["kernels"]["rows"]
    triton_rows = [r for r in rows if r["runs"] == "triton"]
    assert {r["variant"] for r in triton_rows} >= {"w4a16-triton", "w8a16", "fp8-weight-only"}
    assert all(r["max_rel_error"] < 2e-2 for r in rows)
    # the CUDA-only kernels say why they did not run on the CPU
    assert next(r for r in rows if r["variant"] == "w4a16")["runs"].startswith("reference (cuda_int4: codes are on cpu")


def test_decode_rows_cover_every_variant_and_batch(dry_run):
    decode = dry_run[1]["decode"]
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    expected = {(v, b) for v in gpu_check.VARIANTS for b in (1, 32)}
    assert {(r["variant"], r["batch"]) for r in decode["rows"]} == expected
    assert all(r["step_ms"] > 0 and r["glue"] == "fused" for r in decode["rows"])
    markdown = gpu_check.decode_table(dry_run[1])
    assert "| w8a16 | triton |" in markdown and "batch 32" in markdown


def test_calibration_runs_both_recipes(dry_run):
    runs = dry_run[1]["calibration"]["runs"]
    assert [r["recipe"] for r in runs] == ["w4a16-gptq", "fp8-dynamic"]
    for run in runs:
        assert run["returncode"] == 0, run["tail"]
        assert run["results"]["audit"]["passed"] is True
    for summary in dry_run[1]["calibration"]["evaluated"]:  # the evaluation as the GPU will run it
        assert (summary["device"], summary["dtype"]) == ("cpu", "float32") and summary["kl_mean"] >= 0
        rows = summary["speed"]
        assert {(r["model"], r["batch"]) for r in rows} == {(m, b) for m in ("model", "baseline") for b in (1, 2)}
        assert all(r["decode"] == "static" and r["fallback"] is None and r["tpot_s"] > 0 for r in rows)
