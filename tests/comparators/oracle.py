"""Independent oracles for the comparator tests.

Written without precisiondiff: the ULP distance of small formats is the difference of *ranks*
in the sorted list of every representable value (built from ml_dtypes bit patterns); for
float32/float64 it is the sign-magnitude key of the bit pattern as an unbounded Python int.
Rounding is done by bisection in that sorted list with ties to the even bit pattern.
"""
from __future__ import annotations

import bisect
import functools
import math
import struct

import ml_dtypes
import numpy as np
import torch

NP_DTYPES = {
    torch.float16: np.float16,
    torch.bfloat16: ml_dtypes.bfloat16,
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e4m3fnuz: ml_dtypes.float8_e4m3fnuz,
    torch.float8_e5m2: ml_dtypes.float8_e5m2,
    torch.float8_e5m2fnuz: ml_dtypes.float8_e5m2fnuz,
}
FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz]
SMALL = [torch.float16, torch.bfloat16, *FP8]


@functools.lru_cache(maxsize=None)
def table(dtype: torch.dtype):
    """(all patterns as float64 values, sorted distinct non-NaN values, value->even pattern)."""
    nbits = 8 if dtype in FP8 else 16
    ui = np.uint8 if nbits == 8 else np.uint16
    pats = np.arange(2**nbits, dtype=np.uint64).astype(ui)
    with np.errstate(invalid="ignore"):
        vals = pats.view(NP_DTYPES[dtype]).astype(np.float64)
    distinct = sorted({float(v) for v in vals if not math.isnan(v)})
    parity = {}
    for p, v in zip(pats.tolist(), vals.tolist()):
        if not math.isnan(v) and v != 0.0:
            parity[v] = p & 1
    parity[0.0] = 0
    return vals, distinct, parity


def rank_distance(dtype: torch.dtype, x, y) -> np.ndarray:
    """ULP distances of arrays of values representable in ``dtype`` (NaN rules as documented).

    The distance is the difference of positions in the sorted list of distinct values.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    _, distinct, _ = table(dtype)
    srt = np.array(distinct)
    xs, ys = np.where(np.isnan(x), 0, x), np.where(np.isnan(y), 0, y)
    rx, ry = np.searchsorted(srt, xs), np.searchsorted(srt, ys)
    assert (srt[rx] == xs).all() and (srt[ry] == ys).all()
    d = np.abs(rx - ry).astype(np.float64)
    d[np.isnan(x) ^ np.isnan(y)] = np.nan
    d[np.isnan(x) & np.isnan(y)] = 0.0
    return d


def key_int(x: float, dtype: torch.dtype) -> int:
    """Ordered integer key of a float32/float64 value via struct (unbounded Python int)."""
    if dtype == torch.float64:
        (b,) = struct.unpack("<Q", struct.pack("<d", x))
        n = 64
    else:
        (b,) = struct.unpack("<I", struct.pack("<f", x))
        n = 32
    mag = b & ((1 << (n - 1)) - 1)
    return -mag if b >> (n - 1) else mag


def wide_distance(dtype: torch.dtype, x: float, y: float) -> float:
    if math.isnan(x) and math.isnan(y):
        return 0.0
    if math.isnan(x) or math.isnan(y):
        return math.nan
    return float(abs(key_int(x, dtype) - key_int(y, dtype)))


def round_oracle(dtype: torch.dtype, x: float) -> float:
    """Round a float64 to ``dtype``: nearest, ties to even pattern; overflow -> inf or NaN."""
    if math.isnan(x):
        return math.nan
    _, distinct, parity = table(dtype)
    finite = [v for v in distinct if math.isfinite(v) and v >= 0]
    has_inf = math.inf in distinct
    mx = finite[-1]
    top = finite[-1] - finite[-2]
    virtual = mx + top  # the first value past the end; its pattern parity flips
    ax = abs(x)
    if ax > virtual:
        r = math.inf
    else:
        i = bisect.bisect_left(finite, ax)
        if i < len(finite) and finite[i] == ax:
            r = ax
        else:
            lo = finite[i - 1]
            hi = finite[i] if i < len(finite) else virtual
            if ax - lo < hi - ax:
                r = lo
            elif hi - ax < ax - lo:
                r = hi
            else:
                p_hi = (1 - parity[mx]) if hi == virtual else parity[hi]
                r = hi if p_hi == 0 else lo
            if r == virtual:
                r = math.inf
    if math.isinf(r) and not has_inf:
        return math.nan
    return math.copysign(r, x) if r != 0.0 or _has_neg_zero(dtype) else 0.0


@functools.lru_cache(maxsize=None)
def _has_neg_zero(dtype: torch.dtype) -> bool:
    vals, _, _ = table(dtype)
    return any(v == 0.0 and math.copysign(1.0, v) < 0 for v in vals.tolist())
