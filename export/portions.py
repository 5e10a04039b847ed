"""Export a run's model a portion at a time, as its LayerSource hands it out: a streamed run's
skeleton (every module as the run left it, tensors on the meta device) one decoder layer at a time,
a resident model (calibrate/layer_source.py's MemoryLayers) in one portion. Every run exports this way.

The format's own write() runs once per portion of the model, with the other decoder layers taken
out of the tree (the layer list becomes a mapping of the resident layers alone, so names do not
change) and its weights diverted to a part file: for a streamed model first what lies outside the
layers (embedding, final norm, head), then each layer. A last pass over the whole skeleton writes
config.json, the tokenizer and the rest, and the parts become model.safetensors (joined) or
model.gguf (formats/gguf/parts.py), byte for byte what writing the whole model at once writes.
A check (the run's audit) sees each portion before its tensors are written. Memory: a portion and
the outer tensors; disk: the parts, then the file. A source whose one portion is the whole model
(a resident run's) is written at once: no part files.
"""
from __future__ import annotations

import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from lowbit.calibrate.arch import Arch, decoder_layers
from lowbit.calibrate.layer_source import LayerSource, Portion

from .config import ExportConfig
from .formats.gguf.parts import GGUFParts, Positions, gguf_parts_in
from .formats.hf_folder import WEIGHTS, weights_to
from .formats.registry import FORMATS
from .safetensors_join import join_safetensors, write_part
from .staging import write_staged


# what a portion pass may do besides collecting tensors: audit the resident modules, for instance
PortionCheck = Callable[[nn.Module, Portion], None]


def save_in_portions(model: nn.Module, tokenizer, out_dir: str | Path, cfg: ExportConfig, arch: Arch,
                     source: LayerSource, extra_files: Optional[dict[str, str]] = None,
                     check: Optional[PortionCheck] = None, overwrite: bool = False) -> Path:
    """Write the checkpoint of the model `source` hands out into out_dir, atomically (as checkpoint.save)."""
    out_dir = Path(out_dir)
    portions = source.portions(len(decoder_layers(model, arch)))

    def write(staging: Path) -> None:
        if len(portions) == 1:  # the whole model at hand: written at once, no part files (no extra disk)
            with holding(model, cfg, arch, source, portions[0]):
                if check is not None:
                    check(model, portions[0])
                FORMATS[cfg.format].write(model, tokenizer, staging, cfg, extra_files or {})
            return
        gguf = GGUFParts(Positions.of(model))  # from the whole model: each tensor's place in a .gguf
        with tempfile.TemporaryDirectory(dir=staging.parent, prefix=f".{out_dir.name}.parts-") as tmp:
            with gguf_parts_in(gguf):
                parts = _write_parts(model, cfg, arch, source, portions, Path(tmp), check, gguf)
                metadata = _write_rest(model, tokenizer, staging, cfg, extra_files or {})
            if not gguf.parts:  # model.gguf was written from its parts by the last pass
                join_safetensors(parts, staging / WEIGHTS, metadata)

    return write_staged(out_dir, overwrite, extra_files, write)


@contextmanager
def holding(model, cfg: ExportConfig, arch: Arch, source: LayerSource, portion: Portion):
    """Inside the block the model holds the portion's layers and outer modules, read from the
    source, and no other layer. Outer modules are read in the dtype the format casts them to (the
    same values), so a 128k-vocabulary embedding is held once, not twice."""
    layers = decoder_layers(model, arch)
    for i in portion.layers:
        source.load(i, f"{arch.layers}.{i}", layers[i], "cpu")
    try:
        whole = len(portion.layers) == len(layers)  # the model as it is: no layer list swapped
        with (source.outer("cpu", FORMATS[cfg.format].outer_dtype(cfg), portion.outer) if portion.outer
              else nullcontext(), nullcontext() if whole else only_layers(model, arch, layers, portion.layers)):
            yield
    finally:
        for i in portion.layers:
            source.unload(i, f"{arch.layers}.{i}", layers[i])


def _write_parts(model, cfg: ExportConfig, arch: Arch, source: LayerSource, portions: list[Portion], tmp: Path,
                 check: Optional[PortionCheck], gguf: GGUFParts) -> list[Path]:
    parts, written = [], set()
    for k, portion in enumerate(portions):
        with holding(model, cfg, arch, source, portion):
            parts.append(_part(model, cfg, tmp / f"part{k}.safetensors", check, portion, written, gguf))
    return parts


def _part(model, cfg: ExportConfig, path: Path, check: Optional[PortionCheck], portion: Portion,
          written: set, gguf: GGUFParts) -> Path:
    """The format's tensors of the resident part of the model (those no earlier part holds: a
    tied head is the embedding), saved to `path`."""
    if check is not None:
        check(model, portion)
    collected: dict = {}
    with (tempfile.TemporaryDirectory() as scratch, weights_to(lambda tensors, _, __: collected.update(tensors)),
          gguf.collect(path)):
        FORMATS[cfg.format].write(model, None, Path(scratch), cfg, {})
    if gguf.parts and gguf.parts[-1] == path:
        return path  # the format wrote its own part (GGUF)
    if not collected:
        raise ValueError(f"export format {cfg.format!r} cannot be written a portion at a time (it writes "
                         "no model.safetensors); use compressed-tensors, gptq, dense or gguf")
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
