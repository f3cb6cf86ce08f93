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
