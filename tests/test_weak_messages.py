"""Faults that used to end in a misleading or bare message (#61), reproduced for real (a folder, a
symlink, an unusable cache path, an outsize weight in a saved model): each now ends in one line
naming what the user gave and what would be valid, before the work it would have wasted."""
from __future__ import annotations

import os

import pytest
import torch

from tiny_models import save_tiny_llama
from lowbit.app.cli import main
from lowbit.quantize.grids.gguf import LAYOUTS, GGUFScheme

QUICK = ["--set", "evaluate.baseline=false", "--set", "evaluate.perplexity.max_tokens=256",
         "--set", "evaluate.perplexity.context_len=128", "--set", "evaluate.perplexity.stride=128",
         "--set", "calibration.samples=4", "--set", "calibration.seq_len=64"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("weak") / "tiny", layers=2))


def with_weight(source: str, folder, tensor: str, value: float) -> str:
    """A copy of the model folder `source` whose saved `tensor` holds `value` at [3, 5] ([5] if 1-D)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    path = folder / "model.safetensors"
    weights = load_file(path)
    weights[tensor][(3, 5) if weights[tensor].dim() == 2 else 5] = value
    save_file(weights, path, metadata={"format": "pt"})
    return str(folder)


def refused_run(capsys, tiny, tmp_path, recipe: str, tensor: str, value: float) -> str:
    """The one error line of `lowbit run RECIPE` on a copy of `tiny` whose `tensor` holds `value`."""
    model = with_weight(tiny, tmp_path / "big", tensor, value)
    return one_error_line(capsys, ["run", recipe, "--model", model, "--output", str(tmp_path / "out"), *QUICK])


def one_error_line(capsys, args) -> str:
    """`lowbit ARGS` exits 2 with exactly one error line and no traceback; returns that line."""
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("lowbit: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_recipe_path_that_is_a_folder_is_said_to_be_one(tmp_path, capsys):
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "w4.yaml").write_text("steps: [rtn]\n")
    line = one_error_line(capsys, ["run", str(folder), "--dry-run"])
    assert line == (f"lowbit: error: {folder}: is a directory, not a recipe file; a recipe is a YAML file or a "
                    "shipped recipe's name (`lowbit recipes` lists them); it holds w4.yaml")


@pytest.mark.parametrize("command", ["run w4a16-rtn --model {model} --output {out}",
                                     "run w4a16-rtn --model {model} --output {out} --dry-run",
                                     "fit {model} --budget-bits-per-weight 4"])
def test_an_unusable_lowbit_cache_is_refused_at_the_start_naming_the_variable(tiny, tmp_path, monkeypatch, capsys,
                                                                              command):
    # /dev/null is a device: nothing can be made under it (the raw error was "[Errno 20] Not a directory",
    # and w4a16-rtn met it only at evaluation, after quantizing)
    monkeypatch.setenv("LOWBIT_CACHE", "/dev/null/x")
    args = command.format(model=tiny, out=tmp_path / "out").split()
    line = one_error_line(capsys, args + (QUICK if args[0] == "run" else []))
    assert line == ("lowbit: error: LOWBIT_CACHE=/dev/null/x cannot be used as lowbit's cache folder: /dev/null is "
                    "not a folder; set LOWBIT_CACHE to a writable folder or unset it (default ~/.cache/lowbit)")
    assert not any(tmp_path.iterdir())  # nothing written: no resume folder, no lock


def test_a_symlinked_output_is_refused_alike_by_dry_run_and_run_and_the_link_is_left_alone(tiny, tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    expected = (f"lowbit: error: --output {link} is a symbolic link (to {real}); lowbit writes its output by renaming "
                "a finished folder into place, which would replace the link, not fill the folder it points to: "
                f"pass the real folder's path, --output {real}")
    args = ["run", "w4a16-rtn", "--model", tiny, "--output", str(link), *QUICK]
    assert one_error_line(capsys, [*args, "--dry-run"]) == expected
    assert one_error_line(capsys, args) == expected  # was: "--overwrite will not replace it", none given
    assert one_error_line(capsys, [*args, "--overwrite"]) == expected
    assert os.readlink(link) == str(real) and not any(real.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no lock, resume or .old folder


def test_a_link_made_at_the_output_during_a_run_is_never_renamed_at_publish(tmp_path):
    from lowbit.export.output_folder import OutputError
    from lowbit.export.staging import publish

    staging = tmp_path / ".out.partial-1"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"x")
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "out").symlink_to(real)  # made after the run's checks, before it publishes
    with pytest.raises(OutputError, match="--output .*out is a symbolic link"):
        publish(staging, tmp_path / "out")
    assert os.readlink(tmp_path / "out") == str(real) and (staging / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial-1", "out", "real"]


@pytest.mark.parametrize("recipe, tensor, value, expected", [
    # 1e6 / 8 overflows Q4_0's fp16 block scale (65504): the final audit found it, after all the work
    ("gguf-q4_0", "model.layers.1.mlp.down_proj.weight", 1e6,
     "model.layers.1.mlp.down_proj: weight [3, 5] is 1e+06, beyond the largest magnitude gguf q4_0 can store, "
     "524032 (its scales would overflow); fix the source weight, or keep this linear 16-bit with "
     "ignore: [model.layers.1.mlp.down_proj]"),
    # up_proj's 1e30 fed down_proj inputs whose Hessian was inf: GPTQ calibrated, then said only "Hessian
    # is not positive definite even with dampening_frac 1000.0", naming neither layer nor cause
    ("w4a16-gptq", "model.layers.0.mlp.up_proj.weight", 1e30,
     "model weight model.layers.0.mlp.up_proj.weight holds 1e+30 at [3, 5]; past 1.8e+19 a value's square "
     "overflows float32 (a norm's mean square, GPTQ's Hessian of the inputs it feeds): the checkpoint is corrupt "
     "or diverged; fix or re-download it"),
], ids=["gguf-scale-overflow", "square-overflow"])
def test_an_outsize_weight_is_refused_naming_it_before_any_step(tiny, tmp_path, capsys, recipe, tensor, value,
                                                                expected):
    assert refused_run(capsys, tiny, tmp_path, recipe, tensor, value) == f"lowbit: error: {expected}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big"]  # no step ran: nothing kept to resume


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_every_gguf_type_stores_weights_up_to_its_largest_stored(kind):
    grid = GGUFScheme(kind)
    limit = grid.largest_stored()
    w = torch.randn(4, grid.block_size, generator=torch.Generator().manual_seed(0)) * 0.02
    w[0, 3], w[1, 5], w[2] = limit, -limit, limit  # a lone outlier of each sign, and a block of them
    w[3] = torch.linspace(-limit, limit, grid.block_size)
    stored = grid.round(w)
    assert all(torch.isfinite(t.float()).all() for t in (stored.d, stored.dmin) if t is not None)
    assert torch.isfinite(stored.dequantize()).all()
    if kind in ("q4_0", "q5_0", "q8_0"):  # exact: the block scale is max / 8, / 16 or / 127, past it inf
        w[0, 3] = limit * 1.001
        assert torch.isinf(grid.round(w).d.float()).any()


def test_an_overflowing_hessian_names_its_linears_and_the_layers_largest_weight(tiny, tmp_path, capsys):
    # 5e18 squares within float32, but the q/k/v inputs it scales, squared and summed over the
    # calibration tokens, do not: caught as the Hessians are collected, before any solve
    line = refused_run(capsys, tiny, tmp_path, "w4a16-gptq", "model.layers.0.input_layernorm.weight", 5e18)
    assert line == (
        "lowbit: error: model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, "
        "model.layers.0.self_attn.v_proj: the Hessian of their calibration inputs (XᵀX) overflows float32, so GPTQ "
        "cannot solve it: the inputs are too large for their squares' sums to stay under 3.4e+38. The layer's "
        "largest weight is model.layers.0.input_layernorm.weight at 5e+18: fix that source weight (the checkpoint "
        "is corrupt or diverged)")
