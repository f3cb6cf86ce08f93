"""The fused compare kernel (numba) returns the PyTorch tile path's numbers bit for bit."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.comparators import compare_tensors, tiles_kernel


def _both(a, e, **kw):
    fast = compare_tensors(a, e, **kw).to_dict()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tiles_kernel, "AVAILABLE", False)
        slow = compare_tensors(a, e, **kw).to_dict()
    return fast, slow


def _assert_bitwise(fast: dict, slow: dict) -> None:
    for k, v in slow.items():
        assert fast[k] == v, (k, fast[k], v)
        if isinstance(v, float):
            assert math.copysign(1.0, fast[k]) == math.copysign(1.0, v), k


def test_the_fast_path_is_there():
    """The test extra installs numba: this suite runs both paths."""
    assert tiles_kernel.AVAILABLE
    assert tiles_kernel._kernels() is not None  # the kernels' module compiles and imports


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.sampled_from([1, 3, 4096, 5000, 70000, 140000]),
       noise=st.sampled_from([0.0, 1e-3, 0.3]), tol=st.booleans(),
       special=st.sampled_from([None, math.nan, math.inf, 1e39, 0.0]), in_actual=st.booleans())
def test_fused_equals_torch_tiles(dtype, seed, n, noise, tol, special, in_actual):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, generator=g, dtype=torch.float64) * 10
    e[::7] *= 1e-40  # subnormal values: rounding, the spacing floor and the rel floor
    a = (e * (1 + noise * torch.randn(n, generator=g, dtype=torch.float64))).to(dtype)
    if special is not None:  # one tile leaves the fused path
        if in_actual:  # 1e39 becomes inf in float32 and bfloat16
            a[n // 2] = torch.tensor(special, dtype=torch.float64).to(dtype)
        else:
            e[n // 2] = special
    kw = dict(atol=1e-3, rtol=1e-2) if tol else {}
    _assert_bitwise(*_both(a, e, **kw))


def test_threads_split_the_tiles_with_the_same_numbers(monkeypatch):
    monkeypatch.setattr(tiles_kernel, "_MIN_PER_THREAD", 1 << 12)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        g = torch.Generator().manual_seed(3)
        e = torch.randn(300_000, generator=g, dtype=torch.float64)
        a = (e * (1 + 0.05 * torch.randn(300_000, generator=g, dtype=torch.float64))).to(torch.float32)
        e[200_000] = math.inf
        _assert_bitwise(*_both(a, e))
    finally:
        torch.set_num_threads(threads)
