"""The memory savers of a streamed layer keep their results: the finiteness check, a chunk at a time,
still finds a NaN or inf wherever it sits, and codes rounded a block of rows at a time are the
codes of the whole weight at once."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lowbit.calibrate.checks import check_finite_weights
from lowbit.quantize.grids.integer import IntScheme, compute_scale_zero, grouped, quantize_codes


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_in_a_later_chunk_is_found(bad):
    layer = nn.Linear(2048, 2100, bias=False)  # 4.3M weights: more than one 4M-element chunk
    with torch.no_grad():
        layer.weight.normal_()
        layer.weight[-1, -1] = bad
    with pytest.raises(ValueError, match="weight .* NaN and .* inf"):
        check_finite_weights(layer)


@pytest.mark.parametrize("scheme", [IntScheme(4, True, "group", 32), IntScheme(4, False, "group", 64),
                                    IntScheme(8, True, "channel", None), IntScheme(8, True, "tensor", None)])
def test_codes_rounded_by_row_blocks_equal_the_whole_weight_at_once(scheme):
    w = torch.randn(300, 256, generator=torch.Generator().manual_seed(0))
    scale, zero = compute_scale_zero(w, scheme)
    g = grouped(w, scheme)
    q = torch.round(g / scale.unsqueeze(-1)) + (0 if zero is None else zero.unsqueeze(-1))
    textbook = q.clamp(scheme.qmin, scheme.qmax).to(torch.int8).reshape(w.shape)
    for rows in (7, 300, 10**6):
        assert torch.equal(quantize_codes(w, scale, zero, scheme, rows=rows), textbook)


@pytest.mark.parametrize("scheme", [IntScheme(4, True, "group", 64), IntScheme(4, False, "group", 32),
                                    IntScheme(3, True, "channel", None)])
def test_the_range_search_by_row_blocks_equals_the_whole_search(scheme):
    from lowbit.quantize.grids.scale_search import search_scale_zero

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(700, 256, generator=gen) * torch.rand(700, 1, generator=gen)
    importance = grouped(torch.rand(1, 256, generator=gen), scheme)[0]
    columns = torch.randn(64, 700, generator=gen).t()[:, None]  # a transposed view, as GPTQ's lazy groups pass
    channel = IntScheme(scheme.bits, scheme.symmetric, "channel", None)
    for groups, weight, s in ((grouped(w, scheme), importance, scheme), (columns, torch.rand(1, 64, generator=gen), channel)):
        whole = search_scale_zero(groups, weight, s, rows=10**6)
        for rows in (7, 256):
            blocked = search_scale_zero(groups, weight, s, rows=rows)
            assert torch.equal(blocked[0], whole[0])
            assert (blocked[1] is None) == (whole[1] is None) == s.symmetric
            assert s.symmetric or torch.equal(blocked[1], whole[1])
