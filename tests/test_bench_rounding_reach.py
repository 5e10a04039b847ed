"""bench/rounding_reach.py: its error is the output error on the inputs, its reach is what an offset
in [-0.5, 0.5] can express, and it measures a tiny model's layers."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from export_helpers import token_ids
from tiny_models import make_tiny_model
from lowbit.quantize.grids.integer import IntScheme, quantize_rtn
from lowbit.quantize.steps.gptq import GPTQConfig
from lowbit.quantize.steps.gptq_solver import solve_onto

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import rounding_reach  # noqa: E402

GRID = IntScheme(3, True, "group", 32)


def test_the_error_from_the_hessian_is_the_output_error_on_the_inputs():
    gen = torch.Generator().manual_seed(0)
    X, W = torch.randn(500, 64, generator=gen), torch.randn(16, 64, generator=gen)
    Wq = quantize_rtn(W, GRID).dequantize().float()
    H = 2 / len(X) * X.T @ X
    direct = float((X @ (Wq - W).T).pow(2).sum(dim=1).mean())
    assert rounding_reach.output_error(Wq, W, H) == pytest.approx(direct, rel=1e-4)


def test_gptq_codes_leave_signrounds_reach_only_where_inputs_correlate():
    """With H = I GPTQ has no error to pass on and every code is the weight's nearest (on its own
    scale); with correlated inputs it moves codes further than half a step."""
    gen = torch.Generator().manual_seed(1)
    W = torch.randn(32, 128, generator=gen)
    cfg = GPTQConfig(GRID, actorder="static", dampening_frac=0.1, scale_search="mse")
    alone = solve_onto(GRID, W.clone(), torch.eye(128), cfg)
    assert rounding_reach.within_reach(alone, W) == 1.0
    X = torch.randn(2000, 128, generator=gen) @ (torch.randn(128, 128, generator=gen) / 8 + torch.eye(128))
    correlated = solve_onto(GRID, W.clone(), 2 / len(X) * X.T @ X, cfg)
    assert rounding_reach.within_reach(correlated, W) < 0.95


def test_it_measures_each_chosen_layer_of_a_tiny_model():
    model = make_tiny_model("llama")
    rows = rounding_reach.measure(model, token_ids(batch=8, length=32), [0, 1], GRID, steps=5)
    assert [r["layer"] for r in rows] == ["model.layers.0", "model.layers.1"]
    for row in rows:
        assert 0 < row["gptq_over_rtn"] < 1 and 0 < row["signround_over_rtn"] <= 1
        assert 0 < row["gptq_within_reach"] <= 1
        assert set(row["linears"]) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
