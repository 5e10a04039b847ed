"""Resume: a run keeps what it has finished beside its output folder until it publishes, so that
`lowbit run … --resume` continues an interrupted or failed run where it stopped and ends with the
folder an uninterrupted run writes.

The progress lives in `.NAME.resume/`: `state.json` (what the run computes: model, calibration,
steps, ignore, export), and per calibration walk `stepK/` with `layerI.safetensors` (the layer's
state; quantized modules in compressed-tensors form, float32 scales, so nothing is rounded),
`hiddenI.safetensors` (the outputs of the last finished layer, what the next layer reads) and
`progress.json` (layers finished, their results, and each file's size and sha256), written last, so a
kill at any moment leaves the previous consistent state; --resume checks every record and file before
using any (resume_files.py). The run exports into `checkpoint/` here, then writes
`exported.json` (what evaluating it needs), evaluates, writes the results into the checkpoint and
renames it to the output folder; only then is this folder removed. A resumed run whose checkpoint
was exported only evaluates it.
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
from safetensors.torch import load_file
from torch import nn

from lowbit.export.formats import compressed_tensors as ct
from lowbit.export.staging import publish
from lowbit.export.safetensors_join import write_part
from lowbit.export.manifest import MANIFEST
from lowbit.quantize.grids.gguf import GGUFScheme
from lowbit.quantize.runtime.gguf_linear import GGUFLinear

from .resume_files import (CHECKPOINT, CHECKPOINT_FILES, EXPORTED, LOST, PROGRESS, REWRITTEN, STATE, DamagedRecord,
                           check_folder, empty_progress, file_record, kept_in, layer_file_name, note, outputs_file_name,
                           read_sealed, write_sealed)

IDENTITY_KEYS = ("model", "calibration", "steps", "ignore")  # what decides the quantized weights


def resume_dir(output: Path) -> Path:
    return output.with_name(f".{output.name}.resume")


class RunProgress:
    """The resume folder of one run, used as a context manager: created when the first layer is
    saved (or at export) and removed when the run publishes; a run that fails keeps it only when
    something in it can be resumed."""

    def __init__(self, folder: Path, identity: dict):
        self.folder, self.identity = folder, identity

    @classmethod
    def open(cls, output: Path, recipe: dict, resume: bool) -> "RunProgress":
        folder = resume_dir(Path(output))
        identity = {**{k: recipe.get(k) for k in IDENTITY_KEYS}, "export": _export_identity(recipe)}
        # where calibration runs, whether it streams and where activations wait do not decide the
        # weights: a run may resume elsewhere
        identity["calibration"] = {k: v for k, v in (identity["calibration"] or {}).items()
                                   if k not in ("device", "streaming", "offload")}
        if resume and (folder / STATE).is_file():
            _check_same_run(folder, identity)
            check_folder(folder)  # before anything in it is used: what does not prove itself is dropped
        elif resume and any(folder.glob("step*/")):
            note(f"{folder / STATE}: missing, so nothing in {folder} can be matched to this run; it starts over")
        kept = kept_in(folder)
        if kept:
            if not resume:
                raise FileExistsError(
                    f"{folder} holds an interrupted run ({kept}): pass --resume to continue it, or delete "
                    "that folder to start over")
            print(f"[lowbit] resuming from {folder}: {kept}", file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)  # nothing finished in it: nothing to keep
        return cls(folder, identity)

    def __enter__(self) -> "RunProgress":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            return
        kept = kept_in(self.folder)
        if not kept:
            shutil.rmtree(self.folder, ignore_errors=True)
        elif issubclass(kind, Exception):  # Ctrl-C is reported by the command line, in one line
            print(f"[lowbit] kept {kept} in {self.folder}; fix the cause and rerun with --resume", file=sys.stderr)

    def step(self, index: int, required: bool = False) -> "StepLayers":
        return StepLayers(self.folder / f"step{index}", self._write_state, required)

    @property
    def checkpoint(self) -> Path:
        return self.folder / CHECKPOINT

    def new_checkpoint(self) -> Path:
        """The folder to export into (a checkpoint left by a kill before its record is dropped)."""
        self._write_state(replace=True)  # the export options may differ from those of the first layers' run
        shutil.rmtree(self.checkpoint, ignore_errors=True)
        return self.checkpoint

    def record_export(self, record: dict) -> None:
        """Written once the checkpoint is whole: what evaluating it needs without the float model,
        and its files as the export's manifest lists them (what --resume checks before using it)."""
        listed = json.loads((self.checkpoint / MANIFEST).read_text(encoding="utf-8"))["files"]
        files = {name: entry for name, entry in listed.items() if name not in REWRITTEN}
        write_sealed(self.folder / EXPORTED, {**record, CHECKPOINT_FILES: files})

    def exported(self) -> Optional[dict]:
        """The record of an earlier run that exported and then failed, or None."""
        path = self.folder / EXPORTED
        if not path.is_file():
            return None
        return {k: v for k, v in read_sealed(path).items() if k != CHECKPOINT_FILES}

    def publish(self, output: Path) -> None:
        publish(self.checkpoint, output)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _write_state(self, replace: bool = False) -> None:
        if replace or not (self.folder / STATE).is_file():
            self.folder.mkdir(parents=True, exist_ok=True)
            write_sealed(self.folder / STATE, self.identity)


def kept_summary(output: Path) -> str:
    folder = resume_dir(Path(output))
    kept = kept_in(folder)
    return f"kept {kept} in {folder}" if kept else "nothing was kept"


def _export_identity(recipe: dict) -> dict:
    return {k: v for k, v in (recipe.get("export") or {}).items() if k != "overwrite"}


def _check_same_run(folder: Path, identity: dict) -> None:
    try:
        saved = read_sealed(folder / STATE)
    except DamagedRecord as err:  # which run this was is unknown: nothing in the folder can be trusted
        raise DamagedRecord(err.path, f"{err.why}; delete {folder} to start over") from None
    keys = IDENTITY_KEYS + (("export",) if (folder / EXPORTED).is_file() else ())
    differs = [k for k in keys if saved.get(k) != identity.get(k)]
    if differs:
        raise ValueError(
            f"{folder} was written by a run with different {', '.join(differs)}; --resume continues "
            f"only the same {', '.join(keys)}. Delete the folder to start over")


class StepLayers:
    """One walk's finished layers (walker.LayerStore)."""

    def __init__(self, folder: Path, before_first_save=lambda: None, required: bool = False):
        # required: a streamed run, where these files are the only copy of the finished layers
        self.folder, self.before_first_save, self.required = folder, before_first_save, required
        progress = folder / PROGRESS
        saved = read_sealed(progress) if progress.is_file() else empty_progress()
        self.finished: int = saved["finished"]
        self.results: list = saved["results"]
        self.files: dict = saved["files"]
        self.outputs: Optional[str] = saved["outputs"]
        self.disabled = False  # set when a layer cannot be checkpointed: the run goes on without

    @property
    def outputs_lost(self) -> bool:
        """Whether the last finished layer's outputs, which the walk goes on from, must be computed
        again from the restored layers (their file did not prove itself)."""
        return self.outputs == LOST

    def save(self, index: int, prefix: str, layer: nn.Module, result, hidden: Optional[list[torch.Tensor]]) -> None:
        if self.disabled:
            return
        try:
            tensors, qconfig = layer_tensors(prefix, layer)
        except ValueError as err:  # a module compressed-tensors cannot describe (act-order g_idx)
            if self.required:
                raise ValueError(f"{prefix}: a streamed run keeps each finished layer on disk, and this "
                                 f"one cannot be written ({err}); set calibration.streaming=false") from None
            self.disabled = True
            warnings.warn(f"resume checkpoints off for this step: {err}", RuntimeWarning, stacklevel=2)
            return
        self.before_first_save()
        self.folder.mkdir(parents=True, exist_ok=True)
        files = {n: r for n, r in self.files.items() if n != self.outputs}  # only the newest outputs are read
        metadata = {"qconfig": json.dumps(qconfig), "gguf": json.dumps(gguf_types(layer))}
        files[layer_file_name(index)] = self._save(layer_file_name(index), tensors, metadata)
        outputs = None
        if hidden is not None:
            outputs = outputs_file_name(index)
            files[outputs] = self._save(outputs, {f"hidden.{k}": h for k, h in enumerate(hidden)})
        self.results = self.results[:index] + [result]
        self.finished, self.files, self.outputs = index + 1, files, outputs
        write_sealed(self.folder / PROGRESS, {"finished": self.finished, "results": self.results,
                                              "files": files, "outputs": outputs})
        for old in self.folder.glob("hidden*.safetensors"):
            if old.name != outputs:
                old.unlink()

    def _save(self, name: str, tensors: dict, metadata: Optional[dict] = None) -> dict:
        """Write one file of the step; its record (size, sha256) for progress.json."""
        path = self.folder / name
        _save_tensors(tensors, path, metadata)
        return file_record(path)

    def layer_file(self, index: int) -> Optional[Path]:
        """The saved state of layer `index`, or None while it is not finished."""
        return self.folder / layer_file_name(index) if index < self.finished else None

    def restore(self, index: int, prefix: str, layer: nn.Module):
        if index >= self.finished:
            return None
        load_layer(prefix, layer, self.layer_file(index))
        hidden = None
        if index == self.finished - 1 and self.outputs not in (None, LOST):
            saved = load_file(str(self.folder / self.outputs))
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


def gguf_types(layer: nn.Module) -> dict[str, str]:
    return {n: m.scheme.type for n, m in layer.named_modules() if isinstance(m, GGUFLinear)}


def load_layer(prefix: str, layer: nn.Module, path: Path, device=None) -> None:
    """Load a layer saved by layer_tensors back into `layer` (quantized modules rebuilt), onto
    `device` (default: where its parameters are; a layer of a streamed skeleton is on meta)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: layer checkpoint missing; delete the resume folder")
    with safe_open(str(path), "pt") as f:  # one read: metadata and tensors
        qconfig = json.loads(f.metadata().get("qconfig") or "{}")
        gguf = json.loads(f.metadata().get("gguf") or "{}")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if device is None:
        device = next((p.device for p in layer.parameters()), torch.device("cpu"))
    for name, kind in gguf.items():  # GGUF modules keep their block bytes as plain buffers
        weight = tensors[f"{prefix}.{name}.weight"]
        scheme = GGUFScheme(kind)
        cols = weight.shape[1] // scheme.layout.type_size * scheme.block_size
        layer.set_submodule(name, GGUFLinear(cols, weight.shape[0], scheme, f"{prefix}.{name}.bias" in tensors).to(device))
    prefixes = set(ct.quantized_prefixes(tensors))
    for full in prefixes:
        module = ct.build_module(full, tensors, qconfig, str(path))
        layer.set_submodule(full[len(prefix) + 1:], module.to(device))
    floats = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.rpartition(".")[0] not in prefixes}
    result = layer.load_state_dict({k: v.to(device) for k, v in floats.items()}, strict=False, assign=True)
    quantized = {n for n, m in layer.named_modules() if ct.is_quantized(m)}
    missing = [k for k in result.missing_keys if k.rpartition(".")[0] not in quantized]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path}: does not match layer {prefix} (missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]}); delete the resume folder")


def _save_tensors(tensors: dict, path: Path, metadata: Optional[dict] = None) -> None:
    tmp = path.with_suffix(".tmp")
    write_part(tensors, tmp, metadata)  # no copy of the layer (save_file makes one): a streamed run's peak
    os.replace(tmp, path)
