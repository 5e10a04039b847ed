"""The grid protocol, and where a target sits when a plan picks its grid.

A *grid* is one linear's number format (IntScheme, FP8Scheme, MXScheme, GGUFScheme). It says
- `FAMILY`: its key in the registries (runtime module: quantize/runtime/modules.py; GPTQ solver:
  quantize/steps/gptq_solver.py; AWQ clip search: quantize/steps/awq.py);
- `takes_inputs(inputs)`: which input quantization it pairs with; `describe(inputs)`;
- `round(w, name)`: round-to-nearest, a weight whose `FAMILY` builds its runtime module;
- `search_groups(w)` and `fake_round(w, name)`: the slices a search judges together, and the
  rounded-and-back weight it judges;
- `stacks_rows()`: whether GPTQ may solve linears that share an input as one matrix of stacked
  rows (no scale spans two of them);
- `sweep_view(w)`, where GPTQ fixes the scales from w before its sweep (fp8, mxfp4): `per_element` scales
  (rows, cols; stride 0 along columns where every column shares them), `snap(w, scale)` onto the
  grid, and `weight(swept)` from the swept values;
- `stored_bytes(rows, cols)`: the bytes a (rows, cols) weight takes in a checkpoint, scales included
  (`lowbit fit` weighs candidates by it);
- `largest_stored()`: the largest weight magnitude it can store (a GGUF block scale is fp16), or None
  where it has no limit of its own (app/preflight.py refuses a weight past it before any step runs);
- on its class, `named(name)`: the grid a per-linear plan's format name gives (`int4_g128`,
  `fp8_e4m3`, `mxfp4`), else None, and `NAME_FORMS`, those names as an error message lists them
  (quantize/grids/formats.py asks both);
and its runtime module answers the audit (`holds`, `audit`).

A *plan* is what a recipe's `scheme:` names (one grid, a format per linear, a llama.cpp file type):
- `assign(slots)`: each target's grid, or why it stays 16-bit, refusing a grid a target cannot take
  before anything changes;
- `record(grids)`: what the step's results say of the assignment;
- `embedding_grid(cols, tied)`: the token embedding's grid in a GGUF file, if the plan has a rule;
- `scales_per_row()`: whether every row has scales of its own (what GPTQ and AWQ need);
- `searchable()`: whether `search_groups` slices every grid it gives (AWQ's clip search; FP8 block
  scales span rows);
- `orders_groups()`: whether GPTQ may form groups in the Hessian's order (actorder group: only
  integer groups, whose g_idx carries the order).
A plan of several grids (a format per linear) also lists them, `grids()`, which export.target's check
(recipes/runtime_targets.py) judges before the model is loaded.
A single grid is a plan that gives itself to every target. Steps ask these; they never branch on a
grid's class (tests/test_grid_seam.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Slot:
    """A target linear as a plan sees it."""

    name: str  # full module name, e.g. model.layers.3.mlp.experts.5.down_proj
    cols: int  # in_features: the rows a grid cuts into groups or blocks
    layer: Optional[int]  # its decoder layer's index; None outside the decoder layers (lm_head)
    layers: int  # decoder layers in the model
    gqa: int = 1  # query heads per key/value head (llama.cpp's file types give attn_v more bits where >= 4)


Assignment = tuple[dict, dict]  # (name -> grid, name -> why it stays 16-bit)
