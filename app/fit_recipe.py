"""A recipe with a budget (`fit:`) becomes the plan it stands for before the run starts: the same
measurement and solve as `lowbit fit` (sensitivities from the cache where measured before), the
plan's formats as the recipe's scheme, its KV format as a kv_cache step."""
from __future__ import annotations

import gc
import sys

import torch

from lowbit.calibrate.models import load_model
from lowbit.recipes.schema import Recipe, parse_recipe

from .fit_plan import fit, plan_recipe


def resolve_fit(recipe: Recipe) -> Recipe:
    """The recipe with its `fit:` budget replaced by a plan; unchanged without one. The recipe's
    own steps quantize to the plan (a gptq step as w4a16-gptq runs it where it gives none)."""
    if recipe.fit is None:
        return recipe
    model, tokenizer, _ = load_model(recipe.model, torch.float32, trust_remote_code=recipe.trust_remote_code,
                                     allow_pickle=recipe.allow_pickle)
    result = fit(model, tokenizer, recipe.model, recipe.fit)
    del model
    gc.collect()
    plan = plan_recipe(recipe.fit, result, recipe.model)
    data = recipe.to_dict()
    data.pop("fit", None)
    data["scheme"] = plan["scheme"]
    steps = [{name: {k: v for k, v in (options or {}).items() if k != "scheme"}}  # the plan's scheme, shared
             for step in data["steps"] for name, options in step.items()] or plan["steps"][:1]
    if result.kv != "f16" and not any("kv_cache" in step for step in steps):
        steps.append(plan["steps"][-1])
    data["steps"] = steps
    data["export"]["format"] = recipe.fit.format
    for key, value in plan.get("evaluate", {}).get("memory", {}).items():  # the budget's prefill, measured
        data["evaluate"]["memory"][key] = value
    data["description"] = plan["description"] + (f"; {recipe.description}" if recipe.description else "")
    s = result.summary()
    print(f"[lowbit] fit: {s['bits_per_weight']:.3f} bits per weight over {s['linears']} linears "
          f"({', '.join(f'{k} {n}' for k, n in sorted(s['type_counts'].items()))}), KV cache {result.kv}, "
          f"predicted summed KL {s['predicted_kl_sum']:.4g}", file=sys.stderr)
    return parse_recipe(data, f"{recipe.name} (fit: the plan)")
