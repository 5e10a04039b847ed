"""bench/signround_step.py times the same steps both ways on smollm2 and prints one JSON record."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lowbit.quantize.runtime import cpu_kernels

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import signround_step  # noqa: E402


def test_it_times_both_ways_and_prints_their_ratio(capsys):
    if cpu_kernels.load() is None:
        pytest.skip("no CPU kernel module on this CPU: the bench says so and stops")
    assert signround_step.main(["--batches", "1", "--steps", "2", "--repeats", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    (row,) = record["rows"]
    assert row["batch"] == 1 and row["compiled_s"] > 0 and row["torch_s"] > 0
    assert row["torch_over_compiled"] == pytest.approx(row["torch_s"] / row["compiled_s"], rel=0.02)
