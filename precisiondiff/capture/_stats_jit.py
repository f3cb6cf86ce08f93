"""The numba kernels of :mod:`precisiondiff.capture.stats_kernel` (imported on first use:
importing numba costs about half a second)."""
from __future__ import annotations

import numba
import numpy as np

from ..store.fingerprint import _C1

_CHUNK = 4096  # elements per inner block: each block is read from L1 by every pass

_jit = numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, error_model="numpy")


@_jit
def _sums(values, out):  # pragma: no cover - compiled
    """out[2..6] += sum, sum|x|, sum x^2 (float64), then NaN and Inf counts, which are only
    counted when sum|x| is not finite (no NaN or Inf otherwise: the common case)."""
    s = sa = s2 = 0.0
    for k in range(values.shape[0]):
        v = np.float64(values[k])
        s += v
        sa += abs(v)
        s2 += v * v
    out[2] += s
    out[3] += sa
    out[4] += s2
    if not np.isfinite(sa):
        nan = inf = 0.0
        for k in range(values.shape[0]):
            v = np.float64(values[k])
            nan += 1.0 if v != v else 0.0
            inf += 1.0 if abs(v) == np.inf else 0.0
        out[5] += nan
        out[6] += inf


@_jit
def _int_pass(bits, sign, table, off, acc):  # pragma: no cover - compiled
    """Ordered-key minimum and maximum (``b ^ ((b >> w-1) & sign)``: integer order = float
    order, -0 below +0) and the fingerprint sums of one chunk within one period."""
    lo, hi = acc[0], acc[1]
    a1 = np.int64(0)
    a2 = np.int64(0)
    for k in range(bits.shape[0]):
        b = np.int64(bits[k])
        key = b ^ ((b >> 63) & sign)
        lo = min(lo, key)
        hi = max(hi, key)
        y = (b + off) * table[k]
        a1 += y
        a2 += y * b
    acc[0], acc[1] = lo, hi
    acc[2] += a1
    acc[3] += a2


@_jit
def _finish(acc, sign, width, lut, out, fps, row):  # pragma: no cover - compiled
    """Decode the ordered keys of the extremes (the map is an involution) to their values."""
    wide = np.empty(1, dtype=np.int64)
    narrow = np.empty(1, dtype=np.int32)
    for i in range(2):
        key = acc[i]
        b = key ^ ((key >> 63) & sign)
        if width == 64:
            wide[0] = b
            out[row, i] = wide.view(np.float64)[0]
        elif width == 32:
            narrow[0] = np.int32(b)
            out[row, i] = np.float64(narrow.view(np.float32)[0])
        else:
            out[row, i] = np.float64(lut[b & 0xFFFF])
    fps[row, 0] = acc[2]
    fps[row, 1] = acc[3]


@_jit
def _stats_wide(values, bits, sign, width, table, lut, out, fps, row):  # pragma: no cover - compiled
    """float32/float64: ``values`` and ``bits`` view the same memory."""
    n = values.shape[0]
    acc = np.empty(4, dtype=np.int64)
    acc[0] = np.iinfo(np.int64).max
    acc[1] = np.iinfo(np.int64).min
    acc[2] = acc[3] = 0
    o = out[row]
    o[:] = 0.0
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        _sums(values[start:stop], o)
        r = start & 65535
        off = np.int64(start >> 16) * np.int64(_C1) + np.int64(1)
        _int_pass(bits[start:stop], sign, table[r:r + stop - start], off, acc)
    _finish(acc, sign, width, lut, out, fps, row)


@_jit
def _stats_f32(values, table, out, fps, row):  # pragma: no cover - compiled
    _stats_wide(values, values.view(np.int32), 0x7FFFFFFF, 32, table, table, out, fps, row)


@_jit
def _stats_f64(values, table, out, fps, row):  # pragma: no cover - compiled
    _stats_wide(values, values.view(np.int64), 0x7FFFFFFFFFFFFFFF, 64, table, table, out, fps, row)


@_jit
def _stats_16(bits, lut, table, out, fps, row):  # pragma: no cover - compiled
    """16-bit floats, widened to float32 through a 65536-entry table (faster than bit
    shifts here: the table stays in L2)."""
    n = bits.shape[0]
    fwide = np.empty(min(n, _CHUNK), dtype=np.float32)
    acc = np.empty(4, dtype=np.int64)
    acc[0] = np.iinfo(np.int64).max
    acc[1] = np.iinfo(np.int64).min
    acc[2] = acc[3] = 0
    o = out[row]
    o[:] = 0.0
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        m = stop - start
        for k in range(m):
            fwide[k] = lut[np.uint16(bits[start + k])]
        _sums(fwide[:m], o)
        r = start & 65535
        off = np.int64(start >> 16) * np.int64(_C1) + np.int64(1)
        _int_pass(bits[start:stop], 0x7FFF, table[r:r + m], off, acc)
    _finish(acc, 0x7FFF, 16, lut, out, fps, row)
