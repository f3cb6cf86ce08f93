"""compare_tensors: formulas against direct numpy float64, chunking invariance, specials."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.comparators import TensorMetrics, compare_tensors
from precisiondiff.comparators.ulp import ComparatorError, UnsupportedDtypeError, round_to_dtype
from precisiondiff.errors import PrecisionDiffError

from .oracle import rank_distance

SETTINGS = settings(max_examples=50, deadline=None)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def _pair(seed: int, n: int, dtype: torch.dtype, specials: bool):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, generator=g, dtype=torch.float64) * 10
    if dtype == torch.float8_e4m3fn:
        e = e.clamp(-400, 400)
    a = (e * (1 + 0.01 * torch.randn(n, generator=g, dtype=torch.float64))).to(dtype)
    if specials and n >= 8:
        e[0], a[1], e[2], a[2], e[3] = math.nan, math.nan, math.inf, math.inf, 0.0
        a[3] = 0.0
    return a, e


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SETTINGS
@given(seed=st.integers(0, 2**31), n=st.integers(0, 20000), specials=st.booleans(),
       chunk=st.sampled_from([1, 4096, 5000, 12288]))
def test_chunked_equals_unchunked_exactly(dtype, seed, n, specials, chunk):
    a, e = _pair(seed, n, dtype, specials)
    whole = compare_tensors(a, e, atol=1e-2, rtol=1e-2, chunk_elems=1 << 30)
    parts = compare_tensors(a, e, atol=1e-2, rtol=1e-2, chunk_elems=chunk)
    assert whole.to_dict() == parts.to_dict()


def _reference(a: torch.Tensor, e: torch.Tensor, atol: float, rtol: float) -> dict:
    """Direct numpy float64 formulas over finite, special-free data."""
    A, E = a.double().numpy().ravel(), e.double().numpy().ravel()
    d = A - E
    tiny = float(torch.finfo(a.dtype).smallest_normal)
    rel = np.abs(d) / np.maximum(np.abs(E), tiny)
    th = 1e-4 if a.dtype in (torch.bfloat16, torch.float16) else 1e-6
    d3 = np.where(np.abs(E) < th, np.abs(d), np.abs(d) / np.maximum(np.abs(E), tiny))
    ne = d != 0
    r = e.to(a.dtype)  # values are exactly representable or float32-rounded below
    return dict(
        max_abs_err=np.abs(d).max(), mean_abs_err=np.abs(d).mean(), max_rel_err=rel.max(),
        mean_rel_err=rel.mean(),
        cosine_similarity=(A @ E) / np.linalg.norm(A) / np.linalg.norm(E),
        sqnr_db=10 * np.log10((E**2).sum() / (d**2).sum()),
        diff1=np.abs(d).sum() / np.abs(E).sum(), diff2=np.sqrt((d**2).sum() / (E**2).sum()),
        diff3=d3.max(), diff4=(d[ne] < 0).mean(), diff4_count=int(ne.sum()),
        frac_rel_err_gt_1e3=(rel > 1e-3).mean(), frac_rel_err_gt_5e3=(rel > 5e-3).mean(),
        frac_outside_tolerance=(np.abs(d) > atol + rtol * np.abs(E)).mean(),
        max_ulp=rank_distance(a.dtype, A, r.double().numpy().ravel()).max()
        if a.dtype != torch.float32 else None,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@SETTINGS
@given(seed=st.integers(0, 2**31), n=st.integers(2, 3000))
def test_formulas_match_direct_float64(dtype, seed, n):
    a, e = _pair(seed, n, dtype, False)
    e = e.to(torch.float32).double()  # expected exactly float32, so r is a single rounding
    m = compare_tensors(a, e, atol=1e-3, rtol=1e-3, chunk_elems=4096)
    ref = _reference(a, e, 1e-3, 1e-3)
    for k, v in ref.items():
        if v is None:
            continue
        got = getattr(m, k)
        assert got == pytest.approx(v, rel=1e-12, abs=1e-300), k
    assert m.numel == n and m.n_finite == n and m.nan_mismatch == m.inf_mismatch == 0


@SETTINGS
@given(seed=st.integers(0, 2**31), n=st.integers(1, 30000), big=st.booleans())
def test_p99_is_nearest_rank_of_ulp_distance(seed, n, big):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, generator=g, dtype=torch.float64)
    noise = torch.randint(0, 300 if not big else 2**20, (n,), generator=g)
    a32 = e.to(torch.float32)
    a = (a32.view(torch.int32) + noise.to(torch.int32)).view(torch.float32)
    m = compare_tensors(a, e.to(torch.float32), chunk_elems=4096)
    d = np.sort(noise.numpy().astype(np.float64))
    want = d[math.ceil(0.99 * n) - 1]
    if want < 65536:
        assert m.p99_ulp == want
    else:  # binned above 2**16: lower edge within 2**-12 relative
        assert m.p99_ulp <= want < m.p99_ulp * (1 + 2**-12)
    assert m.max_ulp == d[-1]


def test_special_value_rules():
    inf, nan = math.inf, math.nan
    e = torch.tensor([1.0, nan, nan, inf, inf, 2.0, 1e39, -inf, 0.0], dtype=torch.float64)
    a = torch.tensor([nan, nan, 1.0, inf, 3.0, inf, inf, inf, 0.0]).to(torch.bfloat16)
    m = compare_tensors(a, e, atol=0.0, rtol=0.0)
    # NaN where the reference is finite, and a finite value where the reference is NaN
    assert m.nan_mismatch == 2
    # inf vs finite, finite vs inf, +inf vs -inf; 1e39 rounds to bf16 inf: no mismatch
    assert m.inf_mismatch == 3
    assert m.n_finite == 1
    assert m.frac_outside_tolerance == 5 / 9
    assert m.max_abs_err == 0.0 and m.sqnr_db == math.inf and m.cosine_similarity == 1.0


def test_e4m3fn_expected_beyond_range_is_nan_mismatch():
    a = torch.tensor([448.0]).to(torch.float8_e4m3fn)  # what a saturating cast returns
    m = compare_tensors(a, torch.tensor([1000.0], dtype=torch.float64))
    assert m.nan_mismatch == 1


def test_empty_and_zero_dim():
    m = compare_tensors(torch.zeros(0, 4, dtype=torch.bfloat16), torch.zeros(0, 4))
    assert m.numel == 0 and math.isnan(m.max_abs_err) and math.isnan(m.p99_ulp)
    assert m.to_dict()["max_abs_err"] is None
    m = compare_tensors(torch.tensor(1.5), torch.tensor(1.0, dtype=torch.float64))
    assert m.numel == 1 and m.max_abs_err == 0.5 and m.diff4 == 0.0 and m.diff4_count == 1


def test_zero_signal_and_zero_vectors():
    m = compare_tensors(torch.zeros(5), torch.zeros(5))
    assert m.cosine_similarity == 1.0 and m.sqnr_db == math.inf and m.diff1 == 0.0
    m = compare_tensors(torch.ones(5), torch.zeros(5))
    assert m.cosine_similarity == 0.0 and m.sqnr_db == -math.inf and m.diff1 == math.inf
    assert m.max_rel_err == 1.0 / float(torch.finfo(torch.float32).smallest_normal)


def test_to_dict_is_strict_json_and_round_trips():
    a, e = _pair(3, 100, torch.bfloat16, True)
    for m in (compare_tensors(a, e), compare_tensors(a, e, atol=0.1),
              compare_tensors(torch.zeros(0), torch.zeros(0))):
        text = json.dumps(m.to_dict(), allow_nan=False)
        back = TensorMetrics.from_dict(json.loads(text))
        assert back.to_dict() == m.to_dict()
    with pytest.raises(ComparatorError, match="missing"):
        TensorMetrics.from_dict({"numel": 1})


def test_errors_are_user_errors():
    with pytest.raises(ComparatorError, match=r"shapes differ: actual \(2, 3\) vs expected \(3, 2\)"):
        compare_tensors(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(UnsupportedDtypeError):
        compare_tensors(torch.zeros(3, dtype=torch.int32), torch.zeros(3))
    with pytest.raises(PrecisionDiffError, match="chunk_elems"):
        compare_tensors(torch.zeros(3), torch.zeros(3), chunk_elems=0)
    with pytest.raises(PrecisionDiffError, match="atol"):
        compare_tensors(torch.zeros(3), torch.zeros(3), atol=-1.0)


def test_mixed_dtypes_and_non_contiguous():
    e = torch.randn(64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a = round_to_dtype(e, torch.float16).t()
    m = compare_tensors(a, e.t())
    assert m.dtype_actual == "float16" and m.dtype_expected == "float64"
    assert m.max_ulp_error <= 0.5 and m.max_ulp == 0


def test_torch_float64_cast_double_rounds_and_we_do_not():
    # torch casts float64 -> float16/bfloat16 through float32: two roundings. 1 + 2**-11 +
    # 2**-40 must round up in float16, but float32 rounds it to the tie 1 + 2**-11 first.
    x = torch.tensor([1 + 2**-11 + 2**-40], dtype=torch.float64)
    assert x.to(torch.float16).item() == 1.0
    assert round_to_dtype(x, torch.float16).item() == 1 + 2**-10
    m = compare_tensors(x.to(torch.float16), x)
    assert m.max_ulp == 1 and m.max_ulp_error > 0.5


# -- the fast implementation against the pre-optimisation one (legacy_metrics.py) ----------

def _same_numbers(old: TensorMetrics, new: TensorMetrics) -> None:
    dx, dy = old.to_dict(), new.to_dict()
    for k in dx:
        if k == "p99_ulp" and dx[k] is not None and dx[k] >= 65536:
            # the old p99 was the lower edge of a bin 2**-12 wide; the new one is exact
            assert dx[k] <= dy[k] < dx[k] * (1 + 2**-12)
        else:
            assert dx[k] == dy[k], (k, dx[k], dy[k])
            if isinstance(dx[k], float):  # bit for bit: the sign of zero too
                assert math.copysign(1.0, dx[k]) == math.copysign(1.0, dy[k]), k


@pytest.mark.parametrize("dtype", DTYPES + [torch.float8_e5m2, torch.float64], ids=str)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.sampled_from([0, 1, 7, 100, 4096, 4097, 70000]),
       specials=st.booleans(), kind=st.sampled_from(["f64", "same", "identical"]),
       tol=st.booleans(), chunk=st.sampled_from([4096, 1 << 20]))
def test_fast_path_equals_legacy_bit_for_bit(dtype, seed, n, specials, kind, tol, chunk):
    from .legacy_metrics import compare_tensors as legacy
    a, e = _pair(seed, n, dtype, specials)
    if dtype == torch.float64:
        e = e * (1 + 2**-40)  # float64 ULP distances up to ~2**12
    e = {"f64": e, "same": round_to_dtype(e, dtype), "identical": a.clone()}[kind]
    kw = dict(atol=1e-2, rtol=1e-2) if tol else {}
    _same_numbers(legacy(a, e, chunk_elems=chunk, **kw), compare_tensors(a, e, chunk_elems=chunk, **kw))


def test_identical_tensors_take_the_shortcut_with_the_same_numbers():
    from .legacy_metrics import compare_tensors as legacy
    a, _ = _pair(5, 9000, torch.bfloat16, True)
    m = compare_tensors(a, a.clone(), chunk_elems=4096)
    _same_numbers(legacy(a, a.clone()), m)
    assert m.max_abs_err == 0.0 and m.max_ulp == 0.0 and m.p99_ulp == 0.0 and m.nan_mismatch == 0
    assert m.sqnr_db == math.inf and m.diff4_count == 0 and math.isnan(m.diff4)


def test_overflowing_expected_leaves_the_fast_path():
    # all finite, but 1e39 rounds to bf16 inf: must not count as finite-r
    e = torch.tensor([1.0, 1e39, 3.0], dtype=torch.float64)
    a = torch.tensor([1.0, math.inf, 3.0]).to(torch.bfloat16)
    m = compare_tensors(a, e)
    assert m.inf_mismatch == 0 and m.n_finite == 2 and m.max_ulp == 0


@pytest.mark.parametrize("chunk", [4096, 1 << 20])
@pytest.mark.parametrize("keep", [True, False])
def test_p99_is_exact_above_2_16_ulp_even_across_chunks(chunk, keep, monkeypatch):
    import precisiondiff.comparators.metrics as M
    if not keep:  # keep no large values: the coarse-bin + second-pass route
        init = M._P99Histogram.__init__
        monkeypatch.setattr(M._P99Histogram, "__init__", lambda self, dev, cap: init(self, dev, 0))
    g = torch.Generator().manual_seed(7)
    n = 30000
    e = torch.randn(n, generator=g, dtype=torch.float64).to(torch.float32)
    noise = torch.randint(0, 2**22, (n,), generator=g)
    a = (e.view(torch.int32) + noise.to(torch.int32)).view(torch.float32)
    m = compare_tensors(a, e, chunk_elems=chunk)
    d = np.sort(noise.numpy().astype(np.float64))
    assert m.p99_ulp == d[math.ceil(0.99 * n) - 1] and m.max_ulp == d[-1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fast_16bit_rounding_matches_round_to_odd_near_midpoints(dtype):
    from precisiondiff.comparators.ulp import _fix_overflow, _round_to_odd_f32, float_format
    g = torch.Generator().manual_seed(3)
    fmt = float_format(dtype)
    # float32 midpoints of the 16-bit format, nudged by a few float64 ULPs either way,
    # over the whole range: subnormals, normals, the overflow threshold
    v = torch.cat([torch.randn(20000, generator=g, dtype=torch.float64) * 2.0 ** k
                   for k in (-140, -130, -20, -14, -10, 0, 10, 15, 120, 127)])
    v = torch.cat([v, torch.tensor([fmt.overflow_threshold, fmt.max_finite, 2 * fmt.max_finite,
                                    math.inf, -math.inf, math.nan, 0.0, -0.0],
                                   dtype=torch.float64)])
    r16 = round_to_dtype(v, dtype).to(torch.float64)
    mid = ((r16 + torch.nextafter(r16.to(dtype), torch.tensor(math.inf, dtype=dtype))
            .to(torch.float64)) / 2)
    x = torch.cat([v, mid, torch.nextafter(mid, mid * 2), torch.nextafter(mid, mid * 0)])
    x32 = _round_to_odd_f32(x)
    want = _fix_overflow(x32, x32.to(dtype), fmt)
    got = round_to_dtype(x, dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
