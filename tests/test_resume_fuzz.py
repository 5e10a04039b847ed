"""A killed run's resume folder, damaged, never resumes into a different checkpoint: `lowbit run
--resume` writes the uninterrupted run's bytes or refuses in one line naming the file; never a
traceback, never "audit passed" on other weights (#61's B2 and B3, reproduced for real).

Two folders are left by real SIGKILLs of `w4a16-gptq` on a 4-layer tiny llama: one after layer 1
(layer0, layer1 and hidden1 kept), one in its evaluation (all layers and the exported checkpoint
kept). The fuzz deletes, cuts short, flips bytes in and zeroes ranges of their files, at random.
Every example runs the check --resume starts with (resume.RunProgress.open, as run() calls it) on
its own copy; after it, every file the folder's records still name proves itself (size and sha256),
and what the run reads next is decided by those records alone: two examples that leave the same
records resume from the same bytes. So the whole `lowbit run --resume` runs once per distinct
outcome (a handful; resumed_by_outcome), and each example is held to its outcome's run.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import signal
from pathlib import Path

import pytest
from faults import kill_run_after_layer, start_run_stopping_in_evaluation
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import PINNED_RUN, save_tiny_llama

from lowbit.app import resume, resume_files
from lowbit.app.cli import main
from lowbit.export.manifest import verify_manifest
from lowbit.recipes.schema import load_recipe

FUZZ_EXAMPLES = 200
RECIPE = "w4a16-gptq"
SETS = [x for item in PINNED_RUN for x in ("--set", item)]
DAMAGES = ("delete", "cut short", "flip a byte", "zero a range")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """(model folder, the uninterrupted checkpoint's sha256, {name: a killed run's resume folder})."""
    root = tmp_path_factory.mktemp("resume-fuzz")
    model = save_tiny_llama(root / "tiny", layers=4)
    args = ["run", RECIPE, "--model", str(model), *SETS]
    assert main([*args, "--output", str(root / "whole")]) == 0
    assert kill_run_after_layer([*args, "--output", str(root / "walk")], 1) == -signal.SIGKILL
    proc = start_run_stopping_in_evaluation([*args, "--output", str(root / "exported")], cwd=root)
    proc.kill()
    proc.wait(timeout=60)
    folders = {name: resume.resume_dir(root / name) for name in ("walk", "exported")}
    assert (folders["walk"] / "step0" / "hidden1.safetensors").is_file()
    assert (folders["exported"] / resume_files.EXPORTED).is_file()
    return model, sha256(root / "whole" / "model.safetensors"), folders


def damage(path: Path, how: str, seed: int) -> None:
    data = bytearray(path.read_bytes())
    if how == "delete" or not data:
        path.unlink()
    elif how == "cut short":
        path.write_bytes(bytes(data[: seed % len(data)]))
    elif how == "flip a byte":
        data[seed % len(data)] ^= 1 << (seed % 8)
        path.write_bytes(bytes(data))
    else:
        start = seed % len(data)
        data[start: start + 64] = bytes(len(data[start: start + 64]))
        path.write_bytes(bytes(data))


def damaged_copy(base: Path, where: Path, damages: list[tuple[str, str, int]]) -> Path:
    """The output a copy of `base` resumes (its resume folder under `where`), the damages applied."""
    out = where / "out"
    shutil.copytree(base, resume.resume_dir(out))
    for name, how, seed in damages:
        path = resume.resume_dir(out) / name
        if path.is_file():
            damage(path, how, seed)
    return out


def checked(model: Path, out: Path) -> tuple:
    """The check --resume starts with; the outcome it leaves: ('refused', line) or the records the
    run reads from (the exported checkpoint's, else each step's finished layers and outputs)."""
    recipe = load_recipe(RECIPE, [*PINNED_RUN, f"model={model}"]).to_dict()
    try:
        resume.RunProgress.open(out, recipe, resume=True)
    except ValueError as err:
        assert "\n" not in str(err) and str(resume.resume_dir(out)) in str(err), str(err)
        return ("refused", type(err).__name__)
    folder = resume.resume_dir(out)
    if (folder / resume_files.EXPORTED).is_file():
        files = resume_files.read_sealed(folder / resume_files.EXPORTED)[resume_files.CHECKPOINT_FILES]
        assert all(not resume_files.file_differs(folder / "checkpoint" / n, r) for n, r in files.items())
        return ("exported", json.dumps(files, sort_keys=True))
    steps = []
    for progress in sorted(folder.glob(f"step*/{resume_files.PROGRESS}")):
        saved = resume_files.read_sealed(progress)
        assert all(not resume_files.file_differs(progress.parent / n, r) for n, r in saved["files"].items())
        steps.append((progress.parent.name, saved["finished"], saved["outputs"],
                      json.dumps(saved["files"], sort_keys=True)))
    return ("layers", tuple(steps))


@pytest.fixture(scope="module")
def resumed_by_outcome(killed):
    """outcome -> what the full `lowbit run --resume` of the first folder with that outcome gave:
    (exit code, sha256 of the checkpoint or None, stderr's lines after the run's own notes)."""
    model, _, _ = killed
    runs: dict = {}

    def resumed(outcome: tuple, out: Path, capsys) -> tuple:
        if outcome not in runs:
            capsys.readouterr()
            code = main(["run", RECIPE, "--model", str(model), "--output", str(out), "--resume", *SETS])
            err = capsys.readouterr().err
            written = sha256(out / "model.safetensors") if (out / "model.safetensors").is_file() else None
            assert written is None or not verify_manifest(out)  # published whole, its manifest true
            errors = [line for line in err.splitlines() if line.startswith("lowbit: error")]
            runs[outcome] = (code, written, errors, "Traceback" in err)
        return runs[outcome]
    return resumed


def assert_uninterrupted_or_refused(result: tuple, whole: str) -> None:
    code, written, errors, traceback = result
    assert not traceback
    if code == 0:
        assert written == whole
    else:
        assert code == 2 and written is None and len(errors) == 1, errors


@pytest.mark.parametrize("base, damages", [
    ("walk", [("step0/hidden1.safetensors", "delete", 0)]),  # B2: must not walk on from layer 0's inputs
    ("walk", [("step0/layer1.safetensors", "cut short", 5000)]),  # B3: SafetensorError before
    ("walk", [("step0/layer0.safetensors", "zero a range", -4000)]),  # a zeroed tensor: passed the audit before
    ("walk", [("step0/progress.json", "cut short", 300)]),  # weak 5: a JSON parser's message
    ("walk", [("state.json", "flip a byte", 40)]),  # which run this was is unknown: refused
    ("exported", [("checkpoint/model.safetensors", "flip a byte", 9999)]),
])
def test_damaged_resume_folders_resume_to_the_uninterrupted_bytes_or_refuse(killed, resumed_by_outcome, base,
                                                                            damages, tmp_path, capsys):
    model, whole, folders = killed
    out = damaged_copy(folders[base], tmp_path, damages)
    outcome = checked(model, out)
    assert_uninterrupted_or_refused(resumed_by_outcome(outcome, out, capsys), whole)
    if damages[0][0] == "state.json":
        assert outcome[0] == "refused"


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_damage_never_resumes_into_another_checkpoint(killed, resumed_by_outcome, tmp_path_factory, capsys,
                                                             data):
    model, whole, folders = killed
    base = data.draw(st.sampled_from(sorted(folders)))
    names = sorted(p.relative_to(folders[base]).as_posix() for p in folders[base].rglob("*") if p.is_file())
    damages = data.draw(st.lists(st.tuples(st.sampled_from(names), st.sampled_from(DAMAGES),
                                           st.integers(0, 2**31)), min_size=1, max_size=3))
    out = damaged_copy(folders[base], tmp_path_factory.mktemp("example"), damages)
    assert_uninterrupted_or_refused(resumed_by_outcome(checked(model, out), out, capsys), whole)
