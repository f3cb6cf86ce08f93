"""Statistics: the fused CPU kernel (numba) and the eager PyTorch path give the same numbers."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.capture import stats_kernel
from precisiondiff.capture.stats import StatsBatch
from precisiondiff.store import fingerprint

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
SPECIALS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 3e38, -6e4, 1e-40]


def _both(t: torch.Tensor):
    fast, eager = StatsBatch(), StatsBatch(fast=False)
    hf, he = fast.add(t), eager.add(t)
    fast.resolve()
    eager.resolve()
    return fast.get(hf), eager.get(he)


def _assert_same(f: dict, e: dict, n: int) -> None:
    if n == 0:
        assert f == e
        return
    assert f["fingerprint"] == e["fingerprint"]
    assert (f["nan"], f["inf"]) == (e["nan"], e["inf"])
    for k in ("min", "max"):  # exact: -0.0 == 0.0 (which zero aminmax returns is unspecified)
        assert f[k] == e[k] or (math.isnan(f[k]) and math.isnan(e[k])), k
    # float64 sums in another order: each differs by at most n ulps of the sum of magnitudes
    bound = n * 2.3e-16
    for k in ("abs_mean", "norm"):
        assert f[k] == pytest.approx(e[k], rel=bound, abs=1e-300, nan_ok=True), k
    scale = e["abs_mean"] if math.isfinite(e["abs_mean"]) else 0.0
    assert f["mean"] == pytest.approx(e["mean"], rel=bound, abs=bound * scale + 1e-300, nan_ok=True)


def test_the_fast_path_is_there():
    """The test extra installs numba: this suite runs both paths."""
    assert stats_kernel.AVAILABLE


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
       seed=st.integers(0, 2**31), specials=st.lists(st.sampled_from(SPECIALS), max_size=4),
       layout=st.sampled_from(["contiguous", "transposed", "strided"]))
def test_fused_equals_eager(dtype, shape, seed, specials, layout):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(*shape, 2, generator=g, dtype=torch.float64) * 100).to(dtype)
    flat = t.view(-1)
    for i, v in enumerate(specials[: flat.numel()]):
        flat[(i * 7919 + seed) % flat.numel()] = v
    if layout == "transposed":
        t = t.transpose(0, -1)
    elif layout == "strided":
        t = t.reshape(-1)[::2]
    f, e = _both(t)
    _assert_same(f, e, t.numel())
    assert f["fingerprint"] == fingerprint(t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_eager_over_several_fingerprint_periods(dtype):
    """Large tensors: 3.5 periods of 65536 elements, a NaN-free and a NaN-holding one."""
    g = torch.Generator().manual_seed(1)
    t = torch.randn(229_376, generator=g, dtype=torch.float64).to(dtype)
    f, e = _both(t)
    _assert_same(f, e, t.numel())
    t[100_000] = math.inf
    f, e = _both(t)
    _assert_same(f, e, t.numel())
    assert f["inf"] == 1 and f["max"] == math.inf
    t[200_000] = math.nan
    f, e = _both(t)
    _assert_same(f, e, t.numel())
    assert math.isnan(f["min"]) and math.isnan(f["max"])


def test_fast_path_is_taken_at_once_and_needs_no_snapshot():
    batch = StatsBatch()
    t = torch.ones(4)
    h = batch.add(t)
    t.mul_(5)
    assert batch.get(h)["mean"] == 1.0 and batch.pending_elements == 0


def test_empty_and_unsupported_dtypes_use_the_eager_path():
    for t in (torch.zeros(0), torch.arange(5), torch.tensor([True, False]),
              torch.ones(3, dtype=torch.complex64), torch.ones(3).to(torch.float8_e4m3fn)):
        f, e = _both(t)
        assert f == e


def test_a_negative_view_takes_the_eager_path():
    t = torch._neg_view(torch.tensor([1.0, -3.0, 2.0]))  # no NumPy view of a negative-bit tensor
    f, e = _both(t)
    assert f == e and f["min"] == -2.0 and f["max"] == 3.0


def _exponent_groups(dtype: torch.dtype) -> list:
    """Every bit pattern of a 16-bit float, one tensor per exponent (both signs, every
    fraction): within a group every float64 sum is exact in any order, so the fused and eager
    sums must be equal, not close. The all-ones exponent holds the infinities and NaNs."""
    fraction_bits = 10 if dtype == torch.float16 else 7
    codes = torch.arange(1 << 16, dtype=torch.int32)
    exponent = (codes >> fraction_bits) & ((1 << (15 - fraction_bits)) - 1)
    bits = codes.to(torch.int16).view(dtype)
    return [bits[exponent == e] for e in range(1 << (15 - fraction_bits))]


@pytest.mark.parametrize("dtype, flush_denormal", [(torch.bfloat16, False), (torch.float16, False),
                                                   (torch.float16, True)])
def test_every_16bit_pattern_is_widened_exactly(dtype, flush_denormal):
    """The widening by shifts (bfloat16) and integer arithmetic (float16) is exact for every bit
    pattern: subnormals, zeros, infinities, NaN payloads. Also where floats flush denormals
    (torch.set_flush_denormal(True)) for float16, whose subnormals are normal float32 numbers
    (the fast path's float32 denormals would read as 0); bfloat16 and float32 subnormals do read
    as 0 there, in this kernel as in PyTorch: that is what the mode means."""
    groups = _exponent_groups(dtype)
    expected = [_both(g)[1] for g in groups]
    if flush_denormal and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = [_both(g)[0] for g in groups]
    finally:
        torch.set_flush_denormal(False)
    for g, f, e in zip(groups, got, expected):
        assert f["fingerprint"] == e["fingerprint"] and (f["nan"], f["inf"]) == (e["nan"], e["inf"])
        for k in ("min", "max", "mean", "abs_mean", "norm"):
            assert f[k] == e[k] or (math.isnan(f[k]) and math.isnan(e[k])), (k, g[:3])
    assert sum(f["nan"] for f in got) == (254 if dtype == torch.bfloat16 else 2046)


def test_an_infinity_in_one_block_leaves_the_other_blocks_on_the_fast_path():
    """float16 blocks holding an Inf or NaN are widened the careful way, the others not; the
    sums of a tensor of subnormals and one far-away Inf stay exact where they are finite."""
    tiny = torch.arange(1, 1024, dtype=torch.int16).view(torch.float16)  # every subnormal
    t = torch.cat([tiny.repeat(8), torch.tensor([math.inf], dtype=torch.float16), tiny])
    f, e = _both(t)
    assert f["inf"] == 1 and f["max"] == math.inf and f["mean"] == math.inf
    assert f["min"] == e["min"] == 2.0 ** -24 and f["fingerprint"] == e["fingerprint"]
    f, e = _both(t[:-1024])
    assert f["mean"] == e["mean"] and f["norm"] == pytest.approx(e["norm"], rel=1e-15)


def test_started_read_back_gives_what_resolve_gives():
    """start() reduces and queues the eager path's results (the device path copies them into
    pinned memory there); resolve() afterwards reads them, as a direct resolve() does."""
    tensors = [torch.randn(50), torch.randn(70_000), torch.tensor([math.nan, 1.0])]
    direct, started = StatsBatch(fast=False), StatsBatch(fast=False)
    hd = [direct.add(t) for t in tensors]
    hs = [started.add(t) for t in tensors]
    started.start()
    assert started.pending_elements == 0
    direct.resolve()
    started.resolve()
    for a, b in zip(hd, hs):
        x, y = direct.get(a), started.get(b)
        assert x.keys() == y.keys() and all(x[k] == y[k] or x[k] != x[k] for k in x)


def test_a_failing_kernel_turns_the_fast_path_off_and_capture_goes_on(monkeypatch, caplog):
    """A kernel that fails to compile (another numba) must not raise into the workload: the
    eager path gives the statistics, now and for every later tensor."""
    class Broken:
        def __getattr__(self, name):
            def fail(*args):
                raise TypeError("cannot compile")
            return fail

    monkeypatch.setattr(stats_kernel, "_loader", lambda: Broken())
    monkeypatch.setattr(stats_kernel, "_LOADED", {})  # the entry points already looked up
    monkeypatch.setattr(stats_kernel, "_LOADED_AT", {})
    monkeypatch.setattr(stats_kernel, "AVAILABLE", True)
    t = torch.randn(100)
    f, e = _both(t)
    assert f == e and not stats_kernel.AVAILABLE
    assert "the fused statistics kernel failed (cannot compile): using PyTorch" in caplog.text


def _view(base: torch.Tensor, kind: str, data) -> torch.Tensor:
    """A strided view of ``base`` (2-D or more): transposed, permuted, sliced with steps, or
    broadcast (a zero stride)."""
    if kind == "transposed":
        return base.transpose(-1, -2)
    if kind == "permuted":
        return base.permute(*data.draw(st.permutations(range(base.dim()))))
    if kind == "stepped":
        return base[..., data.draw(st.integers(0, 1))::data.draw(st.integers(1, 3))]
    return base[..., :1].expand(*base.shape[:-1], data.draw(st.integers(1, 5)))


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(1, 70), min_size=2, max_size=4),
       kind=st.sampled_from(["transposed", "permuted", "stepped", "broadcast"]),
       specials=st.lists(st.tuples(st.integers(0, 10**9), st.sampled_from(SPECIALS)), max_size=4),
       data=st.data())
def test_a_strided_tensor_gives_what_its_row_major_copy_gives(dtype, shape, kind, specials, data):
    """The strided kernel reads a view in place, a fingerprint period at a time through a
    scratch buffer, in row-major order: every number equals the kernel's on the view's row-major
    copy, bit for bit (sums included: the same elements in the same order). Shapes reach past a
    period (65536 elements) and past the gather's 16-row tiles, with partial rows at period ends."""
    g = torch.Generator().manual_seed(len(shape))
    base = (torch.randn(*shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    flat = base.view(-1)
    for at, value in specials:
        flat[at % flat.numel()] = value
    t = _view(base, kind, data)
    if t.is_contiguous():
        return
    acc, fp = stats_kernel.fused_stats(t)
    acc_copy, fp_copy = stats_kernel.fused_stats(t.contiguous())
    assert np.array_equal(fp, fp_copy)
    assert np.array_equal(acc, acc_copy, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_parameters_and_subclasses_read_their_own_memory(dtype):
    """Plain tensors and parameters are read at their data pointer; a subclass through DLPack
    (it decides what its memory is); a transposed parameter in place, in row-major order."""
    class Tagged(torch.Tensor):
        pass

    base = torch.randn(40, 30, generator=torch.Generator().manual_seed(3)).to(dtype)
    for t in (torch.nn.Parameter(base.clone()), base.clone().as_subclass(Tagged),
              torch.nn.Parameter(base.clone()).t()):
        f, e = _both(t)
        _assert_same(f, e, t.numel())
        assert f["fingerprint"] == fingerprint(t.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_transposed_parameter_stays_on_the_fast_path(dtype):
    """A strided tensor that requires grad (``w.t()`` of a parameter, as a linear layer's
    weight reaches the dispatch) is read by the strided kernel: the eager fallback costs ~4x the
    fused pass per tensor (bench_capture_peers)."""
    w = torch.nn.Parameter(torch.randn(40, 30, generator=torch.Generator().manual_seed(4)).to(dtype)).t()
    assert w.requires_grad and not w.is_contiguous()
    acc, _ = stats_kernel.fused_stats(w)  # raises where the kernel cannot read the tensor
    assert (acc[0], acc[1]) == (w.min().item(), w.max().item())


@settings(max_examples=12, deadline=None)
@given(dtype=st.sampled_from(DTYPES), extra=st.integers(0, 3 * 65536), seed=st.integers(0, 2**16),
       specials=st.lists(st.tuples(st.integers(0, 10**9), st.sampled_from(SPECIALS)), max_size=4),
       threads=st.booleans())
def test_large_tensors_in_parts_equal_one_pass(dtype, extra, seed, specials, threads):
    """Watch's parallel form (stats_in_parts): the fingerprint, extremes and counts of one pass,
    the sums to float64 rounding, and the same numbers on numba's threads or one after another."""
    from precisiondiff import _numba
    g = torch.Generator().manual_seed(seed)
    n = stats_kernel.PARTS_FROM + extra
    t = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    for where, value in specials:
        t[where % n] = value

    def measure(on_threads: bool) -> dict:
        with pytest.MonkeyPatch.context() as mp:
            if not on_threads:
                mp.setattr(_numba, "threads", lambda count: False)
            batch = StatsBatch(parallel=True)
            handle = batch.add(t)
            batch.resolve()
            return batch.get(handle)

    f = measure(threads)
    serial, eager = _both(t)
    _assert_same(f, serial, n)
    _assert_same(f, eager, n)
    assert f["fingerprint"] == serial["fingerprint"] == fingerprint(t)
    other = measure(not threads)  # the same parts one after another, or on the threads
    assert other.keys() == f.keys()
    assert all(other[k] == f[k] or (math.isnan(other[k]) and math.isnan(f[k])) for k in f)


def test_without_the_parallel_kernels_large_tensors_take_the_serial_kernel(monkeypatch):
    """A parallel kernel that cannot load leaves the fused serial pass, not the eager path."""
    t = torch.randn(stats_kernel.PARTS_FROM + 5, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(stats_kernel, "_parts_loader", lambda: None)
    out, fps = np.zeros((1, 7)), np.zeros((1, 2), dtype=np.int64)
    stats_kernel.stats_in_parts(t, out, fps, 0)
    want, want_fps = np.zeros((1, 7)), np.zeros((1, 2), dtype=np.int64)
    stats_kernel.stats_into(t, want, want_fps, 0)
    assert (out == want).all() and (fps == want_fps).all()
