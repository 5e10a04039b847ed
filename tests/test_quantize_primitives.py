import pytest
import torch

from lowbit.quantize.grids.integer import (IntScheme, check_group_size, compute_scale_zero, pack_codes, quantize_rtn,
                                           unpack_codes)

SCHEMES = [
    IntScheme(bits=b, symmetric=s, strategy=st, group_size=64 if st == "group" else None)
    for b in (2, 3, 4, 8) for s in (True, False) for st in ("tensor", "channel", "group")
]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_rtn_round_trip_error_is_at_most_half_a_step(scheme):
    torch.manual_seed(0)
    w = torch.randn(32, 256) * torch.rand(32, 1) * 3
    qw = quantize_rtn(w, scheme)
    assert qw.codes.min() >= scheme.qmin and qw.codes.max() <= scheme.qmax
    err = (qw.dequantize() - w).abs()
    step = qw.scale if scheme.strategy != "group" else qw.scale.repeat_interleave(64, dim=1)
    assert (err <= step / 2 * (1 + 1e-4)).all()  # float32 rounding at the clamped extreme


def test_asymmetric_grid_represents_zero_exactly():
    w = torch.rand(8, 128) + 0.5  # all positive: zero still on the grid
    w[:, :3] = 0.0
    qw = quantize_rtn(w, IntScheme(bits=4, symmetric=False, strategy="group", group_size=32))
    assert (qw.dequantize()[:, :3] == 0).all()


def test_fewer_bits_give_larger_error():
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    errors = [(quantize_rtn(w, IntScheme(bits=b)).dequantize() - w).pow(2).mean() for b in (8, 4, 3, 2)]
    assert errors == sorted(errors)


def test_all_zero_rows_get_a_usable_scale():
    w = torch.zeros(4, 64)
    qw = quantize_rtn(w, IntScheme(bits=4, strategy="channel"))
    assert torch.isfinite(qw.scale).all() and (qw.scale > 0).all()
    assert (qw.dequantize() == 0).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", [64, 40])
def test_pack_unpack_round_trip(bits, n):
    torch.manual_seed(bits)
    codes = torch.randint(0, 2**bits, (5, n), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (5, -(-n * bits // 32))
    assert torch.equal(unpack_codes(packed, bits, n), codes)


def test_four_bit_packing_puts_the_first_code_in_the_lowest_bits():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.uint8)
    assert pack_codes(codes, 4).item() == 0x87654321 - 2**32


def test_group_size_error_names_layer_and_valid_sizes():
    with pytest.raises(ValueError, match=r"layer model.layers.0.mlp.down_proj.*576.*\[16, 32, 64\]"):
        check_group_size(IntScheme(bits=4, strategy="group", group_size=128), 576, "model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("kwargs,msg", [
    (dict(bits=9), "bits"), (dict(bits=1), "bits"),
    (dict(strategy="group"), "group_size"), (dict(strategy="channel", group_size=64), "group_size"),
    (dict(strategy="row"), "strategy"),
])
def test_invalid_schemes_are_refused(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        IntScheme(**kwargs)


def test_scale_shapes_follow_strategy():
    w = torch.randn(16, 128)
    for scheme, shape in [(IntScheme(strategy="tensor"), (1, 1)), (IntScheme(strategy="channel"), (16, 1)),
                          (IntScheme(strategy="group", group_size=32), (16, 4))]:
        scale, zero = compute_scale_zero(w, scheme)
        assert scale.shape == shape and zero is None
