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
