"""Resume: a run interrupted after a layer continues from there and writes the same checkpoint."""
import shutil

import pytest
import torch
from tiny_models import save_tiny_llama

from lowbit.recipes.schema import load_recipe
from lowbit.app import resume
from lowbit.app.cli import main
from lowbit.app.run import run

QUICK = ("evaluate.baseline=false", "evaluate.perplexity.max_tokens=256",
         "evaluate.perplexity.context_len=128", "evaluate.perplexity.stride=128",
         "calibration.samples=4", "calibration.seq_len=64")
GPTQ = "{scheme: {bits: 4, strategy: group, group_size: 32}, actorder: static, forward_dtype: float32}"
FP8_GPTQ = "{scheme: {strategy: channel}, activations: dynamic, rounding: gptq}"  # the same walk, FP8 layers
SIGNROUND = "{scheme: {bits: 3, strategy: group, group_size: 32}, iterations: 6, batch: 2}"
GGUF_GPTQ = "{scheme: {gguf: q4_0}, actorder: static, forward_dtype: float32}\nexport: {format: dense}"  # GGUF layers


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random 4-layer llama saved with the smollm2 tokenizer (same vocabulary)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-4"), layers=4)


def recipe_file(tmp_path, tiny_dir, steps: str):
    path = tmp_path / "r.yaml"
    path.write_text(f"name: resume-test\nmodel: {tiny_dir}\nsteps:\n{steps}")
    return load_recipe(str(path), QUICK)


class Interrupt(Exception):
    pass


def interrupt_after(monkeypatch, step: str, layer: int, saves: list):
    """Make StepLayers.save raise once `step`'s layer `layer` is saved (a crash right after it)."""
    original = resume.StepLayers.save

    def save(self, index, prefix, module, result, hidden):
        original(self, index, prefix, module, result, hidden)
        saves.append((self.folder.name, index))
        if (self.folder.name, index) == (step, layer):
            raise Interrupt

    monkeypatch.setattr(resume.StepLayers, "save", save)


@pytest.mark.parametrize("step", [f"gptq: {GPTQ}", f"fp8: {FP8_GPTQ}", f"gptq: {GGUF_GPTQ}",
                                  f"signround: {SIGNROUND}"])
def test_resumed_run_writes_the_uninterrupted_checkpoint(tiny_dir, tmp_path, monkeypatch, step):
    recipe = recipe_file(tmp_path, tiny_dir, f"  - {step}\n")
    run(recipe, tmp_path / "whole")
    assert not resume.resume_dir(tmp_path / "whole").exists()  # cleaned up after publishing

    out, saves = tmp_path / "resumed", []
    interrupt_after(monkeypatch, "step0", 1, saves)
    with pytest.raises(Interrupt):
        run(recipe, out)
    assert not out.exists() and resume.resume_dir(out).is_dir()
    with pytest.raises(FileExistsError, match="--resume"):  # never silently start over
        run(recipe, out)
    lost = tmp_path / "outputs-lost"  # the same folder without the outputs layer 2 reads
    shutil.copytree(resume.resume_dir(out), resume.resume_dir(lost))
    (resume.resume_dir(lost) / "step0" / "hidden1.safetensors").unlink()
    saves.clear()
    run(recipe, out, resume=True)
    assert saves == [("step0", 2), ("step0", 3)]  # layers 0 and 1 were restored, not redone
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()
    assert not resume.resume_dir(out).exists()
    saves.clear()  # restored layers recompute their outputs exactly, whatever modules the step left
    run(recipe, lost, resume=True)
    assert saves == [("step0", 2), ("step0", 3)]
    assert (lost / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()


def test_resume_across_steps(tiny_dir, tmp_path, monkeypatch):
    recipe = recipe_file(tmp_path, tiny_dir, "  - awq: {scheme: {bits: 4, strategy: group, group_size: 32}, grid: 4, max_tokens: 128}\n"
                                             f"  - gptq: {GPTQ}\n")
    run(recipe, tmp_path / "whole")
    out, saves = tmp_path / "resumed", []
    interrupt_after(monkeypatch, "step1", 0, saves)
    with pytest.raises(Interrupt):
        run(recipe, out)
    saves.clear()
    run(recipe, out, resume=True)
    assert saves == [("step1", 1), ("step1", 2), ("step1", 3)]
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()


def test_resume_refuses_a_different_recipe(tiny_dir, tmp_path, monkeypatch):
    recipe = recipe_file(tmp_path, tiny_dir, f"  - gptq: {GPTQ}\n")
    interrupt_after(monkeypatch, "step0", 0, [])
    with pytest.raises(Interrupt):
        run(recipe, tmp_path / "out")
    other = load_recipe(str(tmp_path / "r.yaml"), QUICK + ("calibration.seed=1",))
    with pytest.raises(ValueError, match="calibration"):
        run(other, tmp_path / "out", resume=True)


def test_layer_state_round_trips_exactly(tiny_dir, tmp_path):
    from lowbit.calibrate.models import load_model
    from lowbit.quantize.runtime.qlinear import QuantLinear
    from lowbit.quantize.grids.integer import IntScheme
    from lowbit.quantize.grids.integer import quantize_rtn

    model, _, _ = load_model(str(tiny_dir))
    layer = model.model.layers[1]
    q = layer.self_attn.q_proj
    layer.self_attn.q_proj = QuantLinear.from_quantized(quantize_rtn(q.weight, IntScheme(4, False, "group", 32)), q.bias)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    store = resume.StepLayers(tmp_path / "step0")
    outputs = [torch.randn(2, 3, 128)]
    store.save(0, "model.layers.1", layer, {"ok": 1}, outputs)
    fresh, _, _ = load_model(str(tiny_dir))
    result, hidden = resume.StepLayers(tmp_path / "step0").restore(0, "model.layers.1", fresh.model.layers[1])
    after = fresh.model.layers[1].state_dict()
    assert result == {"ok": 1} and torch.equal(hidden[0], outputs[0])
    assert isinstance(fresh.model.layers[1].self_attn.q_proj, QuantLinear)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_cli_resume_flag(tiny_dir, tmp_path, monkeypatch, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: resume-test\nmodel: {tiny_dir}\nsteps:\n  - gptq: {GPTQ}\n")
    sets = [a for item in QUICK for a in ("--set", item)]
    interrupt_after(monkeypatch, "step0", 0, [])
    with pytest.raises(Interrupt):
        main(["run", str(recipe), "--output", str(tmp_path / "out"), *sets])
    assert main(["run", str(recipe), "--output", str(tmp_path / "out"), *sets]) == 2
    assert "--resume" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(["run", str(recipe), "--output", str(tmp_path / "out"), "--resume", *sets]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_run_failing_before_any_layer_leaves_no_resume_folder(tiny_dir, tmp_path):
    recipe = recipe_file(tmp_path, tiny_dir, "  - gptq: {scheme: {bits: 4, strategy: group, group_size: 48}}\n")
    with pytest.raises(ValueError, match="group"):
        run(recipe, tmp_path / "out")
    assert not resume.resume_dir(tmp_path / "out").exists() and not (tmp_path / "out").exists()


def test_layers_compressed_tensors_cannot_describe_turn_checkpoints_off(tiny_dir, tmp_path):
    """GPTQ actorder: group keeps a permuted g_idx (exportable only as --format gptq): the run
    goes on without resume checkpoints instead of failing."""
    recipe = recipe_file(tmp_path, tiny_dir, "  - gptq: {scheme: {bits: 4, strategy: group, group_size: 32}, "
                                             "actorder: group, forward_dtype: float32}\n"
                                             "export: {format: gptq}\n")
    with pytest.warns(RuntimeWarning, match="resume checkpoints off"):
        run(recipe, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not resume.resume_dir(tmp_path / "out").exists()
