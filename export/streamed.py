"""Export a model that is never resident: the skeleton (every module as the run left it, tensors on
the meta device) and a LayerSource that loads one finished decoder layer at a time.

The format's own write() runs once per portion of the model, with the other decoder layers taken
out of the tree (the layer list becomes a mapping of the resident layer alone, so names do not
change) and its weights diverted to a part file: first what lies outside the layers (embedding,
final norm, head), then each layer. A last pass over the whole skeleton writes config.json, the
tokenizer and the rest, and the parts are joined into model.safetensors, byte for byte what the
resident export writes. Memory: one layer and the outer tensors; disk: the parts, then the file.
"""
from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from lowbit.calibrate.arch import Arch, decoder_layers
from lowbit.calibrate.walker import LayerSource

from .checkpoint import write_staged
from .config import ExportConfig
from .formats.hf_folder import WEIGHTS, weights_to
from .formats.registry import FORMATS
from .safetensors_join import join_safetensors, write_part

# what a portion pass may do besides collecting tensors: audit the resident modules, for instance
PortionCheck = Callable[[nn.Module, list[int]], None]


def save_streamed(model: nn.Module, tokenizer, out_dir: str | Path, cfg: ExportConfig, arch: Arch,
                  source: LayerSource, extra_files: Optional[dict[str, str]] = None,
                  check: Optional[PortionCheck] = None, overwrite: bool = False) -> Path:
    """Write the checkpoint of a streamed model into out_dir, atomically (as checkpoint.save)."""
    out_dir = Path(out_dir)

    def write(staging: Path) -> None:
        with tempfile.TemporaryDirectory(dir=staging.parent, prefix=f".{out_dir.name}.parts-") as tmp:
            parts = _write_parts(model, cfg, arch, source, Path(tmp), check)
            metadata = _write_rest(model, tokenizer, staging, cfg, extra_files or {})
            join_safetensors(parts, staging / WEIGHTS, metadata)

    return write_staged(out_dir, overwrite, extra_files, write)


def _write_parts(model, cfg: ExportConfig, arch: Arch, source: LayerSource, tmp: Path,
                 check: Optional[PortionCheck]) -> list[Path]:
    layers = decoder_layers(model, arch)
    parts, written = [], set()
    # the modules outside the layers one at a time, read in the export dtype (the resident export
    # casts them to it: the same values), so a 128k-vocabulary embedding is held once, not twice
    for k, name in enumerate(source.outer_names()):
        with source.outer("cpu", getattr(torch, cfg.dtype), [name]), only_layers(model, arch, layers, []):
            parts.append(_part(model, cfg, tmp / f"outer{k}.safetensors", check, [], written))
    for i, layer in enumerate(layers):
        source.load(i, f"{arch.layers}.{i}", layer, "cpu")
        try:
            with only_layers(model, arch, layers, [i]):
                parts.append(_part(model, cfg, tmp / f"layer{i}.safetensors", check, [i], written))
        finally:
            source.unload(i, f"{arch.layers}.{i}", layer)
    return parts


def _part(model, cfg: ExportConfig, path: Path, check: Optional[PortionCheck], resident: list[int],
          written: set) -> Path:
    """The format's tensors of the resident part of the model (those no earlier part holds: a
    tied head is the embedding), saved to `path`."""
    if check is not None:
        check(model, resident)
    collected: dict = {}
    with tempfile.TemporaryDirectory() as scratch, weights_to(lambda tensors, _, __: collected.update(tensors)):
        FORMATS[cfg.format].write(model, None, Path(scratch), cfg, {})
    if not collected:
        raise ValueError(f"export format {cfg.format!r} cannot be written streamed (it writes no "
                         "model.safetensors); use compressed-tensors, gptq or dense, or "
                         "calibration.streaming=false")
    tensors = {n: t for n, t in collected.items() if not t.is_meta and n not in written}
    written.update(tensors)
    write_part(tensors, path)
    return path


def _write_rest(model, tokenizer, staging: Path, cfg: ExportConfig, extra_files: dict[str, str]) -> dict:
    """config.json, tokenizer, generation config and extra files from the whole skeleton; returns
    the weights' metadata the format asked for."""
    seen: dict = {}
    # every tensor is on meta here: new ones (packing's shift tables) must be too; none is kept
    with weights_to(lambda tensors, _, metadata: seen.update(metadata or {}), tensors=False), torch.device("meta"):
        FORMATS[cfg.format].write(model, tokenizer, staging, cfg, extra_files)
    return seen


class LayerSubset(nn.ModuleDict):
    """Some decoder layers under their own indices: iterated like the layer list it stands for."""

    def __iter__(self):
        return iter(self.values())


@contextmanager
def only_layers(model: nn.Module, arch: Arch, layers: nn.ModuleList, keep: list[int]):
    """Inside the block the model holds only decoder layers `keep`, under their own names."""
    owner_path, _, attr = arch.layers.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    owner._modules[attr] = LayerSubset({str(i): layers[i] for i in keep})
    try:
        yield
    finally:
        owner._modules[attr] = layers
