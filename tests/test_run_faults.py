"""A run that fails late loses nothing, and real faults end in one clear line: an evaluation
interrupted (SIGINT) or killed (SIGKILL) in a second process resumes without recalibrating; a real
write failure (RLIMIT_FSIZE) names the file; a second run into one output is refused with the
first's pid; published files are readable as the umask says."""
import json
import os
import signal
import subprocess
import sys

import pytest

from faults import file_size_limit, limit_file_size, start_run_stopping_in_evaluation
from model_folders import leftovers, looks_like_checkpoint
from tiny_models import save_tiny_llama
from lowbit.export.manifest import MANIFEST, verify_manifest
from lowbit.app.cli import main
from lowbit.app.lock import lock_path
from lowbit.app.resume import CHECKPOINT, EXPORTED, resume_dir

QUICK = ["--set", "evaluate.baseline=false", "--set", "evaluate.kl.enabled=false",
         "--set", "evaluate.perplexity.max_tokens=256", "--set", "evaluate.perplexity.context_len=128",
         "--set", "evaluate.perplexity.stride=128", "--set", "calibration.samples=4",
         "--set", "calibration.seq_len=64"]
GPTQ = "steps:\n  - gptq: {scheme: {bits: 4, strategy: group, group_size: 32}, forward_dtype: float32}\n"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def gptq_args(tiny_folder, tmp_path, out):
    recipe = tmp_path / "gptq.yaml"
    recipe.write_text(f"name: faults\nmodel: {tiny_folder}\n{GPTQ}")
    return ["run", str(recipe), "--output", str(out), *QUICK]


def assert_published_whole(out):
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(json.loads((out / MANIFEST).read_text())["files"]) == on_disk >= {"results.json", "README.md"}
    assert verify_manifest(out) == []
    assert leftovers(out.parent, out.name) == [out.name]  # no resume folder, lock or staging left


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_run_stopped_in_evaluation_resumes_without_recalibrating(tiny_folder, tmp_path, capsys, sig):
    out = tmp_path / "out"
    args = gptq_args(tiny_folder, tmp_path, out)
    first = start_run_stopping_in_evaluation(args, cwd=tmp_path)
    first.send_signal(sig)
    _, err = first.communicate(timeout=60)
    if sig == signal.SIGINT:  # Ctrl-C: one line saying what was kept, no traceback
        assert first.returncode == 130 and "Traceback" not in err
        assert [line for line in err.splitlines() if line.startswith("lowbit:")] == [
            f"lowbit: interrupted; kept the exported checkpoint (--resume evaluates it without recalibrating) "
            f"in {resume_dir(out)}"]
    else:
        assert first.returncode == -signal.SIGKILL
    assert not out.exists()  # nothing published that looks whole without its results
    kept = resume_dir(out)
    exported = json.loads((kept / EXPORTED).read_text())
    weights = (kept / CHECKPOINT / "model.safetensors").read_bytes()

    assert main(args) == 2 and "--resume" in capsys.readouterr().err  # never silently started over
    assert main([*args, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "calibration data" not in err and f"resuming from {kept}: the exported checkpoint" in err
    results = json.loads((out / "results.json").read_text())
    for key in ("load_s", "calibrate_s", "quantize_s", "export_s"):  # the first run's, not measured again
        assert results["timing"][key] == round(exported["seconds"][key], 3)
    assert results["timing"]["calibrate_s"] > 0 and results["quality"]["perplexity"] > 0
    assert (out / "model.safetensors").read_bytes() == weights
    assert_published_whole(out)


def test_failed_evaluation_keeps_the_checkpoint_for_resume(tiny_folder, tmp_path, capsys):
    """An lm-eval task that cannot run (lm-eval not installed, or no such task) fails after
    export; fixing the option and resuming evaluates the kept checkpoint only."""
    out = tmp_path / "out"
    args = gptq_args(tiny_folder, tmp_path, out)
    assert main([*args, "--set", "evaluate.lm_eval.tasks=[no_such_task]"]) == 2
    err = capsys.readouterr().err
    assert "lowbit: error:" in err and "Traceback" not in err
    assert "no_such_task" in err or "needs lm-eval" in err
    assert f"kept the exported checkpoint (--resume evaluates it without recalibrating) in {resume_dir(out)}" in err
    assert not out.exists()
    assert main([*args, "--resume", "--set", "export.dtype=float16"]) == 2  # not what was exported
    assert "different export" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0
    assert "calibration data" not in capsys.readouterr().err
    assert_published_whole(out)


def test_second_run_into_one_output_is_refused_with_the_first_pid(tiny_folder, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["run", "w8a16-rtn", "--model", str(tiny_folder), "--output", str(out), *QUICK]
    first = start_run_stopping_in_evaluation(args, cwd=tmp_path)
    try:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"output {out} is being written by another lowbit run (pid {first.pid})" in err
        assert "Traceback" not in err and not out.exists()
    finally:
        first.kill()
        first.communicate(timeout=60)
    assert lock_path(out).is_file()  # left by the killed run, and released by the OS with it
    assert main([*args, "--resume"]) == 0
    assert_published_whole(out)


def test_write_failure_names_the_file_and_the_limit(tiny_folder, tmp_path):
    """A real write failure: the run's weights file outgrows RLIMIT_FSIZE (EFBIG)."""
    out = tmp_path / "out"
    limit = 4 << 20  # above every file but model.safetensors (the 49k-token embedding alone is 12 MiB)
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit.app.cli", "run", "w8a16-rtn", "--model", str(tiny_folder),
         "--output", str(out), *QUICK], capture_output=True, text=True, timeout=300,
        preexec_fn=limit_file_size(limit), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    message = proc.stderr.split("lowbit: error: ", 1)[1]
    assert "model.safetensors" in message and "the file-size limit (ulimit -f) was hit" in message
    assert not looks_like_checkpoint(out)
    assert leftovers(tmp_path, "out") == []  # RTN keeps no layers: nothing to resume, nothing left


def test_write_failure_while_overwriting_keeps_the_old_checkpoint(tiny_folder, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["run", "w8a16-rtn", "--model", str(tiny_folder), "--output", str(out), *QUICK]
    assert main(args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with file_size_limit(4 << 20):
        assert main([*args, "--overwrite"]) == 2
    assert "the file-size limit (ulimit -f) was hit" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert leftovers(tmp_path, "out") == ["out"]


def test_published_files_follow_the_umask(tiny_folder, tmp_path):
    out = tmp_path / "out"
    old = os.umask(0o027)
    try:
        assert main(["run", "w8a16-rtn", "--model", str(tiny_folder), "--output", str(out), *QUICK]) == 0
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert modes == {name: "0o640" for name in modes} and "model.safetensors" in modes
    assert oct(out.stat().st_mode & 0o777) == "0o750"
