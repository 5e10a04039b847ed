"""lowbit never deletes what it did not write: --overwrite replaces only a folder whose manifest.json
lists every file in it, never the model or source checkpoint (equal, inside or containing), and
never because a recipe says so. Real folders with a user's files in them, checked byte for byte
afterwards; the output's other bad shapes (., .., /, /proc, overlong names) end in one line naming
--output; a write failing at the results stage names the file."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from faults import start_run_at_results_stage
from model_folders import looks_like_checkpoint
from tiny_models import SMALL_RUN, save_tiny_llama
from lowbit.export.output_folder import NAME_BYTES
from lowbit.app.cli import main
from lowbit.app.resume import resume_dir

SMALL = [f"--set={item}" for item in SMALL_RUN]


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def tiny(tiny_source, tmp_path):
    """A copy of the tiny model that a test may see threatened (checked byte for byte)."""
    return shutil.copytree(tiny_source, tmp_path / "models" / "tiny")


def snapshot(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def user_folder(path) -> dict[str, bytes]:
    """A real folder of a user's: a note, a nested file and a hidden one."""
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("my notes\n")
    (path / "sub" / "data.csv").write_text("a,b\n1,2\n")
    (path / ".hidden").write_bytes(b"\x00\x01")
    return snapshot(path)


def refused(args, capsys) -> str:
    """Run the CLI, expect the one-line error exit, return the message."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("lowbit: error:")]
    assert len(lines) == 1, err
    return lines[0]


def run_args(model, out, *extra):
    return ["run", "w4a16-rtn", "--model", str(model), "--output", str(out), *SMALL, *extra]


def test_overwrite_refuses_a_folder_lowbit_did_not_write(tiny, tmp_path, capsys):
    out = tmp_path / "userdir"
    before = user_folder(out)
    message = refused(run_args(tiny, out, "--overwrite"), capsys)
    assert f"--output {out} is not a lowbit output" in message and "delete it yourself" in message
    assert snapshot(out) == before


def test_overwrite_refuses_the_model_folder_itself(tiny, capsys):
    before = snapshot(tiny)
    message = refused(run_args(tiny, tiny, "--overwrite"), capsys)
    assert f"--output {tiny} is the model folder" in message
    assert snapshot(tiny) == before


def test_overwrite_refuses_the_model_folders_parent(tiny, capsys):
    parent = tiny.parent
    before = snapshot(parent)
    message = refused(run_args(tiny, parent, "--overwrite"), capsys)
    assert f"--output {parent} contains the model folder {tiny}" in message
    assert snapshot(parent) == before


def test_output_inside_the_model_folder_is_refused(tiny, capsys):
    before = snapshot(tiny)
    message = refused(run_args(tiny, tiny / "quantized"), capsys)
    assert "lies inside the model folder" in message
    assert snapshot(tiny) == before  # not even a lock or resume folder was made in it


def test_a_recipe_cannot_ask_to_overwrite(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(run_args(tiny, out)) == 0  # a lowbit output, which --overwrite could replace
    capsys.readouterr()
    before = snapshot(out)
    recipe = tmp_path / "keen.yaml"
    recipe.write_text("steps: [{rtn: {scheme: {bits: 4, group_size: 64}}}]\nexport: {overwrite: true}\n")
    message = refused(["run", str(recipe), "--model", str(tiny), "--output", str(out), *SMALL], capsys)
    assert f"{recipe}: export.overwrite: replacing an output folder is decided on the command line" in message
    assert snapshot(out) == before


def test_overwrite_replaces_a_lowbit_output_but_not_a_users_file_in_it(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(run_args(tiny, out)) == 0
    assert main(run_args(tiny, out, "--overwrite")) == 0  # lowbit's own output: replaced
    capsys.readouterr()
    (out / "my-eval.txt").write_text("numbers I measured\n")
    before = snapshot(out)
    message = refused(run_args(tiny, out, "--overwrite"), capsys)
    assert "holds files lowbit did not write (my-eval.txt)" in message
    assert snapshot(out) == before


def test_a_file_added_during_the_run_stops_the_replacement(tiny, tmp_path, capsys):
    """Checked again just before the old folder is replaced: a second process adds a file to it
    while the run is at its results stage."""
    out = tmp_path / "out"
    assert main(run_args(tiny, out)) == 0
    capsys.readouterr()
    go = tmp_path / "go"
    second = start_run_at_results_stage(run_args(tiny, out, "--overwrite"), cwd=tmp_path, LOWBIT_TEST_GO=str(go))
    (out / "added-meanwhile.txt").write_text("mine\n")
    before = snapshot(out)
    go.touch()
    _, err = second.communicate(timeout=120)
    assert second.returncode == 2 and "Traceback" not in err
    assert "holds files lowbit did not write (added-meanwhile.txt)" in err
    assert snapshot(out) == before
    assert (resume_dir(out) / "checkpoint" / "model.safetensors").is_file()  # the work is kept


def test_export_refuses_an_output_that_contains_its_source(tiny, tmp_path, capsys):
    ckpt = tmp_path / "par" / "ckpt"
    assert main(run_args(tiny, ckpt)) == 0
    capsys.readouterr()
    before = snapshot(tmp_path / "par")
    message = refused(["export", str(ckpt), "--format", "dense", "--output", str(ckpt.parent), "--overwrite"], capsys)
    assert f"--output {ckpt.parent} contains the source checkpoint {ckpt}" in message
    message = refused(["export", str(ckpt), "--format", "dense", "--output", str(ckpt / "dense")], capsys)
    assert "lies inside the source checkpoint" in message
    assert snapshot(tmp_path / "par") == before


@pytest.mark.parametrize("output,expected", [
    (".", "--output . is not a new folder's name"),
    ("..", "--output .. is not a new folder's name"),
    ("/", "--output / is not a new folder's name"),
    ("x" * (NAME_BYTES + 1), f"--output: the folder name is {NAME_BYTES + 1} bytes"),
    ("/proc/lowbit-out", "cannot create files in /proc for output /proc/lowbit-out"),
])
def test_bad_output_names_end_in_one_line_naming_the_output(tiny, tmp_path, monkeypatch, capsys, output, expected):
    monkeypatch.chdir(tmp_path)
    mine = user_folder(tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    message = refused(run_args(tiny, output), capsys)
    assert expected in message and "PosixPath" not in message and ".lock" not in message
    assert snapshot(tmp_path / "work") == mine


def test_dry_run_checks_and_writes_nothing(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(run_args(tiny, out, "--dry-run", "--set", "scheme.bits=5")) == 0
    captured = capsys.readouterr()
    assert "rtn int5 sym group 64 (recipe w4a16-rtn changed by --set scheme.bits=5)" in captured.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # no output, lock or resume folder


def test_card_headline_follows_the_scheme_set_on_the_command_line(tiny, tmp_path):
    out = tmp_path / "out"
    assert main(run_args(tiny, out, "--set", "scheme.bits=5")) == 0
    headline = (out / "README.md").read_text().splitlines()[2]
    assert "rtn int5 sym group 64 (recipe w4a16-rtn changed by --set scheme.bits=5)" in headline
    assert "INT4" not in headline
    assert main(run_args(tiny, tmp_path / "plain")) == 0  # the shipped recipe keeps its own words
    assert "INT4 weights, group 64" in (tmp_path / "plain" / "README.md").read_text().splitlines()[2]


def test_a_full_disk_at_the_results_stage_names_the_file(tiny, tmp_path):
    """A real write failure (RLIMIT_FSIZE, set as the results stage begins): the error names
    results.json, nothing is published, and --resume finishes from the kept checkpoint."""
    out = tmp_path / "out"
    proc = start_run_at_results_stage(run_args(tiny, out), cwd=tmp_path, LOWBIT_TEST_FSIZE="256")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("lowbit: error:")]
    assert f"{resume_dir(out) / 'checkpoint' / 'results.json'}" in line
    assert "the file-size limit (ulimit -f) was hit" in line
    assert not looks_like_checkpoint(out)
    assert not list((resume_dir(out) / "checkpoint").glob(".results.json.tmp-*"))  # no temporary left
    assert main(run_args(tiny, out, "--resume")) == 0
    assert json.loads((out / "results.json").read_text())["quality"]["perplexity"] > 0


def test_missing_lm_eval_is_refused_before_calibrating(tiny, tmp_path):
    """lm-eval made unimportable in a second process (as Python marks a blocked import)."""
    out = tmp_path / "out"
    script = ("import sys; sys.modules['lm_eval'] = None\n"
              "from lowbit.app.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", script, *run_args(tiny, out, "--set",
                           "evaluate.lm_eval.tasks=[lowbit_wiki_cloze]")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=os.environ)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "evaluate.lm_eval.tasks ['lowbit_wiki_cloze'] needs lm-eval (not installed)" in proc.stderr
    assert "calibration data" not in proc.stderr and "CPU:" not in proc.stderr  # before any work
    assert not out.exists() and not resume_dir(out).exists()


@pytest.mark.parametrize("target,expected", [
    ("notes.txt", "-o notes.txt: the report is HTML"),
    ("CKPT", "is a lowbit checkpoint, whose report.html is its own"),
])
def test_report_output_is_checked(tiny, tmp_path, capsys, target, expected):
    run = tmp_path / "run"
    assert main(run_args(tiny, run)) == 0
    capsys.readouterr()
    before = snapshot(run)
    target = str(run) if target == "CKPT" else str(tmp_path / target)
    message = refused(["report", str(run), "-o", target], capsys)
    assert expected.replace("notes.txt", target) in message
    assert snapshot(run) == before


def test_report_into_a_folder_writes_report_html_there(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(run_args(tiny, run)) == 0
    (tmp_path / "reports").mkdir()
    assert main(["report", str(run), "-o", str(tmp_path / "reports")]) == 0
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["report.html", "report.md"]


def test_sweep_checks_every_output_before_running_any(tiny, tmp_path, capsys):
    root = tmp_path / "sweep"
    mine = user_folder(root / "w8a16-rtn")
    message = refused(["sweep", "w4a16-rtn", "w8a16-rtn", "--model", str(tiny), "--output", str(root),
                       "--overwrite", *SMALL], capsys)
    assert "w8a16-rtn is not a lowbit output" in message
    assert not (root / "w4a16-rtn").exists()  # the first recipe did not run
    assert snapshot(root / "w8a16-rtn") == mine


EVAL_SMALL = [f"--set={item}" for item in SMALL_RUN if item.startswith("evaluate.")]


def test_eval_writes_only_its_own_files_and_never_into_the_model(tiny, tmp_path, capsys):
    mine = user_folder(tmp_path / "userdir")
    message = refused(["eval", str(tiny), "--output", str(tmp_path / "userdir"), *EVAL_SMALL], capsys)
    assert "holds files other than lowbit eval's" in message and "notes.txt" in message
    assert snapshot(tmp_path / "userdir") == mine
    model = snapshot(tiny)
    message = refused(["eval", str(tiny), "--output", str(tiny), *EVAL_SMALL], capsys)
    assert f"--output {tiny} is the model evaluated" in message
    assert snapshot(tiny) == model
    out = tmp_path / "eval"
    for _ in range(2):  # its own files, rewritten
        assert main(["eval", str(tiny), "--output", str(out), *EVAL_SMALL]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "report.md", "results.json"]
