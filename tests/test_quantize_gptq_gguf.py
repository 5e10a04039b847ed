"""GPTQ onto GGUF block grids: block scales fixed before the sweep (actorder static) or searched as
the sweep reaches each block (actorder none), each column rounded onto its block's grid."""
from __future__ import annotations

import pytest
import torch
from gguf import quants

from lowbit.quantize.grids.gguf import GGUFScheme, quantize_gguf, round_to_grid
from lowbit.quantize.grids.gguf_packing import pack
from lowbit.quantize.grids.gguf_weighted import quantize_weighted
from lowbit.quantize.steps.gptq import GPTQConfig
from lowbit.quantize.steps.gptq_solver import HessianAccumulator, gptq_solve_gguf

TYPES = ["q4_0", "q4_1", "q4_k", "q6_k", "q8_0"]


def _correlated(tokens=2048, cols=512, rows=48, seed=0):
    """Inputs with correlated features and a few loud channels, as real activations have."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=gen) / cols**0.5
    X = torch.randn(tokens, cols, generator=gen) @ mix + 0.05 * torch.randn(tokens, cols, generator=gen)
    X[:, :4] *= 8
    W = torch.randn(rows, cols, generator=gen) * 0.05
    acc = HessianAccumulator(cols)
    acc.add(X)
    return X, W, acc.take()


def _output_error(X, W, Q):
    return float(((X @ (W - Q).t()) ** 2).mean())


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("actorder", ["static", "none"])
def test_identity_hessian_is_round_to_nearest_on_the_fixed_grid(kind, actorder):
    """With H = I the inverse Hessian is diagonal: no column's error reaches another, so GPTQ
    rounds each weight to nearest on the scales the whole weight gets, whether they are fixed
    before the sweep or searched block by block as it goes."""
    scheme = GGUFScheme(kind)
    _, W, _ = _correlated(rows=16)
    W[3, :256] = 0.0  # an all-zero block: scale 0
    weight, _, _, _ = gptq_solve_gguf(W, torch.eye(W.shape[1]), GPTQConfig(actorder=actorder), scheme)
    fixed = quantize_gguf(W, scheme)
    for field in ("d", "dmin", "sub_scale", "sub_min"):
        mine, ref = getattr(weight, field), getattr(fixed, field)
        assert mine is None and ref is None or torch.equal(mine, ref), field
    assert torch.equal(weight.levels, round_to_grid(W, *fixed.sub_scale_offset(), scheme))


@pytest.mark.parametrize("kind", ["q4_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("actorder", ["none", "static"])
def test_gptq_beats_round_to_nearest_on_the_same_grid(kind, actorder):
    scheme = GGUFScheme(kind)
    X, W, H = _correlated()
    weight, row_loss, _, _ = gptq_solve_gguf(W, H, GPTQConfig(actorder=actorder), scheme)
    gptq_error = _output_error(X, W, weight.dequantize())
    rtn_error = _output_error(X, W, quantize_gguf(W, scheme).dequantize())
    assert gptq_error < 0.7 * rtn_error, (gptq_error, rtn_error)
    assert torch.isfinite(row_loss).all() and float(row_loss.min()) >= 0


@pytest.mark.parametrize("kind", TYPES)
def test_identity_hessian_weighted_search_block_by_block_matches_the_whole_weight(kind):
    """The weighted search run one block at a time (with the whole rows' mean squares, as llama.cpp
    weights them) picks the scales it picks on the whole weight; near-ties may break the other way
    as sums run in another order, so a few blocks may differ."""
    scheme = GGUFScheme(kind)
    _, W, _ = _correlated(rows=16)
    H = torch.eye(W.shape[1])
    weight, _, _, _ = gptq_solve_gguf(W, H, GPTQConfig(actorder="none", scale_search="mse"), scheme)
    whole = quantize_weighted(W, scheme, H.diagonal())
    assert float((weight.d == whole.d).float().mean()) >= 0.9
    assert float((weight.levels == whole.levels).float().mean()) >= 0.98


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q4_k", "q6_k"])
def test_scales_searched_during_the_sweep_fit_its_updates_better(kind):
    """Scales searched from the updated weights as the sweep reaches each block absorb the errors
    pushed onto the block; scales fixed from the original weights cannot."""
    X, W, H = _correlated()
    errors = {order: _output_error(X, W, gptq_solve_gguf(W, H, GPTQConfig(actorder=order, scale_search="mse"),
                                                         GGUFScheme(kind))[0].dequantize())
              for order in ("none", "static")}
    assert errors["none"] < 0.95 * errors["static"], errors


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("actorder", ["none", "static"])
def test_solved_weight_packs_exactly(kind, actorder):
    """What the sweep optimised is what the file holds: gguf's dequantizer reads the packed
    levels back to the solver's values bit for bit, and every level is in the format's range."""
    scheme = GGUFScheme(kind)
    X, W, H = _correlated(rows=8)
    weight, _, _, _ = gptq_solve_gguf(W, H, GPTQConfig(actorder=actorder, scale_search="mse"), scheme)
    levels = weight.levels
    assert int(levels.min()) >= scheme.layout.qmin and int(levels.max()) <= scheme.layout.qmax
    theirs = torch.from_numpy(quants.dequantize(pack(weight).numpy(), scheme.ggml_type))
    assert torch.equal(weight.dequantize().view(torch.int32), theirs.view(torch.int32))


def test_group_act_order_is_refused():
    _, W, H = _correlated(rows=4, cols=256)
    with pytest.raises(ValueError, match="actorder none .* or static"):
        gptq_solve_gguf(W, H, GPTQConfig(actorder="group"), GGUFScheme("q4_k"))
