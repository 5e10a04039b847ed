"""Resume: a run checkpoints each decoder layer a calibration walk finishes, so that
`lowbit run … --resume` continues an interrupted run from its last finished layer and ends with
the checkpoint an uninterrupted run writes.

The progress lives beside the output folder, in `.NAME.resume/`: `state.json` (what the run
computes: model, calibration, steps, ignore), and per step `stepK/` with `layerI.safetensors`
(the layer's state; quantized modules in compressed-tensors form, float32 scales, so nothing is
rounded), `hiddenI.safetensors` (the outputs of the last finished layer, what the next layer
reads) and `progress.json` (layers finished and their results), written last, so a kill at any
moment leaves the previous consistent state. The folder is removed once the checkpoint is
published.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from lowbit.export import compressed_tensors as ct

STATE = "state.json"
PROGRESS = "progress.json"
IDENTITY_KEYS = ("model", "calibration", "steps", "ignore")  # what decides the quantized weights


def resume_dir(output: Path) -> Path:
    return output.with_name(f".{output.name}.resume")


class RunProgress:
    """The resume folder of one run; created when the first layer is saved, so a run that fails
    before calibrating leaves nothing behind."""

    def __init__(self, folder: Path, identity: dict):
        self.folder, self.identity = folder, identity

    @classmethod
    def open(cls, output: Path, recipe: dict, resume: bool) -> "RunProgress":
        folder = resume_dir(Path(output))
        identity = {k: recipe.get(k) for k in IDENTITY_KEYS}
        finished = finished_layers(folder) if (folder / STATE).is_file() else 0
        if finished:
            _check_resumable(folder, identity, resume, finished)
            print(f"[lowbit] resuming from {folder} ({finished} layers already done)", file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)  # nothing finished in it: nothing to keep
        return cls(folder, identity)

    def step(self, index: int) -> "StepLayers":
        return StepLayers(self.folder / f"step{index}", self._write_state)

    def _write_state(self) -> None:
        if not (self.folder / STATE).is_file():
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_json(self.folder / STATE, self.identity)

    def finish(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def finished_layers(folder: Path) -> int:
    return sum(json.loads(p.read_text())["finished"] for p in folder.glob(f"step*/{PROGRESS}"))


def _check_resumable(folder: Path, identity: dict, resume: bool, finished: int) -> None:
    if not resume:
        raise FileExistsError(
            f"{folder} holds an interrupted run ({finished} layers finished): pass "
            "--resume to continue it, or delete that folder to start over")
    saved = json.loads((folder / STATE).read_text())
    differs = [k for k in IDENTITY_KEYS if saved.get(k) != identity.get(k)]
    if differs:
        raise ValueError(
            f"{folder} was written by a run with different {', '.join(differs)}; --resume continues "
            "only the same model, calibration, steps and ignore list. Delete the folder to start over")


class StepLayers:
    """One walk's finished layers (walker.LayerStore)."""

    def __init__(self, folder: Path, before_first_save=lambda: None):
        self.folder, self.before_first_save = folder, before_first_save
        progress = folder / PROGRESS
        saved = json.loads(progress.read_text()) if progress.is_file() else {"finished": 0, "results": []}
        self.finished: int = saved["finished"]
        self.results: list = saved["results"]
        self.disabled = False  # set when a layer cannot be checkpointed: the run goes on without

    def save(self, index: int, prefix: str, layer: nn.Module, result, hidden: Optional[list[torch.Tensor]]) -> None:
        if self.disabled:
            return
        try:
            tensors, qconfig = layer_tensors(prefix, layer)
        except ValueError as err:  # a module compressed-tensors cannot describe (act-order g_idx)
            self.disabled = True
            warnings.warn(f"resume checkpoints off for this step: {err}", RuntimeWarning, stacklevel=2)
            return
        self.before_first_save()
        self.folder.mkdir(parents=True, exist_ok=True)
        _save_tensors(tensors, self.folder / f"layer{index}.safetensors", {"qconfig": json.dumps(qconfig)})
        if hidden is not None:
            _save_tensors({f"hidden.{k}": h for k, h in enumerate(hidden)}, self.folder / f"hidden{index}.safetensors")
        self.results = self.results[:index] + [result]
        self.finished = index + 1
        _write_json(self.folder / PROGRESS, {"finished": self.finished, "results": self.results})
        for old in self.folder.glob("hidden*.safetensors"):  # only the newest is ever read
            if old.name != f"hidden{index}.safetensors":
                old.unlink()

    def restore(self, index: int, prefix: str, layer: nn.Module):
        if index >= self.finished:
            return None
        path = self.folder / f"layer{index}.safetensors"
        load_layer(prefix, layer, path)
        hidden = None
        if index == self.finished - 1 and (self.folder / f"hidden{index}.safetensors").is_file():
            saved = load_file(str(self.folder / f"hidden{index}.safetensors"))
            hidden = [saved[f"hidden.{k}"] for k in range(len(saved))]
        return self.results[index], hidden


def layer_tensors(prefix: str, layer: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of the layer under its full name, quantized modules in compressed-tensors form."""
    quantized = {f"{prefix}.{n}": m for n, m in layer.named_modules() if n and ct.is_quantized(m)}
    tensors = {}
    for name, tensor in layer.state_dict().items():
        full = f"{prefix}.{name}"
        if full.rpartition(".")[0] not in quantized:
            tensors[full] = tensor.detach().cpu().clone().contiguous()
    for name, module in quantized.items():
        tensors.update({k: v.cpu().contiguous() for k, v in ct.module_tensors(name, module, torch.float32).items()})
    return tensors, ct.quantization_config(quantized, []) if quantized else {}


def load_layer(prefix: str, layer: nn.Module, path: Path) -> None:
    """Load a layer saved by layer_tensors back into `layer` (quantized modules rebuilt)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: layer checkpoint missing; delete the resume folder")
    with safe_open(str(path), "pt") as f:  # one read: metadata and tensors
        qconfig = json.loads(f.metadata().get("qconfig") or "{}")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    device = next((p.device for p in layer.parameters()), torch.device("cpu"))
    prefixes = set(ct.quantized_prefixes(tensors))
    for full in prefixes:
        module = ct.build_module(full, tensors, qconfig, str(path))
        layer.set_submodule(full[len(prefix) + 1:], module.to(device))
    floats = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.rpartition(".")[0] not in prefixes}
    result = layer.load_state_dict(floats, strict=False)
    quantized = {n for n, m in layer.named_modules() if ct.is_quantized(m)}
    missing = [k for k in result.missing_keys if k.rpartition(".")[0] not in quantized]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path}: does not match layer {prefix} (missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]}); delete the resume folder")


def _save_tensors(tensors: dict, path: Path, metadata: Optional[dict] = None) -> None:
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
