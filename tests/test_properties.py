"""Property tests (hypothesis): integer grids and packing round trips over random shapes, bits,
strategies and group sizes; the recipe loader fuzzed with random documents and text."""
import dataclasses
import math
import typing

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lowbit.quantize.grids.integer import (IntScheme, QuantizedWeight, compute_scale_zero, dequantize_codes,
                                           fake_quantize, pack_codes, quantize_codes, quantize_rtn, unpack_codes)
from lowbit.recipes.schema import Recipe, load_recipe
from lowbit.quantize.steps.registry import STEPS
from lowbit.recipes.validate import RecipeError

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])
FLOATS = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@st.composite
def weights_and_scheme(draw):
    """A float32 weight (out, in) and a scheme whose group size divides in."""
    strategy = draw(st.sampled_from(["tensor", "channel", "group"]))
    group = draw(st.sampled_from([1, 2, 3, 8, 16, 32])) if strategy == "group" else None
    groups = draw(st.integers(1, 4))
    in_features = group * groups if group else draw(st.integers(1, 48))
    out_features = draw(st.integers(1, 6))
    scheme = IntScheme(bits=draw(st.integers(2, 8)), symmetric=draw(st.booleans()), strategy=strategy,
                       group_size=group)
    w = draw(hnp.arrays(np.float32, (out_features, in_features), elements=FLOATS))
    return torch.from_numpy(w), scheme


def per_element(t: torch.Tensor, w: torch.Tensor, scheme: IntScheme) -> torch.Tensor:
    """A per-group tensor (rows, G) broadcast to w's (out, in) shape."""
    if scheme.strategy == "tensor":
        return t.expand(w.shape)
    return t.repeat_interleave(w.shape[1] // t.shape[1], dim=1)


@FAST
@given(weights_and_scheme())
def test_rtn_codes_lie_on_the_grid_and_dequantize_within_half_a_step(case):
    w, scheme = case
    qw = quantize_rtn(w, scheme)
    assert qw.codes.dtype == torch.int8 and qw.codes.shape == w.shape
    assert int(qw.codes.min()) >= scheme.qmin and int(qw.codes.max()) <= scheme.qmax
    assert torch.isfinite(qw.scale).all() and (qw.scale > 0).all()
    if qw.zero is not None:
        assert (qw.zero == qw.zero.round()).all()
        assert int(qw.zero.min()) >= scheme.qmin and int(qw.zero.max()) <= scheme.qmax
    step = per_element(qw.scale, w, scheme)
    err = (qw.dequantize() - w).abs()
    # min/max scales clip nothing: every value is inside the range, so within half a step (plus
    # float32 rounding of w / scale; scales below float32's normal range, ~1e-38, lose precision)
    assert (err <= step / 2 * (1 + 1e-5) + w.abs() * 1e-6 + torch.finfo(torch.float32).tiny).all()


@FAST
@given(weights_and_scheme())
def test_zero_stays_exactly_zero(case):
    w, scheme = case
    w = w.clone()
    w[:, ::2] = 0.0
    assert (quantize_rtn(w, scheme).dequantize()[:, ::2] == 0).all()


@FAST
@given(weights_and_scheme(), st.data())
def test_grid_points_are_fixed_points(case, data):
    """Codes -> dequantize -> quantize gives the same codes (each grid point rounds to itself)."""
    w, scheme = case
    scale, zero = compute_scale_zero(w, scheme)
    seed = data.draw(st.integers(0, 2**31 - 1))
    codes = torch.randint(scheme.qmin, scheme.qmax + 1, w.shape, generator=torch.Generator().manual_seed(seed),
                          dtype=torch.int8)
    again = quantize_codes(dequantize_codes(codes, scale, zero, scheme), scale, zero, scheme)
    assert torch.equal(again, codes)


@FAST
@given(weights_and_scheme())
def test_act_order_indexing_with_identity_groups_matches_plain_dequantize(case):
    w, scheme = case
    assume(scheme.strategy == "group")
    qw = quantize_rtn(w, scheme)
    g_idx = torch.arange(w.shape[1]) // scheme.group_size
    indexed = QuantizedWeight(qw.codes, qw.scale, qw.zero, scheme, g_idx)
    assert torch.allclose(indexed.dequantize(), qw.dequantize())


@FAST
@given(bits=st.integers(2, 8), symmetric=st.booleans(), scale=st.floats(1e-4, 1e3),
       w=hnp.arrays(np.float32, st.integers(1, 64), elements=FLOATS), data=st.data())
def test_fake_quantize_rounds_inside_the_range_and_clamps_outside(bits, symmetric, scale, w, data):
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    zero = None if symmetric else torch.tensor(float(data.draw(st.integers(qmin, qmax))))
    w, s = torch.from_numpy(w), torch.tensor(scale, dtype=torch.float32)
    out = fake_quantize(w, s, zero, qmin, qmax)
    z = 0.0 if zero is None else float(zero)
    lo, hi = (qmin - z) * float(s), (qmax - z) * float(s)
    q = out / s + z  # the integer each value landed on
    assert torch.allclose(q, q.round(), atol=1e-3) and q.min() >= qmin - 1e-3 and q.max() <= qmax + 1e-3
    tol = float(s) / 2 * (1 + 1e-5) + w.abs() * 1e-6
    inside = (w >= lo) & (w <= hi)
    assert ((out - w).abs() <= tol)[inside].all()
    assert torch.allclose(out[w > hi], torch.tensor(hi), rtol=1e-6)
    assert torch.allclose(out[w < lo], torch.tensor(lo), rtol=1e-6)


@FAST
@given(bits=st.integers(1, 8), rows=st.integers(1, 4), n=st.integers(1, 100), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_is_the_identity(bits, rows, n, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, n), generator=gen, dtype=torch.int32).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (rows, math.ceil(n * bits / 32))
    assert torch.equal(unpack_codes(packed, bits, n), codes)


# --- the recipe loader never raises anything but RecipeError ---

def schema_fields(cls) -> dict:
    """{field name: type hint} of a config dataclass and, recursively, of the dataclasses inside it."""
    hints = typing.get_type_hints(cls)
    out = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    for hint in list(out.values()):
        if dataclasses.is_dataclass(hint):
            out.update(schema_fields(hint))
    return out


CONFIGS = [Recipe] + [spec.config for spec in STEPS.values()]
FIELDS = {name: hint for cls in CONFIGS for name, hint in schema_fields(cls).items()}
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
           | st.sampled_from([10**400, -(10**400), 2**63, "re:(", "re:.*", "../x", "group", "channel", "tensor",
                              "wiki", "gptq", "rtn", "int8", "fp8", "bfloat16"]))
KEYS = st.sampled_from(sorted(FIELDS) + sorted(STEPS)) | st.text(max_size=8) | st.integers()
DOCUMENTS = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                         | st.dictionaries(KEYS, inner, max_size=5), max_leaves=20)


def for_hint(hint) -> st.SearchStrategy:
    """Values shaped like what a field expects (most of the time), anything else (otherwise)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        typed = st.fixed_dictionaries({}, optional={k: st.deferred(lambda h=h: for_hint(h))
                                                    for k, h in typing.get_type_hints(hint).items()})
    elif origin is typing.Literal:
        typed = st.sampled_from(args)
    elif origin in (tuple, list):
        typed = st.lists(for_hint(args[0]) if args else SCALARS, max_size=3)
    elif args:  # Optional / Union
        typed = st.one_of([for_hint(a) for a in args if a is not type(None)] + [st.none()])
    else:
        edge_ints = st.sampled_from([0, -1, 2**63, 10**400])  # 10**400: an int no float can hold
        typed = {int: st.integers(-3, 600) | edge_ints, float: st.floats() | edge_ints, bool: st.booleans(),
                 str: st.text(max_size=8)}.get(hint, SCALARS)
    junk = SCALARS | DOCUMENTS  # now and then: errors deep inside a well-typed document get reached too
    return st.integers(0, 9).flatmap(lambda i: junk if i == 9 else typed)


RECIPE_BODY = typing.get_type_hints(Recipe)
STEP_ITEMS = st.lists(st.one_of([st.fixed_dictionaries({name: for_hint(spec.config)})
                                 for name, spec in STEPS.items()]) | DOCUMENTS, max_size=3)
RECIPES = st.fixed_dictionaries({}, optional={k: for_hint(h) for k, h in RECIPE_BODY.items() if k != "steps"}
                                | {"steps": STEP_ITEMS})


def load_or_recipe_error(path, text: str, overrides=()):
    path.write_text(text, encoding="utf-8")
    try:
        return load_recipe(str(path), overrides)
    except RecipeError:
        return None


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "fuzz.yaml"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(RECIPES | DOCUMENTS)
@example({"steps": [{"gptq": {"dampening_frac": 10**400}}]})  # found by this test: float() overflowed
def test_random_documents_load_or_raise_recipe_error(recipe_file, doc):
    load_or_recipe_error(recipe_file, yaml.safe_dump(doc))


TOKENS = list("{}[]:,-!&*#|>?'\"%@` \n\tab01.\\") + ["name", "steps", "rtn", "bits", "!!python/name:os.system",
                                                       "&a", "*a", "!!binary", "!!set", "<<"]
YAMLISH = st.lists(st.sampled_from(TOKENS), max_size=30).map("".join)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=40) | YAMLISH)
@example("[" * 5000 + "]" * 5000)  # deeper than Python's recursion limit: was a RecursionError
@example("ignore: ['re:(']")
def test_random_text_loads_or_raises_recipe_error(recipe_file, text):
    load_or_recipe_error(recipe_file, text)


PATH_PARTS = st.sampled_from(sorted(FIELDS) + ["steps", "0", "1", "rtn", "evaluate", "export", ""])
OVERRIDES = st.builds(lambda parts, value: ".".join(parts) + "=" + value,
                      st.lists(PATH_PARTS, min_size=1, max_size=4), st.text(max_size=10) | YAMLISH)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(OVERRIDES | st.text(max_size=12), max_size=3))
def test_random_overrides_apply_or_raise_recipe_error(recipe_file, overrides):
    load_or_recipe_error(recipe_file, "steps:\n  - rtn: {scheme: {bits: 4, strategy: group, group_size: 32}}\n",
                         tuple(overrides))
