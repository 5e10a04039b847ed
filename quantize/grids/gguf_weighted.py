"""GGUF block scales searched with an importance per input column (what llama.cpp calls an
importance matrix: the mean squared activation of each input, here the GPTQ Hessian's diagonal).

Each weight's error counts imp[column] · sqrt(σ² + w²) (σ² the row's mean square), llama.cpp's
imatrix weighting; the searches are llama.cpp's: make_qx_quants' 19 trial scales for the
symmetric formats (Q8_0, Q4_0, Q5_0; Q6_K's sub-blocks), make_qkx2's trial ranges for the affine
ones (Q4_1, Q5_1; Q4_K's and Q5_K's sub-blocks, with the finer ranges llama.cpp uses given an
imatrix), and the IQ4 types' 16 trial scales with these weights in place of x². Levels are
then the nearest on the stored fp16 grid. Not byte-identical to llama.cpp's imatrix path (σ² is
per row for every type here, sums in torch's order); what matters is that the file holds exactly the grid chosen.
"""
from __future__ import annotations

import torch

from lowbit.quantize.grids import gguf_iquants, gguf_kquants
from lowbit.quantize.grids.gguf import LAYOUTS, GGUFScheme, GGUFWeight, round_to_grid

SYMMETRIC_NMAX = {"q8_0": 128, "q4_0": 8, "q5_0": 16}
# the types whose own reference search takes the weights (the super-block types and the I-quants)
SEARCHED_WITH_WEIGHTS = {"q4_k": gguf_kquants.q4_k_reference, "q5_k": gguf_kquants.q5_k_reference,
                         "q6_k": gguf_kquants.q6_k_reference, "iq4_nl": gguf_iquants.iq4_nl_reference,
                         "iq4_xs": gguf_iquants.iq4_xs_reference}


def error_weights(W: torch.Tensor, importance: torch.Tensor, sigma2: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, cols) weight of each element's squared error; importance (cols,) >= 0; sigma2 (rows, 1)
    the rows' mean squares (default: W's own; a caller quantizing W block by block passes the whole rows')."""
    W = W.float()
    sigma2 = (W * W).mean(dim=1, keepdim=True) if sigma2 is None else sigma2
    imp = importance.float().clamp(min=0)
    imp = imp + 1e-6 * imp.mean().clamp(min=1e-30)  # dead inputs keep a tiny weight: no empty fit
    return imp[None, :] * torch.sqrt(sigma2 + W * W)


def quantize_weighted(W: torch.Tensor, scheme: GGUFScheme, importance: torch.Tensor,
                      sigma2: torch.Tensor | None = None) -> GGUFWeight:
    rows, kind, block = W.shape[0], scheme.type, scheme.block_size
    x = W.detach().float().reshape(-1, block)
    w = error_weights(W.detach(), importance, sigma2).reshape(-1, block)
    if kind in SEARCHED_WITH_WEIGHTS:
        fields = SEARCHED_WITH_WEIGHTS[kind](x, w)
        levels = fields.pop("levels")
        shaped = {k: v.reshape(rows, -1) for k, v in fields.items()}
        return GGUFWeight(scheme, levels.reshape(rows, -1).to(torch.int16), **shaped)
    if kind in SYMMETRIC_NMAX:
        scale, _ = gguf_kquants._qx(x, SYMMETRIC_NMAX[kind], w, ordered=False)
        fields = {"d": scale.half().reshape(rows, -1)}
    else:  # q4_1, q5_1: value = d·level + m, m <= 0 the block's min
        scale, min_sub, _ = gguf_kquants._qkx2(x, w, nmax=LAYOUTS[kind].qmax, rmin=-1.0, rdelta=0.1, nstep=20,
                                               ordered=False)
        fields = {"d": scale.half().reshape(rows, -1), "dmin": (-min_sub).half().reshape(rows, -1)}
    placeholder = GGUFWeight(scheme, torch.zeros(W.shape, dtype=torch.int16), **fields)
    S, M = placeholder.sub_scale_offset()
    levels = round_to_grid(W.float(), S, M, scheme)
    assert LAYOUTS[kind].sub == block  # one scale (and min) per block for the legacy formats
    return GGUFWeight(scheme, levels, **fields)
