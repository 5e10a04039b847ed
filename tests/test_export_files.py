"""What every export writes besides the tensors: manifest, atomic publication, model card."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from export_helpers import quantized_tiny
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.export.manifest import MANIFEST, verify_manifest
from lowbit.export.model_card import write_model_card

TESTS = Path(__file__).parent


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq"])
def test_manifest_lists_every_file_with_its_sha256(tmp_path, fmt):
    out = checkpoint.save(quantized_tiny(), None, tmp_path / "ckpt", ExportConfig(format=fmt),
                          extra_files={"recipe.yaml": "name: test\n"})
    listed = json.loads((out / MANIFEST).read_text())["files"]
    on_disk = {p.name for p in out.iterdir()} - {MANIFEST}
    assert set(listed) == on_disk >= {"model.safetensors", "config.json", "recipe.yaml"}
    assert verify_manifest(out) == []
    with open(out / "model.safetensors", "r+b") as f:  # flip one byte, size unchanged
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    assert verify_manifest(out) == [f"{out / 'model.safetensors'}: differs from {MANIFEST} (size or sha256)"]


def test_overwrite_replaces_a_lowbit_export_unless_a_file_was_added_to_it(tmp_path):
    target = checkpoint.save(quantized_tiny(), None, tmp_path / "ckpt", ExportConfig())
    with pytest.raises(FileExistsError, match="not empty.*--overwrite"):
        checkpoint.save(quantized_tiny(), None, target, ExportConfig())
    checkpoint.save(quantized_tiny(), None, target, ExportConfig(), overwrite=True)  # lowbit's own: replaced
    assert checkpoint.is_lowbit_export(target) and verify_manifest(target) == []
    (target / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"holds files lowbit did not write \(precious.txt\)"):
        checkpoint.save(quantized_tiny(), None, target, ExportConfig(), overwrite=True)
    assert (target / "precious.txt").read_text() == "keep me" and verify_manifest(target) == []
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


CRASH = """
import os, sys
import safetensors.torch
from export_helpers import quantized_tiny
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.export.formats import hf_folder

real = hf_folder.save_tensors
def save_then_die(tensors, path, metadata=None):
    real(tensors, path, metadata=metadata)
    os._exit(9)  # killed after the weights, before config.json and the manifest: no cleanup runs
hf_folder.save_tensors = save_then_die  # where every format writes its weights
checkpoint.save(quantized_tiny(), None, sys.argv[1], ExportConfig(), overwrite=True)
"""


def _crash_while_saving(target: Path) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", CRASH, str(target)], env=env, capture_output=True).returncode


def test_a_killed_export_leaves_no_folder_that_looks_whole(tmp_path):
    target = tmp_path / "ckpt"
    assert _crash_while_saving(target) == 9
    assert not target.exists()
    leftovers = list(tmp_path.iterdir())
    assert [p.name.startswith(".ckpt.partial-") for p in leftovers] == [True]
    assert not checkpoint.is_checkpoint(leftovers[0]) and not (leftovers[0] / MANIFEST).exists()


def test_a_killed_overwrite_keeps_the_old_checkpoint_whole(tmp_path):
    target = checkpoint.save(quantized_tiny(), None, tmp_path / "ckpt", ExportConfig())
    assert _crash_while_saving(target) == 9
    assert checkpoint.is_lowbit_export(target) and verify_manifest(target) == []


RESULTS = {
    "lowbit_version": "0.1.0",
    "model": {"id": "smollm2-135m", "params": 134_515_008, "model_type": "llama"},
    "recipe": {"name": "w4a16-rtn", "description": "INT4 weights", "ignore": ["lm_head"],
               "calibration": {"dataset": "wiki", "samples": 128, "seq_len": 512},
               "steps": [{"rtn": {"scheme": {"bits": 4, "symmetric": True, "strategy": "group", "group_size": 64}}}]},
    "quality": {"perplexity": 21.5, "baseline_perplexity": 20.0, "dataset": "wiki",
                "protocol": {"tokens_scored": 16383, "context_len": 512}},
    "memory": {"weight_bytes": 90 * 2**20, "baseline_weight_bytes": 256 * 2**20},
    "timing": {"calibrate_s": 0.0},
}


def test_model_card_reports_the_run_and_joins_the_manifest(tmp_path):
    out = checkpoint.save(quantized_tiny(), None, tmp_path / "ckpt", ExportConfig())
    (out / "results.json").write_text(json.dumps(RESULTS))
    card = write_model_card(out, RESULTS).read_text()
    for fact in ("`smollm2-135m`", "134.5M parameters", "rtn (bits=4, symmetric=True, strategy=group, group_size=64)",
                 "compressed-tensors (pack-quantized)", "none used", "21.500", "+7.50%", "90.0 MiB",
                 "256.0 MiB", "lm_head"):
        assert fact in card, fact
    assert {"README.md", "results.json"} <= set(json.loads((out / MANIFEST).read_text())["files"])
    assert verify_manifest(out) == []
