"""One-pass statistics and fingerprint of a CPU tensor, compiled with numba (optional).

:func:`fused_stats` reads each element once and returns what the eager path of
:mod:`precisiondiff.capture.stats` computes with about a dozen passes: ``min, max, sum,
sum |x|, sum x^2, NaN count, Inf count`` (float64 accumulation) and the two 64-bit words of
:mod:`precisiondiff.store.fingerprint` (exact: integer arithmetic modulo 2**64, the same
value in any order). Sums are accumulated in a different order from PyTorch's reductions,
so ``mean``, ``abs_mean`` and ``norm`` may differ from the eager path's in the last bits of
float64; minimum, maximum, counts and fingerprint are identical.

numba is an optional dependency (``pip install precisiondiff[fast]``): without it,
:data:`AVAILABLE` is False and the callers use the eager PyTorch path. Compiled code is
cached on disk (``cache=True``); four signatures are compiled, on first use.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np
import torch

from ..store.fingerprint import PERIOD, _C1, salts

__all__ = ["AVAILABLE", "fused_stats", "stats_into", "supports"]

try:  # pragma: no cover - depends on the environment
    if os.environ.get("PRECISIONDIFF_NO_NUMBA"):
        raise ImportError("disabled by PRECISIONDIFF_NO_NUMBA")
    import numba
    AVAILABLE = True
except ImportError:  # pragma: no cover
    numba = None
    AVAILABLE = False

_CHUNK = 4096  # elements per inner block: each block is read from L1 by every pass

if AVAILABLE:
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

_LUTS: dict = {}
_TABLE = salts("cpu").numpy()  # 1 ms (store.fingerprint builds it with NumPy)
assert _TABLE.shape[0] == PERIOD
_BITS_NP = {torch.float32: np.int32, torch.float64: np.int64}


_KINDS = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
_INT_VIEW = {torch.float32: torch.float32, torch.float64: torch.float64, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}


def supports(t: torch.Tensor) -> bool:
    """Whether :func:`stats_into` handles ``t`` (a CPU float16/bfloat16/float32/float64 tensor)."""
    return AVAILABLE and t.dtype in _KINDS and t.device.type == "cpu"


def _lut(dtype: torch.dtype) -> np.ndarray:
    """float32 value of every 16-bit pattern of ``dtype``."""
    lut = _LUTS.get(dtype)
    if lut is None:
        codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
        lut = _LUTS[dtype] = codes.view(dtype).to(torch.float32).numpy()
    return lut


def stats_into(t: torch.Tensor, out: np.ndarray, fps: np.ndarray, row: int) -> None:
    """Statistics and fingerprint of a CPU floating tensor in one pass over its memory.

    Writes ``out[row] = [min, max, sum, sum|x|, sum x^2, nan, inf]`` (float64; min and max
    ignore NaN: the caller applies NaN propagation) and ``fps[row, :2] = [h1, h2]`` (int64).

    Args:
        t: a tensor with :func:`supports` true and at least one element, any shape and strides
            (a non-contiguous tensor is copied once, in row-major order).
        out: float64 array of shape ``(rows, 7)``.
        fps: int64 array of shape ``(rows, 2)`` or more columns.
        row: the row to write.

    Raises:
        RuntimeError: PyTorch cannot expose the tensor's memory to NumPy (conjugate or
            negative views): use the eager path.
    """
    if t.requires_grad:
        t = t.detach()
    dtype = t.dtype
    if dtype is torch.float32:
        _stats_f32(t.numpy().ravel(), _TABLE, out, fps, row)
    elif dtype is torch.float64:
        _stats_f64(t.numpy().ravel(), _TABLE, out, fps, row)
    else:
        _stats_16(t.view(torch.int16).numpy().ravel(), _lut(dtype), _TABLE, out, fps, row)


def fused_stats(t: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`stats_into` for one tensor: ``([min, max, sum, sum|x|, sum x^2, nan, inf],
    [h1, h2])`` with min and max as floats (NaN ignored).

    Example:
        >>> acc, fp = fused_stats(torch.tensor([1.0, -2.0]))  # doctest: +SKIP
        >>> acc[:3].tolist()  # doctest: +SKIP
        [-2.0, 1.0, -1.0]
    """
    out = np.zeros((1, 7))
    fps = np.zeros((1, 2), dtype=np.int64)
    stats_into(t, out, fps, 0)
    return out[0], fps[0]
