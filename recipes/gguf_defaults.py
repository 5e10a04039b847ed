"""A GGUF export of a recipe that quantized to a llama.cpp file type gives the token embedding the
type llama.cpp's rules give it under that file type (tied: the output's, Q6_K or Q8_0; untied: the
base type), unless the recipe's export section names one."""
from __future__ import annotations

import dataclasses

from torch import nn

from lowbit.export.config import ExportConfig
from lowbit.quantize.grids.gguf_plan import GGUFTypes, embedding_type
from lowbit.quantize.steps.registry import STEPS

from .schema import Recipe


def recipe_file_type(recipe: Recipe) -> GGUFTypes | None:
    for step in recipe.steps:
        writes = STEPS[step.name].writes(step.config)
        if writes is not None and isinstance(writes.weights, GGUFTypes):
            return writes.weights
    return None


def export_config(recipe: Recipe, model: nn.Module) -> ExportConfig:
    cfg, types = recipe.export, recipe_file_type(recipe)
    if cfg.format != "gguf" or types is None or cfg.embedding_type is not None:
        return cfg
    embedding = model.get_input_embeddings().weight
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return dataclasses.replace(cfg, embedding_type=embedding_type(types, embedding.shape[1], tied))
