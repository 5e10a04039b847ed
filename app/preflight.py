"""Checks run right after the model loads, so a run that cannot finish fails before any work."""
from __future__ import annotations

import torch

from lowbit.calibrate.arch import arch_for, linear_weight, target_linears
from lowbit.calibrate.checks import check_finite_weights
from lowbit.evaluate.perplexity import bos_id
from lowbit.export.formats.gguf.names import arch_of, stacked_name
from lowbit.quantize.targets import is_ignored, select_targets, slots
from lowbit.recipes.gguf_defaults import recipe_plan


def preflight(recipe, model, tokenizer) -> None:
    check_finite_weights(model)  # NaN/inf weights: every scale would be NaN (streamed: per layer, as read)
    check_storable(recipe, model)
    preflight_settings(recipe, model, tokenizer)


def check_storable(recipe, model) -> None:
    """Refuse a targeted weight past what its grid can store (a GGUF block scale is fp16: Q4_0 holds
    magnitudes up to 8 x 65504), naming it, before any step runs: found by the audit, it cost the
    whole run. Weights only: a step that rescales them (AWQ) is still checked by the audit."""
    plan = recipe_plan(recipe)
    if plan is None:
        return
    arch = arch_for(model)
    targets = select_targets(model, arch, recipe.ignore)
    grids, _ = plan.assign(slots(model, arch, targets.linears))
    for name, grid in grids.items():
        limit, weight = grid.largest_stored(), linear_weight(targets.linears[name]).detach()
        if limit is None or weight.is_meta:  # meta: an expert read later (streamed)
            continue
        low, high = torch.aminmax(weight)  # no copy of the weight, as abs() would make
        if max(-float(low), float(high)) > limit:
            row, col = (weight.abs() > limit).nonzero()[0].tolist()
            raise ValueError(f"{name}: weight [{row}, {col}] is {float(weight[row, col]):g}, beyond the largest "
                             f"magnitude {grid.describe()} can store, {limit:g} (its scales would overflow); fix "
                             f"the source weight, or keep this linear 16-bit with ignore: [{name}]")


def preflight_settings(recipe, model, tokenizer) -> None:
    """What needs no weights (a streamed run checks those per layer, as they are read)."""
    if recipe.evaluate.perplexity.bos:
        bos_id(tokenizer)  # raises, naming evaluate.perplexity.bos, if the tokenizer has no BOS/EOS
    if recipe.export.format == "gguf":  # an architecture or routing llama.cpp cannot run
        arch_of(model.config, "the recipe's export (format: gguf)")
        check_one_type_per_experts(recipe, model)


def check_one_type_per_experts(recipe, model) -> None:
    """llama.cpp stores a layer's experts as one tensor of one type: a plan (scheme.types, `lowbit
    fit`) or an ignore list that splits them fails here, not after the quantization."""
    plan = recipe_plan(recipe)
    if plan is None:
        return
    arch = arch_for(model)
    names = list(target_linears(model, arch))
    grids, _ = plan.assign(slots(model, arch, names))
    by_stack: dict[str, dict[str, str]] = {}
    for name in names:
        stacked = stacked_name(f"{name}.weight")
        if stacked is not None:
            kind = grids[name].describe() if name in grids else "16-bit"
            kind = "16-bit (ignored)" if is_ignored(name, recipe.ignore) else kind
            by_stack.setdefault(stacked[0], {})[name] = kind
    for stack, kinds in by_stack.items():
        values = list(kinds.values())
        if len(set(values)) > 1:
            usual = max(set(values), key=values.count)
            found = ", ".join(f"{name}: {kind}" for name, kind in kinds.items() if kind != usual)
            raise ValueError(f"scheme.types / ignore: llama.cpp stores the experts of {stack.removesuffix('.weight')} "
                             f"as one tensor of one type; these differ from the others' {usual}: {found}")
