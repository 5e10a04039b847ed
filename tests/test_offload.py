"""calibration.offload: the activations a walk keeps between decoder layers wait on the device, in
CPU memory or in files, and every step writes the same checkpoint wherever they wait."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tiny_models import save_tiny_llama
from lowbit.calibrate.offload import DiskTensors, Offload, resolve_offload
from lowbit.calibrate.walker import walk
from lowbit.app.cli import main

QUICK = ["calibration.samples=6", "calibration.seq_len=64", "evaluate.baseline=false",
         "evaluate.kl.enabled=false", "evaluate.memory.measure_peak=false", "evaluate.perplexity.max_tokens=256",
         "evaluate.perplexity.context_len=128", "evaluate.perplexity.stride=128"]
SAME_BYTES = ("model.safetensors", "config.json")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("offload") / "tiny", layers=3)


def run(recipe: str, model: Path, out: Path, *settings: str) -> Path:
    args = ["run", recipe, "--model", str(model), "--output", str(out)]
    for item in (*QUICK, *settings):
        args += ["--set", item]
    assert main(args) == 0
    return out


@pytest.mark.parametrize("recipe,extra", [
    ("w4a16-gptq", ("scheme.group_size=32", "steps.0.gptq.micro_batch=4")),
    ("w4a16-awq", ("scheme.group_size=32",)),
    ("w8a8-smoothquant", ()),
    ("w4a16-signround", ("scheme.group_size=32", "steps.0.signround.iterations=4", "steps.0.signround.batch=2")),
    ("w4a16-signround", ("scheme.group_size=32", "steps.0.signround.iterations=4", "steps.0.signround.batch=2",
                         "steps.0.signround.target=model")),  # the float model's stream waits where the walk's does
])
def test_every_offload_writes_the_same_checkpoint(recipe, extra, tiny, tmp_path):
    on_device = run(recipe, tiny, tmp_path / "device", "calibration.offload=device", *extra)
    for where in ("cpu", "disk"):
        out = run(recipe, tiny, tmp_path / where, f"calibration.offload={where}", *extra)
        for name in SAME_BYTES:
            assert (out / name).read_bytes() == (on_device / name).read_bytes(), (where, name)
        assert not list(tmp_path.glob(f".{where}.resume")), "the resume folder (and its activations) is gone"


def test_a_streamed_run_offloads_to_disk_too(tiny, tmp_path):
    settings = ("scheme.group_size=32", "steps.0.gptq.micro_batch=4")
    resident = run("w4a16-gptq", tiny, tmp_path / "resident", "calibration.streaming=false", *settings)
    streamed = run("w4a16-gptq", tiny, tmp_path / "streamed", "calibration.streaming=true",
                   "calibration.offload=disk", *settings)
    assert (streamed / "model.safetensors").read_bytes() == (resident / "model.safetensors").read_bytes()


def test_a_disk_walk_keeps_its_activations_in_files_it_removes(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from lowbit.calibrate.arch import arch_for

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    arch = arch_for(model)
    batches = torch.randint(0, model.config.vocab_size, (6, 32), generator=torch.Generator().manual_seed(0))
    seen = []

    def on_layer(i, prefix, layer, inputs):
        assert isinstance(inputs.hidden, DiskTensors) and len(inputs.hidden) == 3  # 6 samples, 2 per batch
        files = sorted(p.name for p in inputs.hidden.folder.iterdir())
        assert files == ["0.safetensors", "1.safetensors", "2.safetensors"]
        assert inputs.hidden.folder.parent == tmp_path / "acts"
        seen.append(inputs.hidden[0].clone())

    result = walk(model, arch, batches, on_layer, micro_batch=2, offload=Offload("disk", tmp_path / "acts"))
    reference = []
    walk(model, arch, batches, lambda i, p, layer, inputs: reference.append(inputs.hidden[0].clone()), micro_batch=2)
    assert len(seen) == 3 and all(torch.equal(a, b) for a, b in zip(seen, reference))
    assert torch.equal(result.hidden[-1], walk(model, arch, batches, lambda *a: None, micro_batch=2).hidden[-1])
    del result, seen
    gc.collect()
    assert list((tmp_path / "acts").iterdir()) == []  # every layer's files removed once let go


def test_disk_tensors_read_back_what_was_written(tmp_path):
    kept = DiskTensors(tmp_path)
    tensors = [torch.randn(2, 3, 4), torch.randn(1, 5, 4).to(torch.bfloat16)]
    for t in tensors:
        kept.append(t)
    assert len(kept) == 2 and torch.equal(kept[-1], tensors[1]) and kept[1].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(kept[:], tensors)) and len(kept[1:]) == 1
    assert [torch.equal(a, b) for a, b in zip(kept, tensors)] == [True, True]
    with pytest.raises(IndexError, match="activation 2 of 2"):
        kept[2]
    folder = kept.folder
    del kept
    gc.collect()
    assert not folder.exists()


def test_auto_keeps_what_fits_and_sends_the_rest_to_disk(tmp_path):
    assert resolve_offload("auto", "cpu", 1 << 20, tmp_path) == Offload("device", tmp_path)
    too_big = 1 << 60  # more than any machine's memory
    assert resolve_offload("auto", "cpu", too_big, tmp_path) == Offload("disk", tmp_path)
    assert resolve_offload("cpu", "cpu", too_big).where == "cpu"  # asked for: as asked


def test_a_bad_offload_names_the_key_and_the_choices(tiny, tmp_path, capsys):
    code = main(["run", "w4a16-rtn", "--model", str(tiny), "--output", str(tmp_path / "out"),
                 "--set", "calibration.offload=ram"])
    err = capsys.readouterr().err
    assert code != 0 and "calibration.offload: 'ram' is not valid" in err
    assert "['auto', 'device', 'cpu', 'disk']" in err
    assert not (tmp_path / "out").exists()
