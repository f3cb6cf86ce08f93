"""The numba kernel of a full watch step's update ratio (imported on first use, by :mod:`.tensors`).

One pass over a weight after the optimizer's step and its copy from before: ``sum w^2`` and
``sum (w - w_before)^2``, in float64 of the exact values, on the calling thread. The PyTorch path
it replaces makes three passes (an in-place subtraction, then two norms), and its subtraction runs
on every intra-op thread: on a CPU the bandwidth-bound pass costs each thread's time while adding
little speed, which is what watch's overhead is measured in (docs/performance.md, "Watch").
"""
from __future__ import annotations

import numba
import numpy as np

from ..capture._stats_jit import _pointer, _value

_jit = numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, error_model="numpy")


@_jit
def _sums(after, before):  # pragma: no cover - compiled
    """``(sum w^2, sum (w - b)^2)`` of two flat arrays of one dtype (a 16-bit format's bits)."""
    weight = 0.0
    update = 0.0
    for k in range(after.shape[0]):
        w = _value(after[k])
        d = w - _value(before[k])
        weight += w * w
        update += d * d
    return weight, update


# Entry points: each tensor's memory as an address, its element count (see _stats_jit's).


@_jit
def update_f32(after, before, n):  # pragma: no cover - compiled
    return _sums(numba.carray(_pointer(after), n, np.float32), numba.carray(_pointer(before), n, np.float32))


@_jit
def update_f64(after, before, n):  # pragma: no cover - compiled
    return _sums(numba.carray(_pointer(after), n, np.float64), numba.carray(_pointer(before), n, np.float64))


@_jit
def update_bf16(after, before, n):  # pragma: no cover - compiled
    return _sums(numba.carray(_pointer(after), n, np.int16), numba.carray(_pointer(before), n, np.int16))


@_jit
def update_f16(after, before, n):  # pragma: no cover - compiled
    return _sums(numba.carray(_pointer(after), n, np.uint16), numba.carray(_pointer(before), n, np.uint16))


# The same sums in parts of PART elements on numba's threads (``tensors.update_norms`` uses them
# when numba has a thread-safe layer): each part's float64 sums, added in part order, so any
# number of threads gives the same two numbers. And the snapshot's copy, part by part.

PART = 1 << 16
_parallel = numba.njit(cache=True, nogil=True, parallel=True, fastmath={"reassoc", "contract"}, error_model="numpy")


@_jit
def _in_order(parts):  # pragma: no cover - compiled
    weight = 0.0
    update = 0.0
    for i in range(parts.shape[0]):
        weight += parts[i, 0]
        update += parts[i, 1]
    return weight, update


@_parallel
def _parts(after, before):  # pragma: no cover - compiled
    n = after.shape[0]
    parts = np.empty(((n + PART - 1) // PART, 2))
    for i in numba.prange(parts.shape[0]):
        a = i * PART
        b = min(n, a + PART)
        parts[i, 0], parts[i, 1] = _sums(after[a:b], before[a:b])
    return _in_order(parts)


@_parallel
def copy_parts(dst, src, nbytes):  # pragma: no cover - compiled
    """``memcpy(dst, src, nbytes)`` (addresses) in parts of 1 MiB on numba's threads."""
    d = numba.carray(_pointer(dst), nbytes, np.uint8)
    s = numba.carray(_pointer(src), nbytes, np.uint8)
    step = 1 << 20
    for i in numba.prange((nbytes + step - 1) // step):
        a = i * step
        b = min(nbytes, a + step)
        d[a:b] = s[a:b]


@_jit
def parts_f32(after, before, n):  # pragma: no cover - compiled
    return _parts(numba.carray(_pointer(after), n, np.float32), numba.carray(_pointer(before), n, np.float32))


@_jit
def parts_f64(after, before, n):  # pragma: no cover - compiled
    return _parts(numba.carray(_pointer(after), n, np.float64), numba.carray(_pointer(before), n, np.float64))


@_jit
def parts_bf16(after, before, n):  # pragma: no cover - compiled
    return _parts(numba.carray(_pointer(after), n, np.int16), numba.carray(_pointer(before), n, np.int16))


@_jit
def parts_f16(after, before, n):  # pragma: no cover - compiled
    return _parts(numba.carray(_pointer(after), n, np.uint16), numba.carray(_pointer(before), n, np.uint16))
