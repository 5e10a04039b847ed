"""What a run and the ranks that calibrate beside it share: the stage timer, each rank's calibration
samples, and one step applied with its experts calibrated as the recipe says."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager

import torch

from lowbit.calibrate.data import calibration_batches
from lowbit.calibrate.distributed import SHARE_UNIT, sample_share, world
from lowbit.calibrate.experts import calibrating
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


def apply_step(recipe: Recipe, ctx: StepContext, step) -> dict:
    """One step of the recipe, its experts calibrated as the recipe says (every rank alike)."""
    with calibrating(recipe.calibration.experts()):
        return STEPS[step.name].apply(ctx, step.config)


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
