"""What a run and the ranks that calibrate beside it share: the stage timer, each rank's calibration
samples, and the one loop that applies a recipe's steps over the run's layers, wherever they are
(ResidentLayers here; a streamed run's in streamed.py): one walk, one audit and one export follow."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Optional, Protocol

import torch
from torch import nn

from lowbit.calibrate.arch import Arch
from lowbit.calibrate.data import calibration_batches
from lowbit.calibrate.distributed import SHARE_UNIT, sample_share, world
from lowbit.calibrate.experts import calibrating
from lowbit.calibrate.layer_source import LayerSource, LayerStore, MemoryLayers
from lowbit.calibrate.models import load_model
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.registry import STEPS
from lowbit.recipes.schema import Recipe


def timer(seconds: dict):
    """`with timed(key):` adds the block's wall time to seconds[key] (blocks may repeat)."""
    @contextmanager
    def timed(key: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start
    return timed


class RunLayers(Protocol):
    """Where a run's decoder layers are while its steps walk them."""

    def store(self, index: int) -> Optional[LayerStore]:
        """Where step `index` keeps each layer it finishes (resume), or None."""

    def source(self, step, stores: list) -> LayerSource:
        """Where step `step` loads each layer from, given the stores of the steps before it."""

    def apply(self, ctx: StepContext, step) -> dict:
        """Run the step; what it did."""

    def finished(self, stores: list) -> LayerSource:
        """Where the export and the audit read the layers once every step is done."""


class ResidentLayers:
    """The model in memory: each step walks it where it is (MemoryLayers, the walker's own default)."""

    def __init__(self, model: nn.Module, arch: Arch, store_for: Callable[[int], Optional[LayerStore]]):
        self.memory, self.store_for = MemoryLayers(model, arch), store_for

    def store(self, index: int) -> Optional[LayerStore]:
        return self.store_for(index)

    def source(self, step, stores: list) -> LayerSource:
        return self.memory

    def apply(self, ctx: StepContext, step) -> dict:
        return STEPS[step.name].apply(ctx, step.config)

    def finished(self, stores: list) -> LayerSource:
        return self.memory


def apply_steps(recipe: Recipe, ctx: StepContext, layers: RunLayers, timed) -> tuple[list[dict], LayerSource]:
    """Each step of the recipe in order over `layers`, its experts calibrated as the recipe says (every
    rank alike); (what each did, the source the export and the audit read from)."""
    stores, steps = [], []
    for index, step in enumerate(recipe.steps):
        ctx.layer_store = layers.store(index)
        ctx.layer_source = layers.source(step, stores)
        start = time.perf_counter()
        with timed("quantize_s"), calibrating(recipe.calibration.experts()):
            detail = layers.apply(ctx, step)
        steps.append({"name": step.name, "seconds": time.perf_counter() - start, **detail})
        stores.append(ctx.layer_store)
    return steps, layers.finished(stores)


def float_model(recipe: Recipe) -> Callable[[], nn.Module]:
    """Loads the recipe's model again, as it was before any step (the evaluation's baseline, distill's teacher)."""
    return lambda: load_model(recipe.model, trust_remote_code=recipe.trust_remote_code,
                              allow_pickle=recipe.allow_pickle)[0]


def stored_dtype(recipe: Recipe) -> torch.dtype:
    """The dtype the checkpoint holds float tensors and scales in (steps that learn them round to it)."""
    return getattr(torch, recipe.export.dtype)


def rank_samples(recipe: Recipe, tokenizer, timed) -> torch.Tensor:
    """This rank's share of the recipe's calibration samples (all of them in one process)."""
    with timed("calibrate_s"):
        print(f"[lowbit] calibration data: {recipe.calibration.samples} samples × "
              f"{recipe.calibration.seq_len} tokens of {recipe.calibration.dataset!r}", file=sys.stderr)
        batches = calibration_batches(recipe.calibration, tokenizer)
        share = sample_share(len(batches), SHARE_UNIT)  # all of them in one process
        if world().size > 1:
            print(f"[lowbit] {world().describe()} calibrates on samples {share.start}-{share.stop - 1}",
                  file=sys.stderr)
        return batches[share]
