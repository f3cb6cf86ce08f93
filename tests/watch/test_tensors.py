"""A full step's update ratio (precisiondiff/watch/tensors.py): the one-pass kernel of a CPU
weight and its snapshot against float64 arithmetic on the same values, on every format and
layout it takes or passes to PyTorch."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff import _numba
from precisiondiff.watch import tensors

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _exact(after: torch.Tensor, before: torch.Tensor):
    a, b = after.double(), before.double()
    return float(a.norm()), float((a - b).norm())


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 3000), scale=st.sampled_from([1e-3, 1.0, 30.0]),
       transposed=st.booleans(), seed=st.integers(0, 2**16))
def test_update_norms_are_the_float64_norms_of_the_values(dtype, n, scale, transposed, seed):
    g = torch.Generator().manual_seed(seed)
    after = (torch.randn(n, 3, generator=g, dtype=torch.float64) * scale).to(dtype)
    after = after.t() if transposed else after  # a strided weight: PyTorch's path
    moved = after.double() + 1e-2 * scale * torch.randn(after.shape, generator=g, dtype=torch.float64)
    before = moved.to(dtype)
    snap = tensors.snapshot([before])
    assert torch.equal(snap[0], before) and snap[0].data_ptr() != before.data_ptr()
    (weight,), (update,) = tensors.update_norms([after], snap)
    want_weight, want_update = _exact(after, before)
    # the kernel sums exact float64 values: float64 rounding only; PyTorch's path rounds the
    # difference and the sums to the tensor's format (its float32 accumulation for 16-bit ones)
    exact = _numba.ENABLED and not transposed
    rel = 1e-12 if exact else (1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5)
    assert math.isclose(float(weight), want_weight, rel_tol=rel)
    assert math.isclose(float(update), want_update, rel_tol=rel, abs_tol=1e-30)


def test_snapshot_is_a_copy_the_weights_step_does_not_change():
    w = torch.nn.Parameter(torch.randn(64, 8))
    snap = tensors.snapshot([w])
    before = w.detach().clone()
    with torch.no_grad():
        w.add_(1.0)
    assert torch.equal(snap[0], before) and not snap[0].requires_grad


@pytest.mark.skipif(not _numba.ENABLED, reason="numba is not installed")
def test_the_kernel_and_pytorchs_path_agree_on_a_mixed_list(monkeypatch):
    after = [torch.randn(100), torch.randn(10, 4).t(), torch.randn(50, dtype=torch.bfloat16), torch.empty(0)]
    before = [a + 0.01 for a in after]
    fast = tensors.update_norms(after, tensors.snapshot(before))
    monkeypatch.setattr(tensors, "_kernels", lambda: None)
    slow = tensors.update_norms(after, tensors.snapshot(before))
    for f, s in zip(fast[0] + fast[1], slow[0] + slow[1]):
        assert math.isclose(float(f), float(s), rel_tol=1e-2, abs_tol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_weights_sum_in_parts_to_the_float64_norms(dtype):
    """Weights of _PARTS_FROM elements or more take the parallel kernel (numba's threads)."""
    g = torch.Generator().manual_seed(3)
    n = tensors._PARTS_FROM * 2 + 12345
    before = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    after = (before.double() + 1e-3 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)
    (weight,), (update,) = tensors.update_norms([after], tensors.snapshot([before]))
    want_weight, want_update = _exact(after, before)
    rel = 1e-12 if _numba.ENABLED else (1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5)
    assert math.isclose(float(weight), want_weight, rel_tol=rel)
    assert math.isclose(float(update), want_update, rel_tol=rel)


def test_kept_snapshot_memory_is_reused_and_holds_exact_copies():
    memory = tensors.SnapshotMemory()
    big = torch.randn(tensors._COPY_PARTS_FROM // 4 + 17)  # a copy in parts
    ws = [torch.nn.Parameter(torch.randn(64, 8)), torch.randn(10, 3).t(), big,
          torch.randn(5, dtype=torch.bfloat16)]
    first = tensors.snapshot(ws, memory)
    assert all(torch.equal(s, w) for s, w in zip(first, ws))
    assert first[1].data_ptr() != ws[1].data_ptr()  # a strided weight: cloned, not in the buffer
    pointers = [s.data_ptr() for s in first]
    assert all(p % 64 == 0 for i, p in enumerate(pointers) if i != 1)
    with torch.no_grad():
        for w in ws:
            w.add_(1)
    second = tensors.snapshot(ws, memory)
    assert all(torch.equal(s, w) for s, w in zip(second, ws))
    assert [second[i].data_ptr() for i in (0, 2, 3)] == [pointers[i] for i in (0, 2, 3)]  # the same memory
    grown = tensors.snapshot(ws + [torch.randn(1000)], memory)  # more weights: a larger buffer
    assert all(torch.equal(s, w) for s, w in zip(grown, ws + [grown[-1]]))
    memory.release()
    assert memory._flat is None


def test_numba_threads_are_refused_in_a_forked_child(monkeypatch):
    """GNU OpenMP cannot run in a child forked after its threads started: numba stops the child."""
    monkeypatch.setattr(_numba, "_threads_ok", True)
    monkeypatch.setattr(_numba, "_threads_pid", -1)  # as a child of that process sees it
    assert _numba.threads(2) is False


def test_starting_numbas_threads_leaves_pytorchs_thread_count(tmp_path):
    """numba's OpenMP layer can share PyTorch's libgomp; starting it set that runtime's thread
    count to numba's (a torchrun rank's 1 became 2, and a watched DDP run no longer matched the
    unwatched one bit for bit)."""
    import os
    import subprocess
    import sys
    code = ("import torch\nfrom precisiondiff import _numba\nn = torch.get_num_threads()\n"
            "_numba.threads(n)\n_numba.threads(n)\nprint(n, torch.get_num_threads())\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("NUMBA_THREADING_LAYER", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]
