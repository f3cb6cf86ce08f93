"""The fused compare kernel (numba) returns the PyTorch tile path's numbers bit for bit."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.comparators import compare_tensors, tiles_kernel


def _both(a, e, fused=False, **kw):
    """Both paths' metrics; with ``fused``, also check the kernel took every tile."""
    left, calls = [], []
    run = tiles_kernel.run
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tiles_kernel, "run", lambda *args: calls.append(1) or left.extend(run(*args)) or left)
        fast = compare_tensors(a, e, **kw).to_dict()
    assert not fused or (calls and not left), (calls, left)
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
def test_a_kernel_that_does_not_compile_leaves_every_tile_to_pytorch(dtype, monkeypatch):
    """Part of the kernel is LLVM vector code written by hand: an LLVM that refuses it (planted: the
    kernel raises as numba does on a failed compile) disables the kernels, with the same figures."""
    e = torch.linspace(-3.0, 5.0, 3 * 4096 + 17, dtype=torch.float64)
    a = (e * 1.001).to(dtype)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tiles_kernel, "AVAILABLE", False)
        slow = compare_tensors(a, e).to_dict()

    class Broken:
        @staticmethod
        def _tiles(*args):
            raise RuntimeError("LLVM ERROR: planted")

    class Loader:
        failed = False

        def __call__(self):
            return None if self.failed else Broken()

        def disable(self):
            self.failed = True
    monkeypatch.setattr(tiles_kernel, "_loader", Loader())
    monkeypatch.setattr(tiles_kernel, "_COMPILED", {})
    monkeypatch.setattr(tiles_kernel, "AVAILABLE", True)
    _assert_bitwise(compare_tensors(a, e).to_dict(), slow)
    assert not tiles_kernel.AVAILABLE and tiles_kernel._loader.failed


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


def _edge_expected(dtype: torch.dtype) -> torch.Tensor:
    """Values where the kernel's integer rounding and bit-pattern comparisons could slip:
    ties (to even and odd), just off a tie, around the smallest normal, subnormals, zeros of
    both signs, the largest finite value, powers of two."""
    mb = 7 if dtype == torch.bfloat16 else 23
    vals = []
    for base in (1.0, 1.5, 3.0, 2.0 ** -126, 2.0 ** -127, 2.0 ** -133, 2.0 ** -149, 2.0 ** 100):
        ulp = base * 2.0 ** -mb if base >= 2.0 ** -126 else 2.0 ** (-126 - mb)
        for k in (0, 1, 2, 3):
            for frac in (0.5, 0.5 - 2.0 ** -30, 0.5 + 2.0 ** -30, 0.25, 0.75):
                vals.append(base + (k + frac) * ulp)
    vals += [0.0, -0.0, 2.0 ** -1074, 2.0 ** -126 * (1 - 2.0 ** -(mb + 2)), 2.0 ** -126 * (1 - 2.0 ** -(mb + 1)),
             float(torch.finfo(dtype).max), 1e-3, 5e-3]
    e = torch.tensor(vals, dtype=torch.float64)
    return torch.cat([e, -e])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shift", [0, 1, -1])
def test_fused_edge_values(dtype, shift):
    """Ties, subnormals, signed zeros and exact tolerance/level boundaries: both paths agree
    bit for bit (actual = expected's correct rounding, moved by ``shift`` ULPs)."""
    e = _edge_expected(dtype)
    r = e.to(dtype)
    bits = r.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    a = (bits + shift * (bits != 0).to(bits.dtype)).view(dtype)
    a = torch.where(torch.isfinite(a.double()), a, r)
    big = torch.cat([e] * 80)[: 5000]  # past one block: the fused path's full-block staging
    abig = torch.cat([a] * 80)[: 5000]
    for aa, ee in ((a, e), (abig, big)):
        _assert_bitwise(*_both(aa, ee, fused=True))
        _assert_bitwise(*_both(aa, ee, fused=True, atol=1e-3, rtol=0.0))  # |d| == atol cases
        _assert_bitwise(*_both(aa, ee, fused=True, atol=0.0, rtol=2.0 ** -8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fused_tree_order_and_subnormal_rounding(dtype):
    """Values spread over 2**-60 .. 2**60, so that a sum taken in another order than the
    PyTorch tile's tree (every block's pairs, the first level in the element pass) differs,
    and a dense run of subnormal expected values near ties (the scaled rounding below the
    smallest normal); three full blocks and a partial one, all on the fused path."""
    mb = 7 if dtype == torch.bfloat16 else 23
    g = torch.Generator().manual_seed(11)
    n = 3 * 4096 + 1234
    e = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-60, 61, (n,), generator=g).to(torch.float64))
    sub = 2.0 ** (-126 - mb)  # the format's subnormal spacing
    k = torch.arange(2048, dtype=torch.float64)
    e[1000:3048] = (k + 0.5 + torch.tensor([0.0, 2.0 ** -20, -2.0 ** -20]).repeat(683)[:2048]) * sub
    e[5000:7048] = -(k * 3 + 0.5) * sub
    a = (e * (1 + 1e-2 * torch.randn(n, generator=g, dtype=torch.float64))).to(dtype)
    _assert_bitwise(*_both(a, e, fused=True))
    _assert_bitwise(*_both(a, e, fused=True, atol=1e-30, rtol=1e-3))


@pytest.mark.parametrize("room", [0, 70_000, 1 << 20])
def test_large_distances_beyond_the_kept_room(monkeypatch, room):
    """float32 distances of 2**16 and more, kept per thread up to ``_MAX_BIG``: the tiles past
    that room go to the PyTorch path, with the same numbers (threads taking batches)."""
    monkeypatch.setattr(tiles_kernel, "_MIN_PER_THREAD", 1 << 12)
    monkeypatch.setattr(tiles_kernel, "_MAX_BIG", room)
    g = torch.Generator().manual_seed(5)
    e = torch.randn(300_000, generator=g, dtype=torch.float64)
    a = (e * (1 + 0.3 * torch.randn(300_000, generator=g, dtype=torch.float64))).to(torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _assert_bitwise(*_both(a, e))
    finally:
        torch.set_num_threads(threads)


def _histogram_seen(a, e, monkeypatch) -> "torch.Tensor":
    """Every ULP distance the quantile's histogram received from one ``compare_tensors`` call,
    as a count per distance (the exact bins, the zeros and the large values kept)."""
    from precisiondiff.comparators import tiles
    parts = {"counts": [], "zeros": 0, "values": []}
    add_counts, add_zeros, add = tiles.P99Histogram.add_counts, tiles.P99Histogram.add_zeros, tiles.P99Histogram.add

    def counts(self, b):
        parts["counts"].append(b.clone())
        add_counts(self, b)

    def zeros(self, k):
        parts["zeros"] += k
        add_zeros(self, k)

    def values(self, d):  # (those below 2**16 reach add_counts from here)
        d = d.to(torch.int64)
        parts["values"].append(d[d >= 1 << 16])
        add(self, d)
    with monkeypatch.context() as m:
        m.setattr(tiles.P99Histogram, "add_counts", counts)
        m.setattr(tiles.P99Histogram, "add_zeros", zeros)
        m.setattr(tiles.P99Histogram, "add", values)
        compare_tensors(a, e)
    seen = torch.zeros(1 << 18, dtype=torch.int64)
    for b in parts["counts"]:
        seen[: b.numel()] += b
    seen[0] += parts["zeros"]
    for d in parts["values"]:
        seen += torch.bincount(d, minlength=seen.numel())
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mix", ["bands", "few_small", "all_small"])
def test_the_histogram_scan_counts_every_distance_band(dtype, mix, monkeypatch):
    """Distances planted exactly (actual = expected + d ULPs) across every band of the kernel's
    scan: 0 and 1 (the element pass's counts), the interleaved small bins, their edge, the
    direct bins, and 2**16 and more (kept as values, float32 only). ``bands``: in random order,
    so that the bands alternate element by element (the scan without a branch); ``few_small``:
    1 in 100 below 512 (the branch that predicts); ``all_small``: every one below 512 (no
    test). Both paths hand the quantile the planted counts."""
    g = torch.Generator().manual_seed(11)
    n = 3 * 4096 + 123  # a partial last block: its padding is not a distance
    top = 200_000 if dtype == torch.float32 else 16_000  # bfloat16: 1.0 + d ULPs stays finite
    edges = torch.tensor([0, 1, 2, 63, 64, 65, 511, 512, 513, 4095, 65535, 65536, 65537, top])
    edges = edges[edges < top]
    d = torch.where(torch.rand(n, generator=g) < 0.5, edges[torch.randint(0, edges.numel(), (n,), generator=g)],
                    torch.randint(0, top, (n,), generator=g))
    if mix == "few_small":
        d = torch.where(torch.rand(n, generator=g) < 0.01, d % 512, d.clamp(min=512))
    elif mix == "all_small":
        d = d % 512
    e = (1.0 + torch.rand(n, generator=g, dtype=torch.float64)).to(dtype)  # representable: rounds to itself
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    a = (e.view(bits).to(torch.int64) + d).to(bits).view(dtype)
    e = e.to(torch.float64)
    planted = torch.bincount(d, minlength=1 << 18)
    fast = _histogram_seen(a, e, monkeypatch)
    _assert_bitwise(*_both(a, e, fused=True))
    monkeypatch.setattr(tiles_kernel, "AVAILABLE", False)
    slow = _histogram_seen(a, e, monkeypatch)
    assert torch.equal(fast, planted) and torch.equal(slow, planted)
