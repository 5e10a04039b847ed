"""Every shipped recipe, run on a tiny model, writes the checkpoint it wrote when it was pinned.

A refactoring that keeps behaviour keeps these digests; a change that moves a single byte of any
recipe's checkpoint (or its perplexity beyond summation order) shows up here and must be re-pinned
on purpose:

    LOWBIT_RECORD_PINS=1 pytest tests/test_recipe_pins.py

Floating-point results depend on the CPU's kernels (bf16 forwards where bf16 is native, oneDNN's
ISA, torch's vector width), so pins are kept per numeric environment; a machine whose
environment has no pins says so and skips (record them there with the command above).

The environment names the CPU by its feature flags, not only by the paths lowbit picks: two
AVX-512+BF16 machines with the same paths disagreed in the last bits, in the native and in the
AVX2-capped runs alike, on every recipe with FP8 activations, KV-cache or SmoothQuant
calibration, or GPTQ, while the RTN, AWQ and W8A8-INT8 recipes agreed. Neither MKL's branch
(MKL_CBWR), the thread count, oneDNN's ISA cap nor the FP8 cast (round to nearest even here)
explained it on the machine at hand, so the pins say which CPU they were recorded on.

Record at torch's default thread count, as CI runs: the distill recipes' bytes follow it (with
OMP_NUM_THREADS=1, w4a16-signround-distill and gguf-q4_0-signround-distill wrote other bytes).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from audit_agreement import assert_audits_agree
from tiny_models import PINNED_RUN, save_tiny_llama
from lowbit.calibrate.hardware import cpu_flags, cpu_info
from lowbit.recipes.schema import shipped_recipes
from lowbit.app.cli import main

PINS = Path(__file__).with_name("recipe_pins.json")
RECORD = os.environ.get("LOWBIT_RECORD_PINS") == "1"
# wall times and measured memory; README.md, the model card, quotes the perplexity compared below
UNHASHED = {"results.json", "report.html", "report.md", "manifest.json", "README.md"}
# perplexity is the evaluation's, not the checkpoint's: summed a chunk of logits at a time, its last
# digits follow the chunking (evaluate/logits.py moved them by 1.4e-6); any change of a weight
# moves it far more, and the checkpoint's files are compared exactly
PERPLEXITY_REL = 1e-5


def environment() -> str:
    """What decides the floating-point results: torch, the CPU paths cpu_info() picks, and the
    ISA caps torch and oneDNN run under."""
    info = cpu_info()
    caps = "/".join(os.environ.get(k, "-") for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
    cpu = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]
    return (f"torch {torch.__version__}, {info.isa}, bf16 {'native' if info.bf16_native else 'emulated'}, "
            f"int8 {'native' if info.int8_native else 'emulated'}, caps {caps}, cpu flags {cpu}")


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file of the checkpoint but the timed ones (per file: a diff names the file)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16]
            for p in sorted(folder.iterdir()) if p.name not in UNHASHED}


def run_recipe(name: str, model: str, out: Path, capsys) -> dict:
    """The recipe's outcome: checkpoint file hashes and perplexity, or the error it stops with."""
    code = main(["run", name, "--model", model, "--output", str(out), *[f"--set={s}" for s in PINNED_RUN]])
    said = capsys.readouterr()
    if code != 0:
        return {"error": said.err.strip().splitlines()[-1]}
    # the written checkpoint passes `lowbit audit`, which says what the run's audit said, line for line
    assert assert_audits_agree(out, said.out, capsys)["passed"]
    results = json.loads((out / "results.json").read_text())
    return {"files": file_hashes(out), "perplexity": results["quality"]["perplexity"]}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A folder holding the tiny model as `tiny-llama`: runs name it by that relative path, as the
    model card quotes the model's name (an absolute temporary path would change every session)."""
    folder = tmp_path_factory.mktemp("pins")
    save_tiny_llama(folder / "tiny-llama")
    return folder


@pytest.fixture(scope="module")
def pins():
    table = json.loads(PINS.read_text()) if PINS.is_file() else {}
    yield table.setdefault(environment(), {})
    if RECORD:
        PINS.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_shipped_recipe_writes_its_pinned_checkpoint(name, root, pins, monkeypatch, capsys):
    monkeypatch.chdir(root)
    outcome = run_recipe(name, "tiny-llama", Path("runs") / name, capsys)
    if RECORD:
        pins[name] = outcome
        return
    if name not in pins:  # still, every recipe must run here
        assert "error" not in outcome, f"{name} failed on the tiny model: {outcome['error']}"
        pytest.skip(f"no pin for {name} in this environment ({environment()}); record with LOWBIT_RECORD_PINS=1")
    pinned = pins[name]
    if "error" in pinned or "error" in outcome:
        assert outcome == pinned
        return
    assert outcome["files"] == {k: v for k, v in pinned["files"].items() if k not in UNHASHED}
    assert outcome["perplexity"] == pytest.approx(pinned["perplexity"], rel=PERPLEXITY_REL)
