"""Streamed runs: the model is never resident. A skeleton without weights holds the structure; each
step walks the decoder layers, loading each from the newest step folder of the resume directory
that finished it (else from the model's safetensors shards), and saves it there once done
(app/resume.py's StepLayers: those files are the run's state, so --resume continues streamed
runs too); the export then joins the last step's layers into the checkpoint (export/portions.py).

Memory: one decoder layer in the calibration dtype (float32) plus what the step keeps for it
(GPTQ: one Hessian per input, in² x 4 bytes), the calibration activations (walker.py) and, while
inputs are captured, the token embedding. A mixture's layer under GPTQ without true_sequential
holds one routed expert in float32 at a time (calibrate/deferred_experts.py) beside its quantized
ones and their Hessians; under rtn, rtn_mse and fp8 one expert linear, read as it is rounded.
Disk: one copy of the layers per step, in float32 where they stay float. The embedding, final
norm and LM head are read from the shards as they are: a streamed run leaves them unquantized
(lm_head must stay in `ignore`).
"""
from __future__ import annotations

import copy
import dataclasses
import re
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from lowbit.calibrate.deferred_experts import DeferredExperts
from lowbit.calibrate.arch import Arch, decoder_layers, matches_name
from lowbit.calibrate.checks import check_finite_weights, safetensors_files
from lowbit.calibrate.distributed import world
from lowbit.calibrate.hardware import available_memory_bytes
from lowbit.calibrate.model_config import check_model_source
from lowbit.calibrate.models import load_tokenizer, resolve_model_path
from lowbit.calibrate.layer_source import Portion
from lowbit.calibrate.observers_walked import walked_kv_absmax, walked_linear_input_absmax
from lowbit.calibrate.streaming import (ShardedWeights, buffers_to, check_weights_match, embedding_rows, empty_model,
                                        materialize, outer_modules, release, release_all)
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.registry import STEPS
from lowbit.quantize.steps.spec import LAYERS, MODEL, WALK
from lowbit.recipes.schema import Recipe

from .resume import StepLayers, load_layer

CALIBRATION_DTYPE = torch.float32  # as the resident load (models.DEFAULT_DTYPE): same figures
FIT_FRACTION = 0.8  # auto streams when the float32 model would take more of the free memory


class StreamedLayers:
    """walker.LayerSource over the shards and the layers earlier steps finished (newest first).
    With defer_experts, a layer read from the shards leaves its routed experts on meta, each read
    when it runs or is solved (calibrate/deferred_experts.py): for steps that never write a float
    expert weight back."""

    def __init__(self, model: nn.Module, arch: Arch, weights: ShardedWeights, stores: list[StepLayers],
                 defer_experts: bool = False):
        self.model, self.arch, self.weights, self.stores = model, arch, weights, list(stores)
        self.defer_experts, self.deferred = defer_experts, None

    def load(self, index: int, prefix: str, layer: nn.Module, device) -> None:
        saved = next((s.layer_file(index) for s in reversed(self.stores) if s.layer_file(index)), None)
        if saved is not None:
            load_layer(prefix, layer, saved, device)
            layer.to(device)  # buffers the skeleton computed (not stored) follow the weights
        else:
            self._read(layer, prefix, device)
            buffers_to(layer, device)  # as above; the weights were read onto it (deferred ones stay on meta)

    def _read(self, layer: nn.Module, prefix: str, device) -> None:
        def read(module: nn.Module, name: str, skip: frozenset = frozenset()) -> None:
            materialize(self.model, module, name, self.weights, CALIBRATION_DTYPE, device, skip)
            try:
                check_finite_weights(module)
            except ValueError as err:
                raise ValueError(f"{self.weights.folder}, layer {prefix}: {err}") from None

        skip = frozenset(DeferredExperts.deferred(layer)) if self.defer_experts else frozenset()
        read(layer, prefix, skip)
        if skip:
            # an expert's weights are tied to nothing outside its layer: the layer's parameters are all to search
            self.deferred = DeferredExperts(layer, prefix, read, lambda module: release(layer, module))

    def fetch(self, layer: nn.Module, names: list[str]) -> None:
        """The named linears' weights, where the load deferred them (a solve reads them)."""
        if self.deferred is not None and self.deferred.layer is layer:
            self.deferred.fetch(names)

    def settle(self, layer: nn.Module) -> None:
        """The layer whole again: experts still deferred are read (the step is done with the layer)."""
        if self.deferred is not None and self.deferred.layer is layer:
            self.deferred.settle()
            self.deferred = None

    def unload(self, index: int, prefix: str, layer: nn.Module) -> None:
        self.settle(layer)  # its hooks go with it
        release_all(self.model, layer)

    def outer_names(self) -> list[str]:
        return [name for name, _ in outer_modules(self.model, self.arch.layers)]

    def portions(self, count: int) -> list[Portion]:
        """An export's passes: each module outside the layers alone, then each layer alone."""
        return [Portion([], [name]) for name in self.outer_names()] + [Portion([i], []) for i in range(count)]

    @contextmanager
    def outer(self, device, dtype=None, names=None, tokens=None):
        """The embedding, final norm and head (never changed by a streamed run) from the shards, in
        `dtype` (default the calibration dtype); `names` picks some of them (default all). Given
        `tokens` (an input capture, which stops before the head): an untied head is left out and
        the input embedding holds only the rows of those tokens (embedding_rows)."""
        modules = [(n, m) for n, m in outer_modules(self.model, self.arch.layers) if names is None or n in names]
        embedding = self.model.get_input_embeddings() if tokens is not None else None
        if embedding is not None:
            head = self.model.get_output_embeddings()
            modules = [(n, m) for n, m in modules if m is not head and m is not embedding]
        buffers_to(self.model, device)
        for name, module in modules:
            materialize(self.model, module, name, self.weights, dtype or CALIBRATION_DTYPE, device)
        try:
            with (embedding_rows(self.model, embedding, self.weights, tokens, dtype or CALIBRATION_DTYPE, device)
                  if embedding is not None else nullcontext()):
                yield
        finally:
            for _, module in modules:
                release_all(self.model, module)


def streaming_folder(recipe: Recipe) -> Optional[str]:
    """The model folder to stream from, or None for a resident run; calibration.streaming true
    refuses what cannot stream, auto streams only what would not fit in memory."""
    mode = recipe.calibration.streaming
    if mode is False:
        return None
    folder = Path(resolve_model_path(recipe.model))
    why = _cannot_stream(recipe, folder)
    if why:
        if mode is True:
            raise ValueError(f"calibration.streaming: {why}")
        return None
    if mode is True:
        return str(folder)
    need = ShardedWeights(folder).numel() * CALIBRATION_DTYPE.itemsize
    free = available_memory_bytes()
    streams = free is not None and need > FIT_FRACTION * free
    if streams:
        print(f"[lowbit] {recipe.model}: {need / 2**30:.1f} GiB in float32 would not fit in "
              f"{free / 2**30:.1f} GiB free; streaming one decoder layer at a time", file=sys.stderr)
    return str(folder) if streams else None


def _cannot_stream(recipe: Recipe, folder: Path) -> str:
    if world().size > 1:
        return "a streamed run is one process for now (under --nproc / torchrun every rank loads the model)"
    if not folder.is_dir():
        return (f"{recipe.model} is not a local folder; streaming reads safetensors shards (download it "
                "first, e.g. `hf download NAME --local-dir DIR`, and pass --model DIR)")
    if not safetensors_files(folder):
        return f"{folder} has no safetensors weights to stream"
    if not matches_name("lm_head", recipe.ignore):
        return "a streamed run leaves the LM head unquantized; keep lm_head in `ignore`"
    for i, step in enumerate(recipe.steps):
        mode = STEPS[step.name].streamed(step.config)
        if mode not in (WALK, LAYERS, MODEL):
            return f"steps[{i}].{step.name} cannot run streamed: {mode}"
    return ""


def load_skeleton(recipe: Recipe, folder: str):
    """(skeleton model, tokenizer, its weights, seconds): nothing of the weights is read, but their
    names and shapes are checked against the skeleton before any calibration."""
    start = time.perf_counter()
    check_model_source(folder, recipe.trust_remote_code)  # a decoder LM, its own code allowed: before it runs
    tokenizer = load_tokenizer(folder, recipe.trust_remote_code)
    model = empty_model(folder, CALIBRATION_DTYPE, recipe.trust_remote_code)
    weights = ShardedWeights(folder, model)
    check_weights_match(model, weights)
    return model, tokenizer, weights, time.perf_counter() - start


class StreamedRun:
    """A streamed run's layers (stepping.RunLayers): each step reads them from the shards or from the
    newest step folder that finished them, and keeps each one it finishes (the resume folder is the
    only place a finished layer lives); a step that walks no data runs one resident layer at a time."""

    def __init__(self, model: nn.Module, arch: Arch, weights: ShardedWeights, progress):
        self.model, self.arch, self.weights, self.progress = model, arch, weights, progress

    def store(self, index: int) -> StepLayers:
        return self.progress.step(index, required=True)

    def source(self, step, stores: list) -> StreamedLayers:
        return StreamedLayers(self.model, self.arch, self.weights, stores, defers_experts(step))

    def apply(self, ctx: StepContext, step) -> dict:
        spec = STEPS[step.name]
        ctx.observed = observe(ctx, spec.observes(step.config))
        if spec.streamed(step.config) in (WALK, MODEL):  # a walk loads its layers; a MODEL step needs none resident
            return spec.apply(ctx, step.config)
        return apply_per_layer(spec, step.config, ctx)

    def finished(self, stores: list) -> StreamedLayers:
        return StreamedLayers(self.model, self.arch, self.weights, stores)


def defers_experts(step) -> bool:
    """GPTQ without true_sequential reads each float expert only to run and to solve it, and a
    data-free weight step (rtn, rtn_mse, fp8) only to round it; neither writes a float weight back
    (every linear done is replaced): their layers can leave the experts on meta until then."""
    spec = STEPS[step.name]
    if spec.streamed(step.config) == LAYERS and spec.writes(step.config) is not None:
        return True
    return step.name == "gptq" and not step.config.true_sequential


def observe(ctx: StepContext, kind: Optional[str]) -> dict:
    """What the step reads through ctx.linear_input_absmax / kv_absmax, by a streamed layer walk
    over the model as the steps before left it."""
    if kind is None:
        return {}
    observer = {"linear_inputs": walked_linear_input_absmax, "kv": walked_kv_absmax}[kind]
    return {kind: observer(ctx.model, ctx.arch, ctx.batches, ctx.layer_source, ctx.device, offload=ctx.offload)}


def apply_per_layer(spec, cfg, ctx: StepContext) -> dict:
    """A step that needs no data, applied to one resident layer at a time (the other layers are
    out of its reach through its ignore list), each layer saved once done; records merged."""
    records, layers = [], decoder_layers(ctx.model, ctx.arch)
    for i, layer in enumerate(layers):
        prefix = f"{ctx.arch.layers}.{i}"
        ctx.layer_source.load(i, prefix, layer, ctx.device)
        restored = ctx.layer_store.restore(i, prefix, layer)
        if restored is None:
            scoped = dataclasses.replace(ctx, ignore=ctx.ignore + (f"re:(?!{re.escape(prefix)}\\.).*",),
                                         read_deferred=_deferred_reader(ctx.layer_source, prefix, layer))
            record = spec.apply(scoped, cfg)
            ctx.layer_source.settle(layer)  # experts the step left float are read before the layer is saved
            ctx.layer_store.save(i, prefix, layer, record, None)
        else:
            record = restored[0]
        records.append(_in_layer(record, prefix, ctx.ignore))
        ctx.layer_source.unload(i, prefix, layer)
    return merge_records(records)


def _deferred_reader(source: StreamedLayers, prefix: str, layer: nn.Module):
    """Reads a linear of `layer` (by its full name) that the load left on meta."""
    return lambda name: source.fetch(layer, [name.removeprefix(prefix + ".")])


def _in_layer(record: dict, prefix: str, ignore: tuple[str, ...]) -> dict:
    """The record without the entries the layer scope added (other layers' linears 'ignored')."""
    ignored = record.get("ignored")
    if not isinstance(ignored, dict):
        return record
    kept = {n: why for n, why in ignored.items() if n.startswith(prefix + ".") or matches_name(n, ignore)}
    return {**record, "ignored": kept}


def merge_records(records: list[dict]) -> dict:
    """Per-layer records as one: lists joined, mappings merged, other values as the first layer's."""
    merged: dict = {}
    for record in records:
        for key, value in record.items():
            if key not in merged:
                merged[key] = copy.copy(value)  # lists and mappings are extended below, not shared
            elif isinstance(value, list):
                merged[key] += value
            elif isinstance(value, dict):
                merged[key].update(value)
    return merged
