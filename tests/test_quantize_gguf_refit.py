"""Block scales refitted to GPTQ's levels by least squares in the Hessian metric."""
from __future__ import annotations

import pytest
import torch
from gguf import quants

from test_quantize_gptq_gguf import _correlated, _output_error
from lowbit.quantize.grids.gguf import GGUFScheme, GGUFWeight, quantize_gguf
from lowbit.quantize.grids.gguf_packing import pack
from lowbit.quantize.steps.gguf_refit import REFITTABLE, refit_block_scales
from lowbit.quantize.steps.gptq import GPTQConfig
from lowbit.quantize.steps.gptq_solver import gptq_solve_gguf


def _row_errors(W, H, weight):
    D = W - weight.dequantize()
    return ((D @ H) * D).sum(dim=1)


@pytest.mark.parametrize("kind", REFITTABLE)
def test_refit_never_worsens_a_row(kind):
    X, W, H = _correlated(rows=32)
    solved = gptq_solve_gguf(W, H, GPTQConfig(actorder="static", scale_search="mse"), GGUFScheme(kind))[0]
    refitted = refit_block_scales(W, H, solved)
    before, after = _row_errors(W, H, solved), _row_errors(W, H, refitted)
    assert bool((after <= before).all())
    assert float(after.sum()) < 0.99 * float(before.sum())  # and it gains on the whole
    assert torch.equal(refitted.levels, solved.levels)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_refit_recovers_the_scales_of_weights_on_the_grid(kind):
    """Weights that lie exactly on a grid, handed over with the right levels and wrong scales: the
    refit finds the grid's scales (and mins), whatever the inputs' correlations."""
    _, W, H = _correlated(rows=8)
    true = quantize_gguf(W, GGUFScheme(kind))
    on_grid = true.dequantize()
    wrong = GGUFWeight(true.scheme, true.levels, (true.d.float() * 1.3).half(),
                       None if true.dmin is None else (true.dmin.float() * 0.7).half())
    refitted = refit_block_scales(on_grid, H, wrong)
    assert float(_row_errors(on_grid, H, refitted).max()) < 1e-6 * float(_row_errors(on_grid, H, wrong).max())


def test_k_quant_scales_are_refused_with_the_valid_types():
    _, W, H = _correlated(rows=4, cols=256)
    with pytest.raises(ValueError, match="q4_k.*q8_0, q4_0, q4_1, q5_0"):
        refit_block_scales(W, H, quantize_gguf(W, GGUFScheme("q4_k")))


@pytest.mark.parametrize("kind", ["q4_0", "q5_0", "q8_0"])
def test_gptq_with_refits_lowers_output_error_and_packs_exactly(kind):
    X, W, H = _correlated()
    scheme = GGUFScheme(kind)
    plain = gptq_solve_gguf(W, H, GPTQConfig(actorder="static", scale_search="mse"), scheme)[0]
    refitted, row_loss, _, _ = gptq_solve_gguf(W, H, GPTQConfig(actorder="static", scale_search="mse",
                                                                scale_refits=2), scheme)
    assert _output_error(X, W, refitted.dequantize()) < _output_error(X, W, plain.dequantize())
    assert torch.isfinite(row_loss).all() and float(row_loss.min()) >= 0
    theirs = torch.from_numpy(quants.dequantize(pack(refitted).numpy(), scheme.ggml_type))
    assert torch.equal(refitted.dequantize().view(torch.int32), theirs.view(torch.int32))


def test_scale_refits_out_of_range_is_refused():
    with pytest.raises(ValueError, match="scale_refits must be between 0 and 10"):
        GPTQConfig(scale_refits=-1)
