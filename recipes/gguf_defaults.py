"""A GGUF export gives the token embedding the grid the recipe's plan gives it (under a llama.cpp file
type, llama.cpp's rule: tied, the output's Q6_K or Q8_0; untied, the base type), unless the recipe's
export section names one."""
from __future__ import annotations

import dataclasses

from torch import nn

from lowbit.export.config import ExportConfig
from lowbit.quantize.steps.registry import STEPS

from .schema import Recipe


def recipe_plan(recipe: Recipe):
    """The plan (`scheme:`) of the recipe's first weight step: the one that quantizes every target."""
    for step in recipe.steps:
        writes = STEPS[step.name].writes(step.config)
        if writes is not None:
            return writes.weights
    return None


def export_config(recipe: Recipe, model: nn.Module) -> ExportConfig:
    cfg, plan = recipe.export, recipe_plan(recipe)
    if cfg.format != "gguf" or plan is None or cfg.embedding_type is not None:
        return cfg
    embedding = model.get_input_embeddings().weight
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    grid = plan.embedding_grid(embedding.shape[1], tied)
    return cfg if grid is None else dataclasses.replace(cfg, embedding_type=grid.type)
