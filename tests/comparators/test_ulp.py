"""ulp_distance / ulp_spacing / ulp_error / round_to_dtype against independent oracles."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.comparators import ulp_distance, ulp_error, ulp_spacing
from precisiondiff.comparators.ulp import (
    ComparatorError,
    UnsupportedDtypeError,
    float_format,
    round_to_dtype,
)
from precisiondiff.errors import PrecisionDiffError

from .oracle import FP8, SMALL, rank_distance, round_oracle, table, wide_distance

SETTINGS = settings(max_examples=75, deadline=None)


def _all_values(dtype):
    vals, _, _ = table(dtype)
    return torch.from_numpy(vals.copy()).to(dtype)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_all_pairs_match_rank_oracle(dtype):
    v = _all_values(dtype)  # 256 patterns, NaNs included
    a = v.repeat_interleave(256)
    e = v.repeat(256)
    got = ulp_distance(a, e).numpy()
    want = rank_distance(dtype, a.double().numpy(), e.double().numpy())
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16bit_every_pattern_vs_neighbours_and_specials(dtype):
    v = _all_values(dtype)
    vf = v.double().numpy()
    nxt = torch.roll(v, -1)
    fmt = float_format(dtype)
    specials = [0.0, -0.0, fmt.max_finite, -fmt.max_finite, math.inf, -math.inf, math.nan, 1.0]
    for other in [nxt] + [torch.full_like(v, s) for s in specials]:
        got = ulp_distance(v, other).numpy()
        want = rank_distance(dtype, vf, other.double().numpy())
        assert np.array_equal(got, want, equal_nan=True)


def _floats(dtype):
    width = 32 if dtype == torch.float32 else 64
    return st.floats(width=width, allow_nan=True, allow_infinity=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@SETTINGS
@given(data=st.data())
def test_wide_formats_match_int_oracle(dtype, data):
    xs = data.draw(st.lists(_floats(dtype), min_size=1, max_size=20))
    ys = data.draw(st.lists(_floats(dtype), min_size=len(xs), max_size=len(xs)))
    got = ulp_distance(torch.tensor(xs, dtype=dtype), torch.tensor(ys, dtype=dtype)).tolist()
    for g, x, y in zip(got, xs, ys):
        w = wide_distance(dtype, x, y)
        if math.isnan(w):
            assert math.isnan(g)
        else:  # float64 result of an integer that may exceed 2**53: one rounding allowed
            assert g == float(int(w)) or abs(g - w) <= w * 2.0**-52


def test_float64_extremes_do_not_overflow():
    m = torch.finfo(torch.float64).max
    a = torch.tensor([-m, -math.inf, m], dtype=torch.float64)
    e = torch.tensor([m, math.inf, -5e-324], dtype=torch.float64)
    got = ulp_distance(a, e).tolist()
    assert got[0] == float(2 * 0x7FEFFFFFFFFFFFFF)
    assert got[1] == float(2 * 0x7FF0000000000000)
    assert got[2] == float(0x7FEFFFFFFFFFFFFF + 1)


@pytest.mark.parametrize("dtype", SMALL, ids=str)
@SETTINGS
@given(x=st.floats(allow_nan=True, allow_infinity=True))
def test_rounding_matches_oracle(dtype, x):
    got = round_to_dtype(torch.tensor([x], dtype=torch.float64), dtype).double().item()
    want = round_oracle(dtype, x)
    if math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == want and math.copysign(1, got) == math.copysign(1, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
@SETTINGS
@given(x=st.floats(min_value=-1e4, max_value=1e4), scale=st.sampled_from([1.0, 2**-20, 2**-130]))
def test_rounding_from_float64_is_single_step_near_ties(dtype, x, scale):
    # values just beside a tie of the target format: double rounding via float32 would fail
    fmt = float_format(dtype)
    v = round_oracle(dtype, x * scale)
    if math.isnan(v) or math.isinf(v):
        return
    half = ulp_spacing(torch.tensor([v]), dtype).item() / 2
    for y in (v + half, v + half + abs(v) * 2**-40, v + half - abs(v) * 2**-40):
        if abs(y) >= fmt.max_finite:
            continue
        got = round_to_dtype(torch.tensor([y], dtype=torch.float64), dtype).double().item()
        assert got == round_oracle(dtype, y)


@pytest.mark.parametrize("dtype", [*SMALL, torch.float32, torch.float64], ids=str)
@SETTINGS
@given(data=st.data())
def test_metric_properties(dtype, data):
    fmt = float_format(dtype)
    lim = min(fmt.max_finite, 1e300)
    vals = st.floats(min_value=-lim, max_value=lim)
    a, b, c = (
        round_to_dtype(torch.tensor(data.draw(st.lists(vals, min_size=8, max_size=8)),
                                    dtype=torch.float64), dtype)
        for _ in range(3)
    )
    ok = ~(a.isnan() | b.isnan() | c.isnan())
    dab, dba = ulp_distance(a, b), ulp_distance(b, a)
    assert torch.equal(dab[ok], dba[ok])  # symmetry
    assert (ulp_distance(a, a) == 0).all()  # identity
    assert (dab[ok] > 0).eq(a[ok].double() != b[ok].double()).all()
    dac, dbc = ulp_distance(a, c), ulp_distance(b, c)
    tri = dac <= dab + dbc + (dac + dab + dbc) * 2.0**-51  # float64 rounding above 2**53
    assert tri[ok].all()
    if dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        up = torch.nextafter(a, torch.full_like(a, math.inf))
        fin = torch.isfinite(a) & torch.isfinite(up.double())
        assert (ulp_distance(up, a)[fin] == 1).all()


def test_signed_zero_infinities_nan_rules():
    for dtype in [*SMALL, torch.float32, torch.float64]:
        fmt = float_format(dtype)
        a = torch.tensor([0.0, math.nan, math.nan, 1.0], dtype=torch.float64).to(dtype)
        e = torch.tensor([-0.0, math.nan, 1.0, math.nan], dtype=torch.float64)
        assert np.array_equal(ulp_distance(a, e).numpy(), [0, 0, np.nan, np.nan], equal_nan=True)
        if fmt.has_inf:
            a = torch.tensor([math.inf, -math.inf, math.inf]).to(dtype)
            e = torch.tensor([math.inf, -math.inf, fmt.max_finite], dtype=torch.float64)
            assert ulp_distance(a, e).tolist() == [0.0, 0.0, 1.0]


def test_e4m3fn_overflow_rounds_to_nan_not_saturation():
    a = torch.tensor([448.0], dtype=torch.float8_e4m3fn)
    assert math.isnan(ulp_distance(a, torch.tensor([1000.0], dtype=torch.float64)).item())
    assert ulp_distance(a, torch.tensor([463.0], dtype=torch.float64)).item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e5m2], ids=str)
def test_spacing_is_gap_to_next_value_everywhere(dtype):
    _, distinct, _ = table(dtype)
    pos = [v for v in distinct if v >= 0 and math.isfinite(v)]
    x = torch.tensor(pos[:-1], dtype=torch.float64)
    gaps = torch.tensor([b - a for a, b in zip(pos[:-1], pos[1:])], dtype=torch.float64)
    assert torch.equal(ulp_spacing(x, dtype), gaps)
    assert torch.equal(ulp_spacing(-x, dtype), gaps)


@pytest.mark.parametrize("dtype", [*SMALL, torch.float32], ids=str)
@SETTINGS
@given(xs=st.lists(st.floats(min_value=-60000, max_value=60000), min_size=1, max_size=16))
def test_correctly_rounded_has_ulp_error_at_most_half(dtype, xs):
    g = torch.tensor(xs, dtype=torch.float64)
    if dtype in FP8:
        g = g / 1000
    r = round_to_dtype(g, dtype)
    err = ulp_error(r, g)
    assert (err <= 0.5).all(), (g, r, err)


def test_ulp_error_special_values():
    a = torch.tensor([math.nan, math.nan, 1.0, math.inf, math.inf, -math.inf, 2.0])
    g = torch.tensor([math.nan, 1.0, math.nan, math.inf, -math.inf, 1.0, 1.0], dtype=torch.float64)
    got = ulp_error(a.to(torch.bfloat16), g).numpy()
    assert np.array_equal(got, [0, np.nan, np.nan, 0, np.inf, np.inf, 128], equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e8m0fnu], ids=str)
def test_unsupported_dtype_raises(dtype):
    x = torch.zeros(3).to(dtype)
    with pytest.raises(UnsupportedDtypeError, match="no ULP definition"):
        ulp_distance(x, x)
    with pytest.raises(PrecisionDiffError):
        ulp_spacing(torch.zeros(3), dtype)
    with pytest.raises(PrecisionDiffError):
        ulp_error(torch.zeros(3), torch.zeros(3), dtype)


def test_complex_and_shape_mismatch_raise():
    with pytest.raises(UnsupportedDtypeError, match="complex"):
        ulp_distance(torch.zeros(2, dtype=torch.complex64), torch.zeros(2))
    with pytest.raises(ComparatorError, match=r"shapes differ: actual \(2,\) vs expected \(3,\)"):
        ulp_distance(torch.zeros(2), torch.zeros(3))


def test_shapes_preserved_empty_and_0d():
    assert ulp_distance(torch.zeros(0, 3), torch.zeros(0, 3)).shape == (0, 3)
    d = ulp_distance(torch.tensor(1.0), torch.tensor(1.0, dtype=torch.float64))
    assert d.shape == () and d.dtype == torch.float64 and d.item() == 0.0


def test_dtype_argument_rounds_both_operands():
    a = torch.tensor([1.0 + 2**-10], dtype=torch.float32)  # between bf16 values: rounds to 1.0
    e = torch.tensor([1.0], dtype=torch.float64)
    assert ulp_distance(a, e, torch.bfloat16).item() == 0.0
    assert ulp_distance(a, e).item() == 2.0**13
