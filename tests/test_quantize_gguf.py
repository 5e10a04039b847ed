"""GGUF block grids: reference quantization byte for byte against the `gguf` package where it has a
quantizer, dequantization bit for bit against its dequantizers for every type, the packing."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

from llama_quantize_bytes import hard_matrix
from lowbit.quantize.grids.gguf import LAYOUTS, GGUFScheme, quantize_gguf, round_to_grid
from lowbit.quantize.grids.gguf_packing import pack, unpack

TYPES = sorted(LAYOUTS)
LEGACY = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]  # the types gguf 0.19's quants.quantize implements (of ours)


def _weights(cols=1024, rows=12, seed=0):
    """Rows of several blocks: per-row magnitudes, outliers, all-zero blocks and rows, a constant
    block, a block of equal and opposite maxima, values too small for an fp16 scale, heavy tails."""
    return hard_matrix(seed, rows, cols)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", LEGACY)
def test_reference_bytes_equal_gguf_quantizer(kind):
    scheme = GGUFScheme(kind)
    for seed in range(3):
        W = _weights(seed=seed)
        expected = quants.quantize(W.numpy(), scheme.ggml_type)
        assert np.array_equal(pack(quantize_gguf(W, scheme)).numpy(), expected), (kind, seed)


@pytest.mark.parametrize("kind", TYPES)
def test_dequantize_equals_gguf_dequantizer_bit_for_bit(kind):
    scheme = GGUFScheme(kind)
    W = _weights()
    weight = quantize_gguf(W, scheme)
    data = pack(weight)
    assert data.shape == (W.shape[0], W.shape[1] // scheme.block_size * scheme.layout.type_size)
    theirs = torch.from_numpy(quants.dequantize(data.numpy(), scheme.ggml_type))
    assert torch.equal(_bits(weight.dequantize()), _bits(theirs))
    # and close to the weights: every block's error within its grid step (a loose sanity bound)
    assert float((weight.dequantize() - W).abs().max()) < 0.2 * float(W.abs().max())


@pytest.mark.parametrize("kind", TYPES)
def test_arbitrary_blocks_unpack_pack_and_dequantize_exactly(kind):
    """Random bytes (fp16 fields made finite) exercise every level, scale and min a file can hold,
    negative Q6_K sub-scales and Q4_K's 6-bit split fields included."""
    scheme = GGUFScheme(kind)
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (8 * 4, scheme.layout.type_size), generator=gen, dtype=torch.uint8)
    for start in _half_offsets(kind):
        finite = (torch.randn(blocks.shape[0], generator=gen) * 0.01).half().view(torch.uint8).reshape(-1, 2)
        blocks[:, start:start + 2] = finite
    data = blocks.reshape(8, -1)
    weight = unpack(data, scheme)
    assert torch.equal(pack(weight), data)
    assert int(weight.levels.min()) >= scheme.layout.qmin and int(weight.levels.max()) <= scheme.layout.qmax
    theirs = torch.from_numpy(quants.dequantize(data.numpy(), scheme.ggml_type))
    assert torch.equal(_bits(weight.dequantize()), _bits(theirs))


def _half_offsets(kind):
    return {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2],
            "q6_k": [208], "iq4_nl": [0], "iq4_xs": [0]}[kind]


@pytest.mark.parametrize("kind", TYPES)
def test_quantized_fields_round_trip_through_bytes(kind):
    weight = quantize_gguf(_weights(seed=2), GGUFScheme(kind))
    back = unpack(pack(weight), weight.scheme)
    for field in ("levels", "d", "dmin", "sub_scale", "sub_min"):
        mine, theirs = getattr(weight, field), getattr(back, field)
        assert (mine is None) == (theirs is None), field
        assert mine is None or torch.equal(mine, theirs), field


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k"])
def test_k_quant_levels_are_nearest_on_their_stored_grid(kind):
    """llama.cpp's last pass rounds each weight to nearest on the fp16/6-bit scales it stores."""
    W = _weights(seed=3)
    weight = quantize_gguf(W, GGUFScheme(kind))
    S, M = weight.sub_scale_offset()
    nonzero = (S != 0).repeat_interleave(weight.scheme.layout.sub, dim=1)
    assert nonzero.float().mean() > 0.7
    assert torch.equal(round_to_grid(W, S, M, weight.scheme)[nonzero], weight.levels[nonzero])


def test_error_falls_with_bits_and_k_quants_beat_q4_0():
    gen = torch.Generator().manual_seed(4)
    W = torch.randn(64, 1024, generator=gen) * 0.02
    W[torch.rand(W.shape, generator=gen) < 0.002] *= 12  # sparse outliers, as in real layers
    rmse = {k: float((quantize_gguf(W, GGUFScheme(k)).dequantize() - W).square().mean().sqrt()) for k in TYPES}
    assert rmse["q8_0"] < rmse["q6_k"] < rmse["q4_k"] < rmse["q4_0"]
    assert rmse["q4_1"] < rmse["q4_0"]
    assert rmse["q5_0"] < rmse["q4_k"]
    assert rmse["q5_1"] < rmse["q5_0"] and rmse["q5_k"] < rmse["q4_k"]
    assert rmse["iq4_nl"] < rmse["q4_0"] and rmse["iq4_xs"] < rmse["q4_0"]  # the non-linear grid fits a bell curve


def test_bits_per_weight():
    bits = {k: GGUFScheme(k).bits_per_weight for k in TYPES}
    assert bits == {"q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5625,
                    "q8_0": 8.5, "iq4_nl": 4.5, "iq4_xs": 4.25}
    for kind in TYPES:  # what the packing writes
        data = pack(quantize_gguf(torch.randn(2, 512), GGUFScheme(kind)))
        assert data.numel() * 8 / (2 * 512) == bits[kind]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="iq4_nl.*q4_k.*q6_k"):
        GGUFScheme("q3_k")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj.*256"):
        quantize_gguf(torch.randn(4, 288), GGUFScheme("q4_k"), name="layers.0.mlp.up_proj")
    W = torch.randn(4, 64)
    W[1, 3] = float("nan")
    with pytest.raises(ValueError, match="q8_0.*finite"):
        quantize_gguf(W, GGUFScheme("q8_0"))
    with pytest.raises(ValueError, match="blk.0.ffn_up.*144"):
        unpack(torch.zeros(2, 100, dtype=torch.uint8), GGUFScheme("q4_k"), name="blk.0.ffn_up")


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_k_quant_search_matches_a_scalar_float32_oracle(kind):
    """The vectorised searches pick what llama.cpp's sequential float32 loops pick (oracle in
    tests/ggml_scalar_reference.py), on blocks with outliers, zeros, constants, tiny values."""
    from ggml_scalar_reference import q4_k_block, q6_k_block
    oracle = {"q4_k": q4_k_block, "q6_k": q6_k_block}[kind]
    W = _weights(seed=5)[[0, 1, 2, 4, 5, 7]]
    weight = quantize_gguf(W, GGUFScheme(kind))
    blocks = W.reshape(-1, 256).numpy()
    fields = {f: getattr(weight, f) for f in ("d", "dmin", "sub_scale", "sub_min") if getattr(weight, f) is not None}
    levels = weight.levels.reshape(-1, 256)
    for b, block in enumerate(blocks):
        expected = oracle(block)
        assert levels[b].tolist() == expected["levels"], b
        for name, value in fields.items():
            mine = value.reshape(blocks.shape[0], -1)[b]
            assert mine.tolist() == np.atleast_1d(expected[name]).tolist(), (b, name)



def test_iq4_nearest_index_by_table_equals_a_sorted_search_with_llama_cpps_tie_rule():
    from lowbit.quantize.grids.gguf_iquants import codebook, nearest_index
    values = codebook("cpu")
    at_edges = torch.cat([values, values + 1e-5, values - 1e-5, values.nextafter(values + 1),
                          values.nextafter(values - 1), (values[1:] + values[:-1]) / 2])  # the last: ties
    x = torch.cat([torch.randn(100_000) * 80, torch.arange(-140.0, 130.0, 0.25), at_edges,
                   torch.tensor([float("inf"), float("-inf"), 0.0, -0.0])])
    upper = torch.searchsorted(values, x, right=True).clamp(1, len(values) - 1)
    expected = torch.where(x - values[upper - 1] < values[upper] - x, upper - 1, upper)  # a tie: the upper
    assert torch.equal(nearest_index(x, values).long(), expected)
