"""The parallel form of :mod:`._stats_jit`'s kernel, for one large CPU tensor (watch's hooks).

The tensor is cut into parts of :data:`PART` elements, a size that does not depend on the number
of threads; each part is the serial kernel's (``_stats``), the parts run on numba's threads
(``prange``), and :func:`combine` joins them in order: the minimum and maximum, the float64 sums
in part order, and the fingerprint's two words moved to each part's periods (modulo 2**64, the
same words as one pass over the tensor). One thread or several, the result is the same; the sums
may differ in the last bits from the serial kernel's over the whole tensor (another order).

Why threads: watch runs between PyTorch's parallel operators, and on a CPU the statistics of a
large output (a decoder's logits) are compute-bound on one core while the other cores wait
(docs/performance.md, "Watch").
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ..store.fingerprint import _C1, PERIOD
from ._stats_jit import _pointer, _stats

PART = PERIOD  # elements per part: a multiple of the fingerprint's period
assert PART % PERIOD == 0

_jit = numba.njit(cache=True, nogil=True)
_parallel = numba.njit(cache=True, nogil=True, parallel=True)


@_parallel
def parts_f32(address, n, infinities, table, cumulative, out, fps):  # pragma: no cover - compiled
    values = numba.carray(_pointer(address), n, np.float32)
    bits = values.view(np.int32)
    for i in prange(out.shape[0]):
        a = i * PART
        b = min(n, a + PART)
        _stats(values[a:b], bits[a:b], infinities, table, cumulative, out, fps, i)


@_parallel
def parts_f64(address, n, infinities, table, cumulative, out, fps):  # pragma: no cover - compiled
    values = numba.carray(_pointer(address), n, np.float64)
    bits = values.view(np.int64)
    for i in prange(out.shape[0]):
        a = i * PART
        b = min(n, a + PART)
        _stats(values[a:b], bits[a:b], infinities, table, cumulative, out, fps, i)


@_parallel
def parts_bf16(address, n, infinities, table, cumulative, out, fps):  # pragma: no cover - compiled
    bits = numba.carray(_pointer(address), n, np.int16)
    for i in prange(out.shape[0]):
        a = i * PART
        b = min(n, a + PART)
        _stats(bits[a:b], bits[a:b], infinities, table, cumulative, out, fps, i)


@_parallel
def parts_f16(address, n, infinities, table, cumulative, out, fps):  # pragma: no cover - compiled
    bits = numba.carray(_pointer(address), n, np.int16)
    halves = bits.view(np.uint16)
    for i in prange(out.shape[0]):
        a = i * PART
        b = min(n, a + PART)
        _stats(halves[a:b], bits[a:b], infinities, table, cumulative, out, fps, i)


@_jit
def combine(out, fps, n, cumulative, dest, dest_fps):  # pragma: no cover - compiled
    """Join the parts' rows (``out[i]``, ``fps[i]`` for elements ``[i*PART, (i+1)*PART)``) into
    ``dest`` (7 float64) and ``dest_fps`` (2 int64), as one pass over all ``n`` elements reads."""
    lo = out[0, 0]
    hi = out[0, 1]
    s = sa = s2 = nan = inf = 0.0
    h1 = np.int64(0)
    h2 = np.int64(0)
    c1 = np.int64(_C1)
    for i in range(out.shape[0]):
        v = out[i, 0]
        if v < lo or (v == lo and math.copysign(1.0, v) < 0):  # -0 below +0, as the keys order them
            lo = v
        v = out[i, 1]
        if v > hi or (v == hi and math.copysign(1.0, v) > 0):
            hi = v
        s += out[i, 2]
        sa += out[i, 3]
        s2 += out[i, 4]
        nan += out[i, 5]
        inf += out[i, 6]
        # the part's kernel numbered its periods from 0; they are p0, p0 + 1, ... of the tensor:
        # h1 = sum_j a_j + (j*C1 + 1)*cum_j and h2 = sum_j q_j + (j*C1 + 1)*a_j gain p0*C1*sum cum_j
        # and p0*C1*sum a_j, where sum a_j = h1 - sum (j*C1 + 1)*cum_j (all modulo 2**64)
        m = min(PART, n - i * PART)
        p0 = np.int64(i * (PART // PERIOD))
        cum_sum = np.int64(0)
        weighted = np.int64(0)
        for j in range((m + PERIOD - 1) // PERIOD):
            c = cumulative[min(PERIOD, m - j * PERIOD)]
            cum_sum += c
            weighted += (np.int64(j) * c1 + np.int64(1)) * c
        h1 += fps[i, 0] + p0 * c1 * cum_sum
        h2 += fps[i, 1] + p0 * c1 * (fps[i, 0] - weighted)
    dest[0] = lo
    dest[1] = hi
    dest[2] = s
    dest[3] = sa
    dest[4] = s2
    dest[5] = nan
    dest[6] = inf
    dest_fps[0] = h1
    dest_fps[1] = h2
